"""Probe: auto on the avx2 path, q5 for the file's Q5_0 layers (what it loads) against q8 of the same values (what it
loaded before, and still loads on the other paths), on the avx2 path, in one process (docs/kernels.md, "The q5 weight
format").

    .venv/bin/python scripts/probes/q5_in_auto.py [--models gemma-3-270m,qwen2.5-coder-0.5b-instruct] [--rounds 6]

The q5 model loads with `weight_format="q5"`, the q8 model is auto loaded under the scalar path (where auto keeps q8)
with its q8 weights packed in the avx2 path's layout (`--q8-layout`, default amx; both layouts run on every path), so
that both exist on any avx2 CPU whichever of them auto picks there (q5 without AVX-VNNI, q8 with it). Each
round measures both models in turn (alternating which goes first) with isa_bench's `measure_path`: plain greedy decode
tok/s (128 tokens), prefill tok/s of a ~850-token prompt, T(1) and T(8) after 256 cached tokens; the table gives the
medians. The two give the same logits bit for bit (tests/models/test_q5_models.py).
"""
from __future__ import annotations

import argparse
import os
import statistics

from specdec.bench.isa_bench import measure_path
from specdec.bench.provenance import cpu_name
from specdec.kernels import ops
from specdec.llm import LLM
from specdec.models.layers import resolved_weight_format
from specdec.runtime import configure_threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gemma-3-270m,qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--q8-layout", choices=ops.Q8_LAYOUTS, default="amx",
                        help="the q8 model's weight layout (the avx2 path packs amx)")
    args = parser.parse_args()
    configure_threads(args.threads)
    if "avx2" not in ops.supported_isas():
        raise SystemExit("this CPU does not run the avx2 path")
    with ops.forced_isa("avx2"):
        variant = "avx2 with AVX-VNNI" if ops.avx_vnni_active() else "avx2"
        auto = resolved_weight_format("auto")
    print(f"{cpu_name()}, {args.threads} threads, {variant} path (auto loads Q5_0 layers as {auto}), q8 in the "
          f"{args.q8_layout} layout; medians of {args.rounds} rounds")
    print("| model | Q5_0 layers as | decode tok/s | prefill tok/s | T(1) ms | T(8) ms |")
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        llms = {}
        for label, isa, weight_format in (("q5", "avx2", "q5"), ("q8", "scalar", "auto")):
            with ops.forced_isa(isa):
                before = os.environ.get("SPECDEC_Q8_LAYOUT")
                os.environ["SPECDEC_Q8_LAYOUT"] = args.q8_layout
                try:
                    llms[label] = LLM(model=name, max_model_len=2048, max_num_seqs=1, weight_format=weight_format)
                finally:
                    if before is None:
                        del os.environ["SPECDEC_Q8_LAYOUT"]
                    else:
                        os.environ["SPECDEC_Q8_LAYOUT"] = before
        rounds: dict[str, list[dict[str, float]]] = {label: [] for label in llms}
        with ops.forced_isa("avx2"):
            for round_index in range(args.rounds):
                order = list(llms.items())
                for label, llm in order[round_index % 2 :] + order[: round_index % 2]:
                    rounds[label].append(measure_path(llm, 128))
        for label, rows in rounds.items():
            median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
            print(f"| {name} | {label} | {median['decode_tok_s']:.1f} | {median['prefill_tok_s']:.0f} | "
                  f"{median['t1_ms']:.2f} | {median['t8_ms']:.2f} |")


if __name__ == "__main__":
    main()
