"""Resident memory per weight format, each in a process of its own, beside llama.cpp on the same GGUF.

    python -m specdec.bench.memory_bench --model qwen2.5-coder-1.5b-instruct --formats auto,q8 [--llama-cpp]

Each child loads the model, generates 32 greedy tokens of a short chat prompt (KV cache of 2048 positions, one
sequence) and reports how long the load took, its peak resident set (the load included) and its resident set after
generating, and the bytes of its weights per format. ``--llama-cpp`` does the same with llama-cpp-python (n_ctx 2048).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Write a Python function that checks whether a string is a palindrome."


def _resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _child_specdec(model: str, weight_format: str) -> dict:
    from specdec.config import SamplingParams
    from specdec.llm import LLM

    start = time.perf_counter()
    llm = LLM(model=model, weight_format=weight_format, max_num_seqs=1, max_model_len=2048)
    load_s = time.perf_counter() - start
    llm.generate([PROMPT], SamplingParams(max_tokens=32), chat=True)
    return {"linear_bytes": llm.model.linear_bytes(), "load_s": load_s}


def _child_llama_cpp(model: str) -> dict:
    from llama_cpp import Llama

    from specdec.models.catalog import resolve_model

    start = time.perf_counter()
    llama = Llama(model_path=str(resolve_model(model)), n_ctx=2048, verbose=False)
    load_s = time.perf_counter() - start
    llama.create_chat_completion([{"role": "user", "content": PROMPT}], max_tokens=32, temperature=0.0)
    return {"load_s": load_s}


def run_child(kind: str, model: str, weight_format: str) -> dict:
    result = _child_llama_cpp(model) if kind == "llama.cpp" else _child_specdec(model, weight_format)
    result["resident_after"] = _resident_bytes()
    result["peak_resident"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--formats", default="auto,q8")
    parser.add_argument("--llama-cpp", action="store_true")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "FORMAT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args.child[0], args.model, args.child[1])))
        return 0
    runs = [("specdec", name) for name in args.formats.split(",")] + (
        [("llama.cpp", "Q4_K_M")] if args.llama_cpp else []
    )
    print(f"{args.model}: load time, peak and resident memory after 32 tokens, each run a process of its own")
    print("| engine | format | load (s) | peak resident (GB) | resident after (GB) | weights (MB) |")
    print("|---|---|---|---|---|---|")
    for kind, weight_format in runs:
        out = subprocess.run([sys.executable, "-m", "specdec.bench.memory_bench", "--model", args.model, "--child",
                              kind, weight_format], capture_output=True, text=True, check=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        weights = " + ".join(
            f"{name} {nbytes / 1e6:.0f}" for name, nbytes in sorted(result.get("linear_bytes", {}).items())
        )
        print(
            f"| {kind} | {weight_format} | {result['load_s']:.1f} | {result['peak_resident'] / 1e9:.2f} "
            f"| {result['resident_after'] / 1e9:.2f} "
            f"| {weights or '–'} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
