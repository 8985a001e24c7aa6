"""The kernel paths and weight formats side by side, in one process, with llama.cpp on the same GGUF in the same run.

    python -m specdec.bench.isa_bench --models gemma-3-270m --isas avx2,avx512 [--weight-formats auto,q8]
        [--llama-bench [LABEL=]PATH ... | --llama-cpp] [--threads 2]

For each model and each kernel path this CPU runs (`--isas`, default all but scalar): plain greedy decode tok/s
(128 tokens), prefill tok/s of a ~1000-token prompt, and the cost of one forward of 1 and of 8 new tokens after
256 cached tokens (T(1), T(8), their ratio). The paths alternate within each of `--rounds` rounds (each in turn
first) and the table gives medians, so a machine's slow minutes fall on every path alike. With `--llama-bench`
(repeatable, `LABEL=PATH`: e.g. `avx2=.peers/llama.cpp/build-avx2/bin/llama-bench` and `native=...` as
scripts/install-peers.sh builds them), each llama.cpp build's `llama-bench -t THREADS -p 0 -n 128` (decode),
`-p 1024 -n 0` (prefill), and its T(1) and T(8) (`-n 16 -d 256`, `-p 8 -d 256`: 1 and 8 new tokens after 256
cached) on the model's GGUF follow each round, and every path gets its ratio to each build.
`--llama-cpp` measures llama.cpp through llama-cpp-python in this process instead (the same decode prompt's
token ids, greedy, 128 tokens; the same prefill tokens). Each weight format (`--weight-formats`, default the
default, auto) is a model of its own, as each path loads it (auto is q5 on the avx2 path, `resolved_weight_format`:
one more model), packed in the layout of the first path that loads it (the "amx" layout only when that is "amx").
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from specdec.bench.provenance import cpu_name
from specdec.bench.runtime_bench import forward_cost_curve
from specdec.config import SamplingParams
from specdec.kernels import ops
from specdec.llm import LLM
from specdec.runtime import configure_threads
from specdec.models.layers import resolved_weight_format

DECODE_PROMPT = "Write a detailed explanation of how a hash map works, including collisions and resizing."
PREFILL_WORDS = 760  # about 1000 tokens of the repeated passage below
PASSAGE = ("The council met on Tuesday to discuss the new park, its playground, its pond and its garden, and the "
           "residents asked how the budget of the city would pay for the work that the plan describes. ")


def prefill_token_ids(llm: LLM) -> list[int]:
    """About 1000 tokens of the repeated passage."""
    words = (PASSAGE.split() * (PREFILL_WORDS // len(PASSAGE.split()) + 1))[:PREFILL_WORDS]
    return llm.tokenizer.encode(" ".join(words))


def measure_path(llm: LLM, max_tokens: int) -> dict[str, float]:
    """One round of one kernel path: decode, prefill and the forward costs."""
    decode_ids = llm.encode_prompt(DECODE_PROMPT, chat=True)
    llm.generate([decode_ids], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    result = llm.generate([decode_ids], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
    start = time.perf_counter()
    llm.generate([decode_ids], SamplingParams(max_tokens=1, ignore_eos=True))
    first_token_s = time.perf_counter() - start
    decode_tok_s = (len(result.token_ids) - 1) / (result.elapsed_s - first_token_s)
    prefill_ids = prefill_token_ids(llm)
    start = time.perf_counter()
    llm.generate([prefill_ids], SamplingParams(max_tokens=1, ignore_eos=True))
    prefill_tok_s = len(prefill_ids) / (time.perf_counter() - start)
    curve = forward_cost_curve(llm, context=256, max_rows=8, repeats=5)
    return {"decode_tok_s": decode_tok_s, "prefill_tok_s": prefill_tok_s, "prefill_tokens": len(prefill_ids),
            "t1_ms": curve[1] * 1e3, "t8_ms": curve[8] * 1e3}


# figure -> llama-bench flags; the depth runs price a forward of 1 and of 8 new tokens after 256 cached tokens, as
# forward_cost_curve does for specdec
LLAMA_BENCH_RUNS = {
    "decode_tok_s": ["-p", "0", "-n", "128"],
    "prefill_tok_s": ["-p", "1024", "-n", "0"],
    "depth_decode_tok_s": ["-p", "0", "-n", "16", "-d", "256"],
    "depth_8_tok_s": ["-p", "8", "-n", "0", "-d", "256"],
}


def llama_bench(binary: str, gguf: Path, threads: int) -> dict[str, float]:
    """llama-bench's mean tok/s for decode (tg128) and prefill (pp1024) of the GGUF, and its T(1) and T(8) in ms:
    one decoded token (tg16) and a batch of 8 (pp8), each after 256 cached tokens (-d 256)."""
    result = {}
    for key, flags in LLAMA_BENCH_RUNS.items():
        out = subprocess.run([binary, "-m", str(gguf), "-t", str(threads), "-r", "3", "-o", "json", *flags],
                             capture_output=True, text=True, check=True).stdout
        result[key] = float(json.loads(out)[0]["avg_ts"])
    result["t1_ms"] = 1e3 / result.pop("depth_decode_tok_s")
    result["t8_ms"] = 8e3 / result.pop("depth_8_tok_s")
    return result


def llama_cpp_python(gguf: Path, decode_ids: list[int], prefill_ids: list[int], max_tokens: int, threads: int,
                     cache: dict) -> dict[str, float]:
    """llama.cpp through llama-cpp-python: greedy decode tok/s after the decode prompt, prefill tok/s."""
    import numpy as np
    from llama_cpp import Llama

    if "model" not in cache:
        cache["model"] = Llama(model_path=str(gguf), n_ctx=2048, n_batch=512, n_threads=threads,
                               n_threads_batch=threads, verbose=False)
    llama = cache["model"]
    llama.reset()
    llama.eval(decode_ids)
    token = int(np.argmax(llama.scores[llama.n_tokens - 1]))
    start = time.perf_counter()
    for _ in range(max_tokens - 1):
        llama.eval([token])
        token = int(np.argmax(llama.scores[llama.n_tokens - 1]))
    decode_tok_s = (max_tokens - 1) / (time.perf_counter() - start)
    llama.reset()
    start = time.perf_counter()
    llama.eval(prefill_ids)
    return {"decode_tok_s": decode_tok_s, "prefill_tok_s": len(prefill_ids) / (time.perf_counter() - start)}


def bench_model(name: str, isas: list[str], args: argparse.Namespace, threads: int) -> dict:
    from specdec.models.catalog import resolve_model

    formats = args.weight_formats.split(",")
    # One model per format as each path loads it (auto is q5 on the avx2 path: resolved_weight_format), packed for
    # the layout of the first path that loads it.
    llms, llm_of = {}, {}
    for weight_format in formats:
        for isa in isas:
            with ops.forced_isa(isa):
                loaded_as = resolved_weight_format(weight_format)
                if loaded_as not in llms:
                    llms[loaded_as] = LLM(model=name, max_model_len=2048, max_num_seqs=1, weight_format=weight_format)
            llm_of[isa, weight_format] = llms[loaded_as]
    variants = [(isa, weight_format) for weight_format in formats for isa in isas]
    rounds: dict[str, list[dict[str, float]]] = {_label(*variant, formats): [] for variant in variants}
    peers: dict[str, list[dict[str, float]]] = {label: [] for label in args.llama_bench}
    if args.llama_cpp:
        peers["llama-cpp-python"] = []
    llama_cache: dict = {}
    any_llm = next(iter(llms.values()))
    decode_ids = any_llm.encode_prompt(DECODE_PROMPT, chat=True)
    prefill_ids = prefill_token_ids(any_llm)
    for round_index in range(args.rounds):
        shift = round_index % len(variants)  # each variant in turn first in a round
        for isa, weight_format in variants[shift:] + variants[:shift]:
            with ops.forced_isa(isa):
                rounds[_label(isa, weight_format, formats)].append(measure_path(llm_of[isa, weight_format],
                                                                               args.max_tokens))
        for label, binary in args.llama_bench.items():
            peers[label].append(llama_bench(binary, resolve_model(name), threads))
        if args.llama_cpp:
            peers["llama-cpp-python"].append(llama_cpp_python(resolve_model(name), decode_ids, prefill_ids,
                                                              args.max_tokens, threads, llama_cache))
    row = {"model": name, "paths": _medians(rounds), "llama_cpp": _medians(peers)}
    return row


def _medians(rounds: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per label, the median of each measured figure over the rounds."""
    return {label: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for label, rows in rounds.items()}


def parse_llama_bench(values: list[str]) -> dict[str, str]:
    """`[LABEL=]PATH` arguments as {label: path}; an unlabelled one is "llama.cpp"."""
    binaries = {}
    for value in values:
        label, _, path = value.rpartition("=")
        label = label or "llama.cpp"
        if label in binaries:
            raise SystemExit(f"--llama-bench: the label {label!r} is given twice")
        if not Path(path).is_file():
            raise SystemExit(f"--llama-bench: no llama-bench binary at {path} (scripts/install-peers.sh builds one)")
        binaries[label] = path
    return binaries


def _label(isa: str, weight_format: str, formats: list[str]) -> str:
    return isa if len(formats) == 1 else f"{isa} {weight_format}"


def print_row(row: dict) -> None:
    peers = row["llama_cpp"]
    print(f"\n## {row['model']}")
    print("| path | decode tok/s | prefill tok/s | T(1) ms | T(8) ms | T(8)/T(1) |"
          + "".join(f" decode / {label} | prefill / {label} |" for label in peers))
    print("|---|---|---|---|---|---|" + "---|---|" * len(peers))
    for isa, m in row["paths"].items():
        line = (f"| {isa} | {m['decode_tok_s']:.1f} | {m['prefill_tok_s']:.0f} | {m['t1_ms']:.2f} | {m['t8_ms']:.2f} | "
                f"{m['t8_ms'] / m['t1_ms']:.2f} |")
        for peer in peers.values():
            line += (
                f" {m['decode_tok_s'] / peer['decode_tok_s']:.2f} | {m['prefill_tok_s'] / peer['prefill_tok_s']:.2f} |"
            )
        print(line)
    for label, peer in peers.items():
        costs = " | | |"
        if "t1_ms" in peer:
            costs = f" {peer['t1_ms']:.2f} | {peer['t8_ms']:.2f} | {peer['t8_ms'] / peer['t1_ms']:.2f} |"
        print(f"| {label} | {peer['decode_tok_s']:.1f} | {peer['prefill_tok_s']:.0f} |{costs}" + " | |" * len(peers))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gemma-3-270m")
    parser.add_argument("--isas", default=None, help="kernel paths, comma-separated (default: all but scalar)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--weight-formats", default="auto",
                        help="weight formats, comma-separated (auto, q4, q4-all, q5, q8)")
    parser.add_argument("--llama-bench", action="append", default=[],
                        help="[LABEL=]PATH of a llama.cpp llama-bench binary (repeatable)")
    parser.add_argument("--llama-cpp", action="store_true", help="llama.cpp through llama-cpp-python instead")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    args.llama_bench = parse_llama_bench(args.llama_bench)
    threads = configure_threads(args.threads)
    isas = args.isas.split(",") if args.isas else [isa for isa in ops.supported_isas() if isa != "scalar"] or ["scalar"]
    print(f"{cpu_name()}, torch {torch.__version__}, {threads} threads, kernel paths {', '.join(isas)}")
    rows = [bench_model(name, isas, args, threads) for name in args.models.split(",")]
    for row in rows:
        print_row(row)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"cpu": cpu_name(), "threads": threads, "models": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
