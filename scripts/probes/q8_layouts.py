"""Probe: the int8 linear's two weight layouts (vnni, amx) side by side on one kernel path, in one process: median
time per call of each and the ratio amx / vnni, per shape and row count, with every call streaming its weight
from memory (4 weight copies cycled), and a check that each layout's outputs are its scalar path's bits.

    .venv/bin/python scripts/probes/q8_layouts.py [--isa avx2] [--shapes 896x4864,4864x896,640x65536]
        [--rows 1,2,4,5,8] [--calls 15]

A shape is IN x OUT. --isa picks the kernel path (default: the one this process runs); SPECDEC_AVX_VNNI=0 turns
the avx2 path's AVX-VNNI variant off.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.kernels import ops

COPIES = 4  # weight copies cycled through (--copies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", default=None)
    parser.add_argument("--shapes", default="896x4864,4864x896,640x65536,1536x8960")
    parser.add_argument("--rows", default="1,2,4,5,8")
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--copies", type=int, default=COPIES, help="weight copies cycled (1: weights cached)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    isa = args.isa or ops.kernel_isa()
    generator = torch.Generator().manual_seed(0)
    print(f"path {isa}{' with AVX-VNNI' if isa == 'avx2' and ops.avx_vnni_active() else ''}, "
          f"{args.threads} threads; ms per call (median of {args.calls}), amx / vnni")
    print("| shape | rows | vnni ms | amx ms | amx / vnni |\n|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        in_features, out_features = (int(v) for v in shape.split("x"))
        dense = [torch.randn(out_features, in_features, generator=generator) for _ in range(args.copies)]
        weights = {layout: [ops.quantize_weight(w, layout) for w in dense] for layout in ("vnni", "amx")}
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_features, generator=generator)
            with ops.forced_isa("scalar"):
                expected = {layout: ops.q8_linear(x, weights[layout][0]) for layout in weights}
            times: dict[str, list[float]] = {layout: [] for layout in weights}
            with ops.forced_isa(isa):
                for layout in weights:
                    if not torch.equal(ops.q8_linear(x, weights[layout][0]), expected[layout]):
                        raise SystemExit(f"{shape} rows {rows}: the {layout} layout differs from its scalar path")
                for call in range(args.calls * args.copies):
                    order = ("vnni", "amx") if call % 2 == 0 else ("amx", "vnni")
                    for layout in order:
                        weight = weights[layout][call % args.copies]
                        start = time.perf_counter()
                        ops.q8_linear(x, weight)
                        times[layout].append(time.perf_counter() - start)
            vnni, amx = (statistics.median(times[layout]) * 1e3 for layout in ("vnni", "amx"))
            print(f"| {shape} | {rows} | {vnni:.3f} | {amx:.3f} | {amx / vnni:.2f} |", flush=True)


if __name__ == "__main__":
    main()
