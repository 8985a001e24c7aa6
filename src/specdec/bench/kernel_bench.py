"""Benchmark of the q8 linear kernel vs torch bf16 / fp32 F.linear.

    python -m specdec.bench.kernel_bench [--threads 2] [--shapes 640x1024,...] [--ms 1,2,4,8,16]

Per shape (in x out) and row count M: median wall time of q8_linear, T(M)/T(1),
GB/s of weight bytes (int8 weight + fp16 block scales for q8, 2 B/elem bf16, 4 B/elem fp32), and the
same for F.linear in bf16 and fp32.  Also: per-call overhead on tiny shapes and
attention timings.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

from specdec.kernels import ops

SHAPES = [
    (640, 1024),
    (640, 256),
    (1024, 640),
    (640, 4096),
    (2048, 640),
    (640, 262144),
    (1536, 1792),
    (1536, 1536),
    (1536, 17920),
    (8960, 1536),
    (1536, 151936),
]


def _median_time(fn, min_reps: int = 5, max_reps: int = 200, budget_s: float = 0.4) -> float:
    return _interleaved_median_times({None: fn}, min_reps, max_reps, budget_s)[None]


def _interleaved_median_times(fns: dict, min_rounds: int = 5, max_rounds: int = 200, budget_s: float = 1.5) -> dict:
    """Median seconds of each callable, called in rounds (each once per round), so that the machine's drift
    affects every entry alike (ratios such as T(8)/T(1) come from the same moments)."""
    for fn in fns.values():
        fn()
    times = {key: [] for key in fns}
    rounds, t_end = 0, time.perf_counter() + budget_s
    while rounds < min_rounds or (rounds < max_rounds and time.perf_counter() < t_end):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
        rounds += 1
    return {key: statistics.median(values) for key, values in times.items()}


def _rotating(make, nbytes: int, cold: bool):
    """A callable cycling through enough weight copies to overflow the L3 (cold) or one copy (hot)."""
    copies = min(64, max(1, -(-COLD_BYTES // nbytes))) if cold else 1
    ws = [make() for _ in range(copies)]
    state = [0]

    def next_weight():
        i = state[0]
        state[0] = (i + 1) % copies
        return ws[i]

    return next_weight


COLD_BYTES = 96 << 20  # > 32 MiB L3: every call streams its weight from DRAM, as in a real model


def bench_linear(shapes, ms, baselines=True, cold=True, layouts=None):
    mode = "cold (weights from DRAM)" if cold else "hot (weight may sit in L2/L3)"
    print(f"\n== q8_linear (isa={ops.kernel_isa()}, threads={torch.get_num_threads()}, {mode}) ==")
    hdr = f"{'shape KxN':>14} {'impl':>7} " + " ".join(f"{'M=' + str(m):>9}" for m in ms)
    hdr += f" {'T8/T1':>6} {'GB/s@1':>7}"
    print(hdr)
    print("-" * len(hdr))
    results = []
    for k, n in shapes:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(n, k, generator=g) * 0.05
        impls = []
        for layout in layouts or [ops.default_q8_layout()]:
            qw = ops.quantize_weight(w, layout)
            name = "q8" if layouts is None else f"q8-{layout}"
            impls.append((name, _rotating(qw.clone, qw.nbytes, cold), ops.q8_linear, qw.nbytes))
        if baselines:
            wb = w.to(torch.bfloat16)
            impls.append(("bf16", _rotating(lambda: wb.clone(), 2 * n * k, cold),
                          lambda x, wt: F.linear(x.to(torch.bfloat16), wt), 2 * n * k))
            impls.append(("fp32", _rotating(lambda: w.clone(), 4 * n * k, cold), F.linear, 4 * n * k))
        for name, weights, fn, nbytes in impls:
            inputs = {m: torch.randn(m, k, generator=g) for m in ms}
            times = _interleaved_median_times({m: (lambda x=x: fn(x, weights())) for m, x in inputs.items()})
            t1 = times[ms[0]]
            ratio = times[8] / t1 if 8 in times else float("nan")
            row = f"{k:>6}x{n:<7} {name:>7} " + " ".join(f"{times[m] * 1e3:8.3f}m" for m in ms)
            row += f" {ratio:6.2f} {nbytes / t1 / 1e9:7.1f}"
            print(row, flush=True)
            results.append((k, n, name, times))
        del impls
    return results


def bench_overhead():
    print("\n== per-call overhead (M=1) ==")
    for k, n in [(64, 64), (640, 256), (640, 1024)]:
        qw = ops.quantize_weight(torch.randn(n, k))
        x = torch.randn(1, k)
        t = _median_time(lambda: ops.q8_linear(x, qw), min_reps=200, max_reps=5000, budget_s=0.5)
        wd = qw.dequantize()
        tb = _median_time(lambda: F.linear(x, wd), min_reps=200, max_reps=5000, budget_s=0.3)
        print(f"{k:>6}x{n:<6} q8_linear {t * 1e6:7.2f} us   (fp32 F.linear {tb * 1e6:7.2f} us)")


def bench_attention():
    print("\n== attention (M rows, one slot, causal block after a context of L keys) ==")
    for hq, hkv, d in [(4, 1, 256), (12, 2, 128), (9, 3, 64)]:
        for ctx in (256, 1024, 4096):
            kc = torch.randn(2, hkv, ctx + 16, d)
            vc = torch.randn_like(kc)
            row = []
            for m in (1, 4, 8, 16):
                q = torch.randn(m, hq, d)
                slots = torch.zeros(m, dtype=torch.int32)
                ks = torch.zeros(m, dtype=torch.int32)
                ke = torch.arange(ctx + 1, ctx + m + 1, dtype=torch.int32)
                t = _median_time(lambda: ops.attention(q, kc, vc, slots, ks, ke, 1 / math.sqrt(d)))
                row.append(f"M={m}: {t * 1e6:8.1f} us")
            print(f"Hq={hq:>2} Hkv={hkv} D={d:>3} ctx={ctx:>5}  " + "  ".join(row), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shapes", default="", help="comma list of KxN (default: the model shapes)")
    p.add_argument("--ms", default="1,2,4,8,16")
    p.add_argument("--no-baselines", action="store_true", help="skip bf16/fp32 F.linear")
    p.add_argument("--skip-attention", action="store_true")
    p.add_argument("--hot", action="store_true", help="reuse one weight copy (it may stay cached)")
    p.add_argument("--layouts", default="", help="q8 weight layouts to compare, e.g. vnni,amx (default: this "
                   "machine's default layout)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    ops.build_kernels()
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    bench_overhead()
    layouts = [layout.strip() for layout in args.layouts.split(",") if layout.strip()] or None
    unknown = [layout for layout in layouts or [] if layout not in ops.Q8_LAYOUTS]
    if unknown:
        p.error(f"unknown layout(s) {', '.join(unknown)}; choose from {', '.join(ops.Q8_LAYOUTS)}")
    bench_linear(shapes, ms, baselines=not args.no_baselines, cold=not args.hot, layouts=layouts)
    if not args.skip_attention:
        bench_attention()


if __name__ == "__main__":
    main()
