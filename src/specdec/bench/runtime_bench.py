"""Runtime benchmark (plain decoding): prefill and decode speed, T(n)/T(1), bandwidth, peak RSS, HF peer.

    python -m specdec.bench.runtime_bench --models gemma-3-270m,smollm2-135m-instruct [--hf] [--threads 2]

For each model: prefill tok/s, greedy decode tok/s (engine, batch 1), the cost T(n) of one forward of n new
tokens for n = 1..16 at a fixed context and its ratio to T(1), weight bytes streamed per token over T(1) as
GB/s against this machine's measured read bandwidth, peak RSS; with --hf, HF transformers' plain greedy
decode of the same GGUF in the same run (fp32, as transformers dequantizes GGUF).
"""
from __future__ import annotations

import argparse
import json
import resource
import time

import torch

from specdec.config import SamplingParams
from specdec.engine.draft_length.measure import forward_seconds, read_bandwidth_gbs
from specdec.llm import LLM
from specdec.runtime import configure_threads

PROMPT = "Write a detailed explanation of how a hash map works, including collisions and resizing."


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def forward_cost_curve(llm: LLM, context: int, max_rows: int, repeats: int) -> dict[int, float]:
    """Seconds of one forward of n new tokens after `context` cached tokens, n = 1..max_rows (each n
    paired with a one-row forward in `repeats` rounds, see `draft_length.measure.forward_seconds`)."""
    engine = llm.engine
    slot = engine.cache.allocate()
    try:
        seconds = forward_seconds(llm.model, engine.cache, slot, context, max_rows, repeats)
        return {rows: value for rows, value in enumerate(seconds, start=1)}
    finally:
        engine.cache.free(slot)


def decode_speed(llm: LLM, max_tokens: int) -> dict[str, float]:
    prompt_ids = llm.encode_prompt(PROMPT, chat=True)
    llm.generate([prompt_ids], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    llm.generate([prompt_ids], SamplingParams(max_tokens=1, ignore_eos=True))
    prefill_s = time.perf_counter() - start
    result = llm.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
    decode_s = result.elapsed_s - prefill_s
    return {"prompt_tokens": len(prompt_ids), "prefill_tok_s": len(prompt_ids) / prefill_s,
            "decode_tok_s": (len(result.token_ids) - 1) / decode_s}


def hf_decode_speed(model_path: str, max_tokens: int) -> dict[str, float]:
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_path)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        elapsed = time.perf_counter() - start
    return {"hf_decode_tok_s": (out.shape[1] - ids.shape[1]) / elapsed}


def bench_model(name: str, args: argparse.Namespace, bandwidth: float) -> dict:
    from specdec.models.catalog import resolve_model

    started = time.perf_counter()
    llm = LLM(model=name, weight_format=args.weight_format, max_model_len=2048, max_num_seqs=1)
    load_s = time.perf_counter() - started
    curve = forward_cost_curve(llm, context=args.context, max_rows=16, repeats=args.repeats)
    row = {"model": name, "weight_format": args.weight_format, "load_s": load_s,
           "weight_mb": llm.model.weight_nbytes / 1e6, **decode_speed(llm, args.max_tokens),
           "t1_ms": curve[1] * 1e3, "ratios": {n: curve[n] / curve[1] for n in curve}}
    row["achieved_gb_s"] = llm.model.weight_nbytes / curve[1] / 1e9
    row["bandwidth_fraction"] = row["achieved_gb_s"] / bandwidth
    row["peak_rss_mb"] = peak_rss_mb()
    del llm
    if args.hf:
        row.update(hf_decode_speed(str(resolve_model(name)), args.hf_max_tokens))
        row["peak_rss_mb_with_hf"] = peak_rss_mb()
    return row


def print_row(row: dict) -> None:
    ratios = " ".join(f"{n}:{r:.2f}" for n, r in row["ratios"].items())
    hf = f", HF transformers {row['hf_decode_tok_s']:.1f} tok/s" if "hf_decode_tok_s" in row else ""
    print(
        f"\n## {row['model']} ({row['weight_format']}, {row['weight_mb']:.0f} MB weights, "
        f"loaded in {row['load_s']:.1f} s)"
    )
    print(
        f"prefill {row['prefill_tok_s']:.0f} tok/s ({row['prompt_tokens']} tokens), "
        f"decode {row['decode_tok_s']:.1f} tok/s{hf}"
    )
    print(
        f"T(1) = {row['t1_ms']:.2f} ms -> {row['achieved_gb_s']:.1f} GB/s "
        f"({100 * row['bandwidth_fraction']:.0f} % of read bandwidth)"
    )
    print(f"T(n)/T(1): {ratios}")
    print(f"peak RSS {row['peak_rss_mb']:.0f} MB")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--models", default="gemma-3-270m,smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct,qwen2.5-coder-1.5b-instruct"
    )
    parser.add_argument("--weight-format", default="q8")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--hf", action="store_true", help="also measure HF transformers' plain decode")
    parser.add_argument("--hf-max-tokens", type=int, default=32)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    threads = configure_threads(args.threads)
    bandwidth = read_bandwidth_gbs()
    print(f"torch {torch.__version__}, {threads} threads, measured read bandwidth {bandwidth:.1f} GB/s")
    rows = []
    for name in args.models.split(","):
        rows.append(bench_model(name, args, bandwidth))
        print_row(rows[-1])
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"bandwidth_gb_s": bandwidth, "threads": threads, "models": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
