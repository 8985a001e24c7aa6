"""`specdec plan`: which draft length k pays on given hardware, and why.

    specdec plan --model gemma-3-270m --hardware h100 --batch 1 --alpha 0.7 --out plan.png
    specdec plan --model gemma-3-270m --hardware this-machine --measure

Three reasons decide whether verifying k + 1 tokens per sequence costs about one decode step (see
docs/draft-length.md for the derivations):
  1. GEMM rows. A linear layer streams each weight once per forward (b bytes) and does 2 FLOPs per weight per
     row, so with n = B·(k+1) rows its arithmetic intensity is 2n / b FLOP/byte. Below the ridge point
     (peak FLOP/s ÷ bandwidth) it is memory-bound and extra rows are almost free: n_ridge = ridge · b / 2.
  2. Decode attention. Each cached K or V element (s bytes) is multiplied with each of the G = num_heads /
     num_kv_heads query heads sharing it for each of the D verified tokens: 2·G·D FLOPs per element, i.e.
     intensity 2·G·D / s FLOP/byte. Verifying D = k + 1 tokens multiplies it by D; past the ridge point the
     attention becomes compute-bound.
  3. MoE expert loading. With E experts, top-r routing and n tokens in the step, the expected number of distinct
     experts whose weights are read is E·(1 - (1 - r/E)^n): more verified tokens load more experts, so the
     "free rows" of (1) shrink. Dense models (all of ours) have no experts.
The table gives expected tokens per step E(k) = (1 - α^(k+1)) / (1 - α) and the expected speed-up
E(k) / (T(B·(k+1)) / T(B) + k·C), with T from the roofline model of named hardware or measured here.

With --tensor-parallel-size N (named hardware) T is one rank's step: its 1/N of the layers' weights, heads and
KV cache (the output layer whole, on rank 0, as specdec runs it), plus 2 all-reduces per layer of the step's
[rows, hidden] activations, each costing α + 2(N-1)/N · bytes / β (a ring all-reduce; α the interconnect's latency
for a small message, β its bandwidth per direction; --interconnect). A second table compares N = 1, 2, 4, 8.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from specdec.models.config import ModelConfig


# ---- hardware ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    """Dense (no sparsity) BF16 tensor-core FLOP/s and HBM bandwidth in bytes/s; int8 peaks are twice BF16."""

    name: str
    bf16_flops: float
    bandwidth: float
    source: str = ""

    def peak_flops(self, dtype: str) -> float:
        # int8 tensor cores: 2x BF16; fp32 weights: TF32 tensor cores, half of BF16 (same datasheets)
        return self.bf16_flops * {"int4": 2.0, "int8": 2.0, "bf16": 1.0, "fp16": 1.0, "fp32": 0.5}[dtype]

    def ridge_point(self, dtype: str) -> float:
        """FLOP per byte where a kernel stops being memory-bound."""
        return self.peak_flops(dtype) / self.bandwidth


HARDWARE = {
    "h100": Hardware(
        "H100 SXM",
        989e12,
        3.35e12,
        "NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979 TFLOPS with sparsity (989 dense), 3.35 TB/s HBM3",
    ),
    "h200": Hardware(
        "H200 SXM",
        989e12,
        4.8e12,
        "NVIDIA H200 Tensor Core GPU datasheet: BF16 1,979 TFLOPS with sparsity (989 dense), 4.8 TB/s HBM3e",
    ),
    "a100": Hardware(
        "A100 SXM",
        312e12,
        2.0e12,
        "NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS dense (624 sparse), 2,039 GB/s HBM2e (80 GB SXM)",
    ),
}
DTYPE_BYTES = {"int4": 0.5, "int8": 1, "bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Interconnect:
    """What one all-reduce costs between the ranks: α (latency of a small message, seconds) and β (bytes/s per
    direction per GPU)."""

    name: str
    latency_s: float
    bandwidth: float
    source: str = ""


INTERCONNECTS = {
    "nvlink4": Interconnect(
        "NVLink 4 (H100 SXM)", 8e-6, 450e9,
        "NVIDIA H100 datasheet: NVLink 900 GB/s per GPU (450 GB/s per direction); NCCL all-reduce of small messages "
        "on one NVSwitch node takes ~5-10 us (nccl-tests)"),
    "pcie5": Interconnect(
        "PCIe 5.0 x16", 15e-6, 50e9,
        "PCIe 5.0 x16: 64 GB/s per direction raw, ~50 GB/s achieved; ~10-20 us per small all-reduce through the host"),
    "100gbe": Interconnect(
        "100 GbE (multi-node)", 30e-6, 12.5e9,
        "100 Gb/s Ethernet = 12.5 GB/s per direction; RoCE round trips of ~10 us, a few per all-reduce"),
}
ACTIVATION_BYTES = 2  # bf16 activations in the all-reduces of a GPU engine
# our weight formats: q8 stores int8 weights (+ row scales), q4 4-bit (+ block scales); auto is mostly q4 on
# Q4_K files and q8 elsewhere, counted as int8 here (the upper bound)
WEIGHT_FORMAT_DTYPE = {"auto": "int8", "q4": "int4", "q8": "int8", "fp32": "fp32"}
MEASURE_BUDGET_S = 60.0  # `--measure`: wall-clock cap of profiling T(n) at every row count and the context costs
_SI = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}


def parse_hardware(text: str) -> Hardware | None:
    """h100 | h200 | a100 -> the table; "bw=3.35T,flops=989T" (bytes/s, BF16 FLOP/s; SI suffixes) -> custom;
    "this-machine" -> None (measured)."""
    name = text.strip().lower()
    if name == "this-machine":
        return None
    if name in HARDWARE:
        return HARDWARE[name]
    try:
        fields = dict(part.split("=", 1) for part in text.split(","))
        return Hardware(
            "custom", _si_number(fields.pop("flops")), _si_number(fields.pop("bw")), "given on the command line"
        )
    except (KeyError, ValueError) as error:
        raise ValueError(
            f"--hardware must be one of {', '.join(HARDWARE)}, this-machine or bw=<bytes/s>,flops=<FLOP/s> "
            f"(e.g. bw=3.35T,flops=989T), got {text!r}"
        ) from error


def parse_interconnect(text: str) -> Interconnect:
    """nvlink4 | pcie5 | 100gbe -> the table; "alpha=8us,bw=450G" (seconds with us/ms suffixes, bytes/s with SI
    suffixes) -> custom (e.g. what `python -m specdec.bench.tp_bench` measured here)."""
    name = text.strip().lower()
    if name in INTERCONNECTS:
        return INTERCONNECTS[name]
    try:
        fields = dict(part.split("=", 1) for part in text.split(","))
        return Interconnect("custom", _seconds(fields.pop("alpha")), _si_number(fields.pop("bw")),
                            "given on the command line")
    except (KeyError, ValueError) as error:
        raise ValueError(f"--interconnect must be one of {', '.join(INTERCONNECTS)} or alpha=<latency>,bw=<bytes/s> "
                         f"(e.g. alpha=8us,bw=450G), got {text!r}") from error


def _seconds(text: str) -> float:
    text = text.strip().lower()
    for suffix, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def _si_number(text: str) -> float:
    text = text.strip().upper().removesuffix("B/S").removesuffix("FLOPS")
    suffix = text[-1] if text and text[-1] in _SI else ""
    return float(text[: len(text) - len(suffix)]) * _SI[suffix]


# ---- the three reasons ---------------------------------------------------------------------------------
def gemm_intensity(rows: int, bytes_per_weight: float) -> float:
    """FLOP per weight byte of a linear layer over `rows` token rows: 2·rows / b."""
    return 2 * rows / bytes_per_weight


def gemm_rows_at_ridge(ridge: float, bytes_per_weight: float) -> float:
    """Rows at which a linear layer reaches the ridge point: ridge · b / 2."""
    return ridge * bytes_per_weight / 2


def attention_intensity(group: int, tokens: int, kv_bytes: float) -> float:
    """Decode attention FLOP per KV-cache byte: 2·G·D / s (G query heads per KV head, D verified tokens)."""
    return 2 * group * tokens / kv_bytes


def expected_experts(tokens: int, top_r: int, num_experts: int) -> float:
    """Expected distinct experts loaded by n tokens each routed to r of E experts: E·(1 - (1 - r/E)^n)."""
    return num_experts * (1 - (1 - top_r / num_experts) ** tokens)


def all_reduce_seconds(message_bytes: float, world_size: int, interconnect: Interconnect) -> float:
    """One all-reduce of a message_bytes message over world_size ranks: α + 2(N-1)/N · bytes / β (a ring sends and
    receives that share of the message on every link); 0 on one rank."""
    if world_size == 1:
        return 0.0
    return interconnect.latency_s + 2 * (world_size - 1) / world_size * message_bytes / interconnect.bandwidth


def tokens_per_step(alpha: float, k: int) -> float:
    """Expected tokens per verify step with a constant acceptance α: (1 - α^(k+1)) / (1 - α) (k + 1 at α = 1)."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


# ---- step time --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelStats:
    streamed_params: int  # weights read per forward (all layers + lm_head; the input embedding is a gather)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attended: Callable[[int], int] = field(repr=False)  # context -> sum over layers of positions attended
    hidden_size: int = 0
    output_params: int = 0  # of streamed_params, the output layer's (not split by tensor parallelism)

    @classmethod
    def of(cls, config: ModelConfig) -> ModelStats:
        attn = config.hidden_size * config.head_dim * (2 * config.num_heads + 2 * config.num_kv_heads)
        mlp = 3 * config.hidden_size * config.intermediate_size
        streamed = config.num_layers * (attn + mlp) + config.vocab_size * config.hidden_size

        def attended(context: int) -> int:
            return sum(min(context, config.sliding_window) if config.layer_type(i) == "sliding" else context
                       for i in range(config.num_layers))

        return cls(streamed, config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim, attended,
                   config.hidden_size, config.vocab_size * config.hidden_size)

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def roofline_seconds(stats: ModelStats, hardware: Hardware, dtype: str, batch: int, tokens: int, context: int,
                     kv_bytes: float, world_size: int = 1) -> float:
    """One forward of `batch` sequences x `tokens` new tokens each: max(bytes / bandwidth, FLOPs / peak); on
    world_size ranks, rank 0's share (1/N of the layers' weights, heads and KV cache, the whole output layer),
    without the all-reduces (`step_seconds`)."""
    rows = batch * tokens
    positions = stats.attended(context)
    params = (stats.streamed_params - stats.output_params) / world_size + stats.output_params
    kv_read = batch * positions * 2 * stats.num_kv_heads * stats.head_dim * kv_bytes / world_size
    weight_read = params * DTYPE_BYTES[dtype]
    flops = 2 * params * rows + 4 * stats.num_heads * stats.head_dim * positions * rows / world_size
    return max((weight_read + kv_read) / hardware.bandwidth, flops / hardware.peak_flops(dtype))


@dataclass(frozen=True)
class TensorParallelStep:
    """One step of `batch` sequences x `tokens` new tokens on world_size ranks."""

    world_size: int
    compute_s: float  # rank 0's roofline
    communication_s: float  # 2 all-reduces per layer

    @property
    def seconds(self) -> float:
        return self.compute_s + self.communication_s

    @property
    def communication_share(self) -> float:
        return self.communication_s / self.seconds


def tensor_parallel_step(stats: ModelStats, hardware: Hardware, dtype: str, batch: int, tokens: int, context: int,
                         kv_bytes: float, world_size: int, interconnect: Interconnect) -> TensorParallelStep:
    """Compute (roofline) plus communication (2 · layers all-reduces of [rows, hidden] activations) of one step;
    the all-reduces are not overlapped with compute (each needs the layer's output before the next starts)."""
    message = batch * tokens * stats.hidden_size * ACTIVATION_BYTES
    return TensorParallelStep(world_size,
                              roofline_seconds(stats, hardware, dtype, batch, tokens, context, kv_bytes, world_size),
                              2 * stats.num_layers * all_reduce_seconds(message, world_size, interconnect))


def tensor_parallel_table(stats: ModelStats, hardware: Hardware, dtype: str, batch: int, tokens: int, context: int,
                          kv_bytes: float, interconnect: Interconnect, sizes=(1, 2, 4, 8)) -> str:
    """Step time at each tensor-parallel size that divides the heads: compute, communication, its share, speed-up."""
    steps = [tensor_parallel_step(stats, hardware, dtype, batch, tokens, context, kv_bytes, size, interconnect)
             for size in sizes if stats.num_heads % size == 0 and stats.num_kv_heads % size == 0]
    lines = [f"tensor parallel over {interconnect.name} (α = {interconnect.latency_s * 1e6:.1f} us, β = "
             f"{interconnect.bandwidth / 1e9:.1f} GB/s; {interconnect.source}), {batch} x {tokens} rows per step:",
             " N | compute ms | all-reduce ms | comm share | step ms | speed-up over N = 1",
             "---|------------|---------------|------------|---------|--------------------"]
    for step in steps:
        lines.append(f"{step.world_size:2d} | {step.compute_s * 1e3:10.3f} | {step.communication_s * 1e3:13.3f} | "
                     f"{step.communication_share:10.1%} | {step.seconds * 1e3:7.3f} | "
                     f"{steps[0].seconds / step.seconds:19.2f}x")
    return "\n".join(lines)


# ---- the plan -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanRow:
    k: int
    tokens_per_step: float
    cost_ratio: float  # T(B·(k+1)) / T(B)
    speedup: float


@dataclass(frozen=True)
class Plan:
    rows: list[PlanRow]
    recommended_k: int
    reasons: list[str]
    alpha: float
    ridge: float

    def table(self) -> str:
        lines = [" k | tokens/step E(k) | T(B(k+1))/T(B) | expected speed-up",
                 "---|------------------|----------------|------------------"]
        for row in self.rows:
            mark = "  <- recommended" if row.k == self.recommended_k else ""
            lines.append(
                f"{row.k:2d} | {row.tokens_per_step:16.3f} | {row.cost_ratio:14.3f} | {row.speedup:16.2f}x{mark}"
            )
        return "\n".join(lines)


def analyse(config: ModelConfig, step_cost: Callable[[int], float], ridge: float, dtype: str, kv_bytes: float,
            batch: int, alpha: float, draft_cost: float = 0.0, max_k: int = 16,
            num_experts: int = 0, top_r: int = 0, tolerance: float = 0.02) -> Plan:
    """step_cost(tokens per sequence) -> seconds of one forward of batch x tokens rows (roofline or measured).

    draft_cost: the drafter's cost per proposed token as a fraction of T(B) (0 for ngram / suffix).
    """
    base = step_cost(1)
    rows = []
    for k in range(max_k + 1):
        ratio = step_cost(k + 1) / base
        expected = tokens_per_step(alpha, k)
        rows.append(PlanRow(k, expected, ratio, expected / (ratio + k * draft_cost)))
    best = max(row.speedup for row in rows)
    # the smallest k within `tolerance` of the best: the roofline ignores per-row overheads, so a longer draft
    # that buys < 2 % is not worth its rows (and its tokens to waste when acceptance drops)
    k = next(row.k for row in rows if row.speedup >= best * (1 - tolerance)) if best > 1 else 0
    reasons = _reasons(config, ridge, dtype, kv_bytes, batch, k, rows, num_experts, top_r)
    return Plan(rows, k, reasons, alpha, ridge)


def _reasons(config: ModelConfig, ridge: float, dtype: str, kv_bytes: float, batch: int, k: int, rows: list[PlanRow],
             num_experts: int, top_r: int) -> list[str]:
    bpw = DTYPE_BYTES[dtype]
    n = batch * (k + 1)
    group = config.num_heads // config.num_kv_heads
    knee_rows = gemm_rows_at_ridge(ridge, bpw)
    attn = attention_intensity(group, k + 1, kv_bytes)
    reasons = [
        f"GEMM rows: B·(k+1) = {batch}·{k + 1} = {n} rows, intensity 2·{n}/{bpw} = {gemm_intensity(n, bpw):.1f} FLOP/B "
        f"vs ridge point {ridge:.1f} FLOP/B ({dtype}, {bpw} B/weight): memory-bound up to ~{knee_rows:.0f} rows, "
        f"so {'verification rides on the weight stream' if n <= knee_rows else 'these rows already cost compute'}",
        f"decode attention: G = {config.num_heads}/{config.num_kv_heads} = {group} query heads per KV head, "
        f"D = {k + 1} tokens, intensity 2·G·D/s = 2·{group}·{k + 1}/{kv_bytes:g} = {attn:.1f} FLOP/B "
        f"({'below' if attn < ridge else 'above'} the ridge point {ridge:.1f}); "
        f"D reaches the ridge at {ridge * kv_bytes / (2 * group):.0f} tokens",
    ]
    if num_experts:
        loaded = expected_experts(n, top_r, num_experts)
        reasons.append(
            f"MoE: {n} tokens, top-{top_r} of {num_experts} experts load E·(1-(1-r/E)^n) = {loaded:.1f} experts "
            f"vs {expected_experts(batch, top_r, num_experts):.1f} without drafts"
        )
    else:
        reasons.append("MoE: dense model, no experts to load (for E experts and top-r routing, n tokens would load "
                       "E·(1-(1-r/E)^n) distinct experts)")
    best = rows[k]
    reasons.append(f"expected: {best.tokens_per_step:.2f} tokens per step for {best.cost_ratio:.2f}x the step time "
                   f"-> {best.speedup:.2f}x" + ("" if k else " (no k beats plain decoding)"))
    return reasons


def plot(plan: Plan, path: str | os.PathLike[str], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [row.k for row in plan.rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(ks, [row.tokens_per_step for row in plan.rows], marker="o")
    left.set(xlabel="draft length k", ylabel="expected tokens per step E(k)", title=f"α = {plan.alpha:.2f}")
    right.plot(ks, [row.speedup for row in plan.rows], marker="o", color="tab:green")
    right.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    right.axvline(plan.recommended_k, color="tab:red", linestyle=":", label=f"recommended k = {plan.recommended_k}")
    right.set(xlabel="draft length k", ylabel="expected speed-up over plain decoding", title="speed-up")
    right.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# ---- measuring ----------------------------------------------------------------------------------------------
def measured_ridge() -> tuple[float, str]:
    """This machine's fp32 matmul FLOP/s over its read bandwidth (a rough ridge point)."""
    import torch

    from specdec.engine.draft_length.measure import read_bandwidth_gbs

    a = torch.randn(1024, 1024)
    a @ a
    start = time.perf_counter()
    for _ in range(8):
        a @ a
    flops = 8 * 2 * 1024**3 / (time.perf_counter() - start)
    bandwidth = read_bandwidth_gbs(megabytes=256, repeats=3) * 1e9
    return flops / bandwidth, f"measured: {flops / 1e9:.0f} GFLOP/s fp32 matmul, {bandwidth / 1e9:.1f} GB/s read"


def measure_alpha(
    model, tokenizer, data_dir: Path, num_prompts: int = 4, max_tokens: int = 32
) -> tuple[float, list[float]]:
    """α from a short ngram run (k = 4, fixed) on a few prompts: pooled conditional acceptance, and per position."""
    from specdec.config import SamplingParams
    from specdec.engine.metrics import SpecDecodeMetrics
    from specdec.llm import LLM

    llm = LLM(loaded=(model, tokenizer), speculative_config={"method": "ngram", "num_speculative_tokens": 4},
              max_num_seqs=num_prompts, max_model_len=min(2048, model.config.max_position_embeddings),
              draft_policy="fixed", device=str(model.device))
    prompts = [llm.encode_prompt(text, chat=tokenizer.chat_template is not None)[-256:] for text in
               sample_prompts(data_dir, num_prompts)]  # prompt tails: keeps prefill short
    metrics = SpecDecodeMetrics()
    for result in llm.generate(prompts, SamplingParams(max_tokens=max_tokens)):
        metrics.merge(result.metrics)
    return conditional_acceptance(metrics)


def conditional_acceptance(metrics) -> tuple[float, list[float]]:
    """(pooled α, α_i per position): at position i, hits / steps that reached it with tokens 0..i-1 accepted."""
    reached = [
        d if i == 0 else min(d, metrics.accepted_per_position[i - 1])
        for i, d in enumerate(metrics.drafted_per_position)
    ]
    per_position = [a / r if r else 0.0 for a, r in zip(metrics.accepted_per_position, reached)]
    total = sum(reached)
    return (sum(metrics.accepted_per_position) / total if total else 0.0), per_position


def sample_prompts(data_dir: Path, count: int) -> list[str]:
    """First turns of a few Spec-Bench questions (summarization, rag: copy-heavy) and HumanEval prompts."""
    prompts = []
    bench = data_dir / "spec_bench_dev.jsonl"
    if bench.is_file():
        rows = [json.loads(line) for line in bench.read_text().splitlines() if line.strip()]
        for category in ("summarization", "rag", "coding"):
            prompts += [row["turns"][0] for row in rows if row["category"] == category][:1]
    humaneval = data_dir / "humaneval_dev.jsonl"
    if humaneval.is_file():
        prompts += [json.loads(line)["prompt"] for line in humaneval.read_text().splitlines()[:2] if line.strip()]
    if not prompts:
        raise FileNotFoundError(f"no benchmark prompts in {data_dir} (spec_bench_dev.jsonl / humaneval_dev.jsonl)")
    return prompts[:count]


# ---- command ------------------------------------------------------------------------------------------------
def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="catalogue name, .gguf path or HF directory")
    parser.add_argument(
        "--hardware", default="this-machine", help="h100 | h200 | a100 | this-machine | bw=3.35T,flops=989T"
    )
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together (B)")
    parser.add_argument("--alpha", type=float, default=None, help="acceptance rate α per draft token (default 0.7)")
    parser.add_argument("--measure", action="store_true", help="profile T(n) here and measure α with a short ngram run")
    parser.add_argument(
        "--draft-cost", type=float, default=0.0, help="drafter cost per proposed token as a fraction of T(B)"
    )
    parser.add_argument("--weight-format", default="auto", choices=list(WEIGHT_FORMAT_DTYPE))
    parser.add_argument(
        "--dtype", default=None, choices=sorted(DTYPE_BYTES), help="weight dtype (default: from --weight-format)"
    )
    parser.add_argument(
        "--kv-bytes",
        type=float,
        default=None,
        help="bytes per KV-cache element (default 2 on GPUs; here the model's cache: 2 beside q4/q8 weights, "
        "4 beside fp32)",
    )
    parser.add_argument("--context", type=int, default=1024, help="cached tokens per sequence (roofline)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks the model is split over (named hardware): T adds 2 all-reduces per layer")
    parser.add_argument("--interconnect", default="nvlink4",
                        help="with --tensor-parallel-size: nvlink4 | pcie5 | 100gbe | alpha=8us,bw=450G")
    parser.add_argument("--max-k", type=int, default=16)
    parser.add_argument(
        "--data", default=os.environ.get("SPECDEC_DATA", "/work/shared/data"), help="prompts for --measure"
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="write the plot (PNG) here")


def cmd_plan(args: argparse.Namespace) -> int:
    from specdec.engine.draft_length.costs import MAX_PROFILE_ROWS
    from specdec.engine.draft_length.measure import measure_cost_profile
    from specdec.engine.draft_length.profile_store import ProfileKey, load_or_measure, save_profile
    from specdec.runtime import configure_threads, load_model

    if args.batch < 1 or args.max_k < 0 or (args.alpha is not None and not 0 <= args.alpha <= 1):
        raise ValueError("need --batch >= 1, --max-k >= 0 and --alpha in [0, 1]")
    configure_threads(args.threads)
    hardware = parse_hardware(args.hardware)
    interconnect = parse_interconnect(args.interconnect)
    if args.tensor_parallel_size < 1 or (args.tensor_parallel_size > 1 and hardware is None):
        raise ValueError("--tensor-parallel-size must be >= 1, and > 1 needs named hardware (a roofline); this "
                         "machine's tensor-parallel costs: python -m specdec.bench.tp_bench")
    dtype = args.dtype or WEIGHT_FORMAT_DTYPE[args.weight_format]
    model, tokenizer = load_model(args.model, args.weight_format, "cpu")
    config = model.config
    forward, profile = None, None
    if args.measure or hardware is None:
        key = ProfileKey.current(args.model, args.weight_format)
        if args.measure:  # every row count, within a larger budget than a first use's (the user asked for it)
            run = measure_cost_profile(model, MEASURE_BUDGET_S, range(1, MAX_PROFILE_ROWS + 1))
            profile = run.samples.profile()
            print(f"[profiled in {run.seconds:.1f} s (at most {MEASURE_BUDGET_S:g} s): {run.summary()}; saved to "
                  f"{save_profile(key, profile)}]", file=sys.stderr)
        else:
            profile = load_or_measure(model, key)
        forward = profile.forward
    alpha, per_position = (args.alpha if args.alpha is not None else 0.7), []
    if args.measure:
        alpha, per_position = measure_alpha(model, tokenizer, Path(args.data))
        alpha = args.alpha if args.alpha is not None else alpha
    if hardware is None:
        ridge, source = measured_ridge()
        kv_bytes = args.kv_bytes or model.kv_cache_dtype.itemsize  # fp16 beside q4/q8 weights, fp32 beside fp32
        step_cost = lambda tokens: forward(args.batch * tokens)  # noqa: E731
        where = f"this machine ({source})"
    else:
        ridge, kv_bytes = hardware.ridge_point(dtype), args.kv_bytes or 2.0
        stats = ModelStats.of(config)
        step_cost = lambda tokens: tensor_parallel_step(  # noqa: E731
            stats, hardware, dtype, args.batch, tokens, args.context, kv_bytes, args.tensor_parallel_size,
            interconnect).seconds
        where = (f"{hardware.name} ({hardware.peak_flops(dtype) / 1e12:.0f} TFLOP/s {dtype}, "
                 f"{hardware.bandwidth / 1e12:.2f} TB/s; {hardware.source})")
        if args.tensor_parallel_size > 1:
            where += f", tensor parallel over {args.tensor_parallel_size} x {interconnect.name}"
    plan = analyse(config, step_cost, ridge, dtype, kv_bytes, args.batch, alpha, args.draft_cost, args.max_k)
    _print_plan(args, plan, where, per_position, forward, None if profile is None else profile.samples)
    if hardware is not None and args.tensor_parallel_size > 1:
        print()
        print(tensor_parallel_table(ModelStats.of(config), hardware, dtype, args.batch, plan.recommended_k + 1,
                                    args.context, kv_bytes, interconnect))
    if args.out:
        plot(plan, args.out, f"{args.model} on {args.hardware}, B = {args.batch}")
        print(f"[plot written to {args.out}]", file=sys.stderr)
    return 0


def _print_plan(args, plan: Plan, where: str, per_position: list[float], forward, samples=None) -> None:
    print(f"model {args.model}, batch {args.batch}, hardware: {where}")
    print(f"ridge point {plan.ridge:.1f} FLOP/byte; α = {plan.alpha:.3f}"
          + (f" (measured; per position {' '.join(f'{a:.2f}' for a in per_position)})" if per_position else ""))
    if forward is not None:
        measured = None if samples is None else samples.forward.values  # the rest is bounded from these
        print("measured T(n)/T(1): " + " ".join(
            f"{n}:{forward(n) / forward(1):.2f}{'' if measured is None or n in measured else '~'}"
            for n in (1, 2, 4, 8, 16, 32) if n <= forward.max_rows) + f" (T(1) = {forward(1) * 1e3:.2f} ms"
            + ("" if measured is None or measured.keys() >= {1, 2, 4, 8, 16, 32} else "; ~: not timed yet, bounded "
               "from the row counts timed") + ")")
    print(f"\nrecommended draft length k = {plan.recommended_k}")
    for reason in plan.reasons:
        print(f"  - {reason}")
    print()
    print(plan.table())
