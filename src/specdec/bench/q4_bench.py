"""Micro-benchmark of the q4, q5 and q6 linears against the q8 linear, per kernel path, on model shapes.

    python -m specdec.bench.q4_bench [--threads 2] [--ms 1,2,4,8,16] [--isas avx2,avx512] [--hot] [--models Gemma,0.5B]

Per shape (in -> out), kernel path and format: the median wall time of one call at each row count M, T(8)/T(1),
and the weight bytes per weight. The q4 and q8 calls of one path run interleaved in the same rounds (so that the
machine's drift affects both alike); by default every call reads its weight from DRAM (copies cycled past the L3),
as in a decode step. A shape whose in_features is no multiple of 256 runs q4 padded with zero columns (its bits
column counts the padding); q6 (which only loads a file's Q6_K blocks) runs on random blocks where in_features is a
multiple of 256, q5 (which only loads a file's Q5_0 blocks) on random 5-bit values where it is a multiple of 32.
Also: the RMS error of quantize_q4's scale search against a plain min/max grid.
"""

from __future__ import annotations

import argparse

import torch

from specdec.bench.kernel_bench import _interleaved_median_times, _rotating
from specdec.bench.provenance import cpu_name
from specdec.kernels import ops, q4, q5, q6

# (model, in_features, out_features)
SHAPES = [
    ("Qwen2.5-Coder-1.5B", 1536, 8960),
    ("Qwen2.5-Coder-1.5B", 8960, 1536),
    ("Qwen2.5-Coder-1.5B", 1536, 1536),
    ("Qwen2.5-Coder-1.5B", 1536, 151936),  # the output layer (Q6_K in the file)
    ("Qwen2.5-Coder-0.5B", 896, 9728),  # gate/up (Q5_0 in the file)
    ("Qwen2.5-Coder-0.5B", 896, 1152),  # q/k/v (Q5_0, and Q8_0 v in half the layers)
    ("Qwen2.5-Coder-0.5B", 4864, 896),
    ("Gemma-3-270M", 640, 2048),
    ("Gemma-3-270M", 640, 4096),  # gate/up (Q5_0 in the file)
    ("Gemma-3-270M", 2048, 640),
]


def _random_q6(out_features: int, in_features: int, generator: torch.Generator) -> q6.Q6Weight:
    """Random Q6_K-like blocks (the kernel's time does not depend on the values)."""
    super_blocks = in_features // q6.SUPER_BLOCK
    return q6.Q6Weight.from_blocks(q6.Q6Blocks(
        torch.randint(0, 64, (out_features, in_features), generator=generator, dtype=torch.uint8),
        torch.randint(-128, 128, (out_features, 16 * super_blocks), generator=generator, dtype=torch.int8),
        (torch.rand(out_features, super_blocks, generator=generator) * 1e-3).to(torch.float16)))


def _random_q5(out_features: int, in_features: int, generator: torch.Generator) -> q5.Q5Weight:
    """Random Q5_0-like values (the kernel's time does not depend on them)."""
    return q5.Q5Weight.from_int8(
        torch.randint(q5.Q_MIN, q5.Q_MAX + 1, (out_features, in_features), generator=generator, dtype=torch.int8),
        (torch.rand(out_features, -(-in_features // q5.BLOCK), generator=generator) * 1e-2).to(torch.float16))


def _formats(weight: torch.Tensor) -> dict:
    """format name -> (packed weight, linear function)."""
    q8 = ops.quantize_weight(weight, "vnni")
    formats = {"q8": (q8, ops.q8_linear), "q4": (q4.quantize_q4(weight, search_steps=0), q4.q4_linear)}
    if q5.q5_supports(weight.shape[1]):
        formats["q5"] = (_random_q5(*weight.shape, torch.Generator().manual_seed(3)), q5.q5_linear)
    if q6.q6_supports(weight.shape[1]):
        formats["q6"] = (_random_q6(*weight.shape, torch.Generator().manual_seed(2)), q6.q6_linear)
    return formats


def bench_shape(model: str, in_features: int, out_features: int, isas, ms, cold: bool) -> list[str]:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=g) * 0.05
    formats = _formats(weight)
    weights = {name: _rotating(packed.clone, packed.nbytes, cold) for name, (packed, _) in formats.items()}
    inputs = {m: torch.randn(m, in_features, generator=g) for m in ms}
    lines = []
    for isa in isas:
        with ops.forced_isa(isa):
            calls = {(name, m): (lambda fn=fn, name=name, x=x: fn(x, weights[name]()))
                     for name, (_, fn) in formats.items() for m, x in inputs.items()}
            times = _interleaved_median_times(calls)
        for name, (packed, _) in formats.items():
            per_m = [times[(name, m)] for m in ms]
            ratio = times[(name, 8)] / times[(name, ms[0])] if 8 in ms else float("nan")
            bits = 8.0 * packed.nbytes / (in_features * out_features)
            speedup = ""
            if name != "q8":
                speedup = " ".join(f"{times[('q8', m)] / times[(name, m)]:5.2f}x" for m in ms)
            lines.append(f"{model:<19} {in_features:>5}->{out_features:<5} {isa:>6} {name:>3} {bits:5.2f} "
                         + " ".join(f"{t * 1e3:8.3f}" for t in per_m) + f" {ratio:6.2f}  {speedup}")
    return lines


def search_error_line() -> str:
    """RMS error of quantize_q4 with the scale search vs the plain min/max grid, on heavy-tailed weights."""
    g = torch.Generator().manual_seed(1)
    weight = torch.distributions.StudentT(5.0).sample((512, 1536)) * 0.02
    weight[:, torch.randint(0, 1536, (12,), generator=g)] *= 6.0
    rms = weight.pow(2).mean().sqrt().item()
    errors = {}
    for steps in (0, 20):
        quantized = q4.quantize_q4(weight, search_steps=steps)
        errors[steps] = (quantized.dequantize() - weight).pow(2).mean().sqrt().item()
    return (f"quantize_q4 RMS error / weight RMS (512 x 1536 Student-t(5) weights, outlier columns): "
            f"min/max {errors[0] / rms:.4f}, search {errors[20] / rms:.4f} ({errors[20] / errors[0]:.3f}x)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ms", default="1,2,4,8,16")
    parser.add_argument("--isas", default="", help="kernel paths to compare (default: every vector path the CPU has)")
    parser.add_argument("--hot", action="store_true", help="reuse one weight copy (it may stay cached)")
    parser.add_argument("--skip-search-error", action="store_true")
    parser.add_argument("--models", default="", help="only the shapes of models whose name contains one of these "
                        "comma-separated strings (default: every shape)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ops.build_kernels()
    ms = [int(v) for v in args.ms.split(",")]
    isas = [isa for isa in args.isas.split(",") if isa] or [isa for isa in ops.supported_isas() if isa != "scalar"]
    mode = "hot (one weight copy)" if args.hot else "cold (weights from DRAM)"
    print(f"CPU: {cpu_name()}; threads {args.threads}; {mode}; median ms per call")
    header = (f"{'model':<19} {'in->out':>11} {'path':>6} {'fmt':>3} {'bits':>5} "
              + " ".join(f"{'M=' + str(m):>8}" for m in ms) + f" {'T8/T1':>6}  q8 time / this format's per M")
    print(header)
    print("-" * len(header))
    wanted = [name for name in args.models.split(",") if name]
    for model, in_features, out_features in SHAPES:
        if wanted and not any(name in model for name in wanted):
            continue
        for line in bench_shape(model, in_features, out_features, isas, ms, cold=not args.hot):
            print(line, flush=True)
    if not args.skip_search_error:
        print(search_error_line())


if __name__ == "__main__":
    main()
