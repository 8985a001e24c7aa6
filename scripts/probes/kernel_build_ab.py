"""Probe: two builds of the kernels side by side in one process, on the same weights and activations: median time
per call of each build's linear and the ratio, per shape and row count, and a check that both give the same bits.

    .venv/bin/python scripts/probes/kernel_build_ab.py BEFORE.so AFTER.so [--format q5] [--isa avx2]
        [--shapes 896x9728,896x896,1536x8960] [--rows 1,2,3,4,5,6,7,8,12,16]

--format: q5, q8 (the vnni layout), q8-amx (the amx layout), q4 or q6 (GGUF Q4_K's and Q6_K's blocks; IN a
multiple of 256).

BEFORE.so and AFTER.so are compiled kernel modules: the installed one (src/specdec/kernels/_q8.*.so) and a
development build of other sources (``$XDG_CACHE_HOME/specdec/kernels/<digest>/specdec_q8_<digest>.so``, which a
process importing specdec from that checkout compiles). A copy keeps its file name (the module's name): copy the
installed build into a directory of its own, e.g. /tmp/before/, before rebuilding it. Calls alternate between
the builds (each in turn first) and cycle through 4 copies of the weight, so that every call streams its weight
from memory as a forward does, and a machine's slow minutes fall on both builds alike. The weights are random,
packed by this checkout's Python.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch

from specdec.kernels import ops
from specdec.kernels.q4 import quantize_q4
from specdec.kernels.q5 import Q5Weight
from specdec.kernels.q6 import Q6Blocks, Q6Weight

COPIES = 4  # weight copies cycled through (more than the caches hold for the default shapes)


def load_build(path: str):
    """The compiled module at path (its module name is the file's stem up to the first dot)."""
    name = Path(path).name.split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a loadable module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def weight_calls(fmt: str, in_features: int, out_features: int, generator: torch.Generator) -> list:
    """COPIES callables (build, x) -> y of one random weight in ``fmt`` each."""
    calls = []
    for _ in range(COPIES):
        if fmt == "q5":
            q = torch.randint(-16, 16, (out_features, in_features), generator=generator, dtype=torch.int8)
            scale = (torch.rand(out_features, -(-in_features // 32), generator=generator) * 0.01).half()
            weight = Q5Weight.from_int8(q, scale)
            calls.append(lambda build, x, w=weight: build.q5_linear(x, w.quants, w.scale, None, w.in_features))
        elif fmt == "q8":
            weight = ops.quantize_weight(torch.randn(out_features, in_features, generator=generator), "vnni")
            calls.append(lambda build, x, w=weight: build.q8_linear(x, w.qweight, w.scale, None, w.in_features))
        elif fmt == "q8-amx":
            weight = ops.quantize_weight(torch.randn(out_features, in_features, generator=generator), "amx")
            calls.append(lambda build, x, w=weight: build.q8_linear_amx(x, w.qweight, w.tile_scale, None,
                                                                       w.in_features, w.out_features))
        elif fmt == "q4":
            weight = quantize_q4(torch.randn(out_features, in_features, generator=generator), search_steps=0)
            calls.append(lambda build, x, w=weight: build.q4_linear(x, w.quants, w.scales, None, w.in_features))
        elif fmt == "q6":
            weight = Q6Weight.from_blocks(Q6Blocks(
                quants=torch.randint(0, 64, (out_features, in_features), generator=generator, dtype=torch.uint8),
                sub_scales=torch.randint(-128, 128, (out_features, in_features // 16), generator=generator,
                                         dtype=torch.int8),
                d=(torch.rand(out_features, in_features // 256, generator=generator) * 1e-4).half()))
            calls.append(lambda build, x, w=weight: build.q6_linear(x, w.quants, w.scales, None))
        else:
            raise SystemExit(f"--format {fmt!r}: choose q4, q5, q6, q8 or q8-amx")
    return calls


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--format", default="q5", help="q4, q5, q6, q8 (the vnni layout) or q8-amx")
    parser.add_argument("--isa", default="avx2", help="the kernel path both builds run")
    parser.add_argument("--shapes", default="896x9728,896x896,1536x8960", help="INxOUT, comma-separated")
    parser.add_argument("--rows", default="1,2,3,4,5,6,7,8,12,16")
    parser.add_argument("--calls", type=int, default=15, help="timed calls per build, shape and row count")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    builds = {"before": load_build(args.before), "after": load_build(args.after)}
    for build in builds.values():
        build.set_isa(args.isa)
    generator = torch.Generator().manual_seed(0)
    print(f"{args.format} linear, {args.isa} path, {args.threads} threads, medians of {args.calls} calls per build")
    for shape in args.shapes.split(","):
        in_features, out_features = (int(v) for v in shape.split("x"))
        calls = weight_calls(args.format, in_features, out_features, generator)
        print(f"\n{shape}\n| rows | before ms | after ms | after / before |\n|---|---|---|---|")
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_features, generator=generator)  # [rows, in]
            seconds: dict[str, list[float]] = {name: [] for name in builds}
            outputs: dict[str, torch.Tensor] = {}
            for call in range(args.calls):
                order = list(builds.items()) if call % 2 == 0 else list(reversed(builds.items()))
                for name, build in order:
                    start = time.perf_counter()
                    outputs[name] = calls[call % COPIES](build, x)  # [rows, out]
                    seconds[name].append(time.perf_counter() - start)
            if not torch.equal(outputs["before"], outputs["after"]):
                raise SystemExit(f"{shape}, {rows} rows: the builds give different bits")
            before, after = (statistics.median(seconds[name]) * 1e3 for name in ("before", "after"))
            print(f"| {rows} | {before:.3f} | {after:.3f} | {after / before:.2f} |")


if __name__ == "__main__":
    main()
