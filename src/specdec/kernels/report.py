"""Which kernel path a process runs, and what a slow one costs: never silently slow.

``specdec generate``, ``specdec serve`` and ``specdec bench`` print :meth:`KernelReport.line` on stderr, and a
warning line when only the scalar path or the torch fallback runs (why, and what it costs); ``GET /v1/specdec/info`` and
the bench's results.json carry :meth:`KernelReport.to_dict`.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from specdec.kernels import ops

FAST_PATHS = ("avx2", "avx512", "amx")
# python -m specdec.bench.isa_bench --isas scalar,avx2,avx512 --rounds 1 --max-tokens 32 --threads 2 (AMD EPYC Zen 4,
# 2026-12-02): decode 11.8 / 68.5 / 64.8 tok/s, prefill 15 / 657 / 1540 tok/s, T(8)/T(1) 6.13 / 2.34 / 1.37
SCALAR_COST = (
    "about 6x slower decoding and 40x slower prefill than the avx2 path (Gemma-3-270M, 2 threads: 12 against "
    "68 tok/s), and speculation rarely pays there: 8 verified rows cost 6 decoded ones"
)
TORCH_COST = ("slower decoding than the compiled kernels (a dequantized copy of every weight, no int8 arithmetic), "
              "and the torch fallback is not row invariant: speculative greedy output may differ from plain decoding")
FP32_COST = ("torch's matmul is not row invariant: speculative greedy output may differ from plain decoding "
             "(fp32 is the reference for parity with HF transformers)")
# weight formats whose linear layers run our fixed-order kernels (fp32 runs torch's F.linear)
ROW_INVARIANT_FORMATS = ("auto", "q4", "q4-all", "q5", "q8")
CUDA_COST = ("the torch fallback is not row invariant: speculative greedy output may differ from plain decoding "
             "(exactness is not guaranteed on CUDA)")


@dataclass(frozen=True)
class KernelReport:
    isa: str  # the path kernel calls run: "amx" | "avx512" | "avx2" | "scalar" | "torch" (the fallback)
    supported: tuple[str, ...]  # the paths this CPU runs, slowest first; () without the compiled kernels
    weights: str  # "q8 vnni layout", "q8 amx layout", "fp32", or a mix: "auto: q4 612 MB + q8 vnni layout 530 MB"
    threads: int  # torch's intra-op threads, which the kernels share
    build: str  # ops.kernel_build_id(): "q8-<digest>-<isa>" or "torch"
    reason: str | None = None  # why only the scalar path or the fallback runs; None on a SIMD path
    cost: str | None = None  # what that costs
    # every op row invariant: our compiled kernels (any ISA path, the scalar one included) with q4/q8/auto weights on
    # the CPU; then greedy and seeded exact-acceptance speculation reproduce plain decoding bit for bit
    bit_exact: bool = False
    avx_vnni: bool = False  # the avx2 path runs its AVX-VNNI variant (256-bit vpdpbusd; the same bits)

    @property
    def warning(self) -> str | None:
        if self.reason is None:
            return None
        path = ("the torch fallback" if self.isa == "torch" else "fp32 weights" if self.weights == "fp32"
                else f"the {self.isa} kernels")
        return f"specdec runs {path} because {self.reason}: {self.cost}"

    def line(self) -> str:
        path = f"{self.isa} with AVX-VNNI" if self.avx_vnni else self.isa
        return f"[kernels: {path} ({self.weights}), {self.threads} thread{'s' if self.threads != 1 else ''}]"

    def to_dict(self) -> dict[str, Any]:
        return {"kernel_isa": self.isa, "supported_kernel_isas": list(self.supported), "kernel_weights": self.weights,
                "kernel_threads": self.threads, "kernel_build": self.build, "kernel_warning": self.warning,
                "bit_exact": self.bit_exact, "kernel_avx_vnni": self.avx_vnni}


def describe_weights(weight_format: str, linear_bytes: dict[str, int] | None = None) -> str:
    """What the linears run as: "q8 vnni layout", or per format its bytes ("auto: q4 612 MB + q8 vnni layout
    530 MB") when ``linear_bytes`` (Transformer.linear_bytes()) is given."""
    labels = {"q8": f"q8 {ops.default_q8_layout()} layout", "q4": "q4", "fp32": "fp32"}
    if not linear_bytes:
        return labels.get(weight_format, weight_format)
    if len(linear_bytes) == 1:
        only = next(iter(linear_bytes))
        return labels.get(only, only)
    parts = " + ".join(
        f"{labels.get(name, name)} {nbytes / 1e6:.0f} MB" for name, nbytes in sorted(linear_bytes.items())
    )
    return f"{weight_format}: {parts}"


def kernel_report(device: torch.device | str = "cpu", weight_format: str = "q8",
                  linear_bytes: dict[str, int] | None = None) -> KernelReport:
    """The kernel path that runs a model on ``device`` with ``weight_format`` weights in this process;
    linear_bytes: the model's bytes per resolved format (Transformer.linear_bytes())."""
    on_cuda = torch.device(device).type != "cpu"
    isa = "torch" if on_cuda else ops.kernel_isa()
    supported = ops.supported_isas()
    weights = describe_weights(weight_format, linear_bytes)
    reason, cost = _why_slow(isa, supported, on_cuda)
    if reason is None and weight_format == "fp32":
        reason, cost = "--weight-format fp32 runs the linear layers on torch's F.linear", FP32_COST
    bit_exact = not on_cuda and isa != "torch" and weight_format in ROW_INVARIANT_FORMATS
    return KernelReport(isa, supported, weights, torch.get_num_threads(), "torch" if on_cuda else ops.kernel_build_id(),
                        reason, cost, bit_exact, avx_vnni=not on_cuda and ops.avx_vnni_active())


def _why_slow(isa: str, supported: tuple[str, ...], on_cuda: bool) -> tuple[str | None, str | None]:
    if isa in FAST_PATHS:
        return None, None
    if on_cuda:
        return "the model is on CUDA, where specdec has no kernels of its own", CUDA_COST
    if isa == "torch":
        return _why_torch(), TORCH_COST
    if os.environ.get("SPECDEC_KERNEL_ISA") == "scalar":
        return "SPECDEC_KERNEL_ISA=scalar forces the portable path", SCALAR_COST
    if supported == ("scalar",):
        return "this CPU lacks AVX2 + FMA + F16C", SCALAR_COST
    return "the scalar path was chosen at run time (kernels.forced_isa)", SCALAR_COST


def _why_torch() -> str:
    if os.environ.get("SPECDEC_DISABLE_KERNELS", "") not in ("", "0"):
        return f"SPECDEC_DISABLE_KERNELS={os.environ['SPECDEC_DISABLE_KERNELS']} turns the compiled kernels off"
    failure = ops.build_failure()
    if failure is not None:
        return f"the compiled kernels failed to build or load ({failure})"
    return "the compiled kernels are not loaded"


def announce_kernels(device: torch.device | str = "cpu", weight_format: str = "q8",
                     file: TextIO | None = None, linear_bytes: dict[str, int] | None = None) -> KernelReport:
    """Prints the report's line on stderr (or ``file``), and its warning on the next line when a slow path runs."""
    report = kernel_report(device, weight_format, linear_bytes)
    out = file or sys.stderr
    print(report.line(), file=out, flush=True)
    if report.warning is not None:
        print(f"[warning: {report.warning}]", file=out, flush=True)
    return report
