"""The KV cache's dtype, fp32 against fp16, beside the same q8 weights, measured in one process.

    python -m specdec.bench.kv_cache_bench --model gemma-3-270m --contexts 256,750,1500 [--accuracy-prompts 8]

Speed: T(1) and T(8) (one forward of 1 or 8 new tokens of one sequence after C cached tokens), the two caches
interleaved round by round, medians. Accuracy (with --accuracy-prompts N > 0): both q8 variants against the fp32
reference (fp32 weights and cache), teacher-forced on the reference's own greedy continuation of N Spec-Bench
prompts: max and mean |logit difference| and argmax agreement.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specdec.cache.kv_cache import KVCache
from specdec.models.batch import ForwardBatch
from specdec.models.transformer import Transformer

CACHE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def _forward(model: Transformer, cache: KVCache, token_ids: list[int], start: int, all_logits: bool) -> torch.Tensor:
    return model.forward(
        ForwardBatch.build([token_ids], [start], [0], all_logits=all_logits, device=model.device), cache
    )


def forward_times(model: Transformer, context: int, rounds: int, seed: int = 0) -> dict[tuple[str, int], float]:
    """Median seconds of T(1) and T(8) after `context` cached random tokens, per cache dtype."""
    generator = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(0, model.config.vocab_size, (context + 8,), generator=generator).tolist()
    caches = {}
    for name, dtype in CACHE_DTYPES.items():
        caches[name] = KVCache(model.config, 1, context + 8, model.device, dtype=dtype)
        _forward(model, caches[name], token_ids[:context], 0, all_logits=False)
    samples: dict[tuple[str, int], list[float]] = {(name, rows): [] for name in CACHE_DTYPES for rows in (1, 8)}
    for round_index in range(rounds + 2):  # two warm-up rounds
        for name, cache in caches.items():
            for rows in (1, 8):
                started = time.perf_counter()
                _forward(model, cache, token_ids[context:context + rows], context, all_logits=True)
                if round_index >= 2:
                    samples[(name, rows)].append(time.perf_counter() - started)
    return {key: statistics.median(values) for key, values in samples.items()}


def accuracy(
    reference: Transformer, quantized: Transformer, prompts: list[list[int]], new_tokens: int
) -> dict[str, dict]:
    """Per cache dtype of the q8 model: |logit difference| to the reference and argmax agreement."""
    rows: dict[str, list[tuple[float, float, float]]] = {name: [] for name in CACHE_DTYPES}
    for prompt in prompts:
        cache = KVCache(reference.config, 1, len(prompt) + new_tokens + 1)
        logits = _forward(reference, cache, prompt, 0, all_logits=False)
        sequence = list(prompt)
        for _ in range(new_tokens):
            sequence.append(int(logits[-1].argmax()))
            logits = _forward(reference, cache, sequence[-1:], len(sequence) - 1, all_logits=False)
        first = len(prompt) - 1
        reference_logits = _forward(reference, KVCache(reference.config, 1, len(sequence)), sequence, 0, True)[first:]
        for name, dtype in CACHE_DTYPES.items():
            cache = KVCache(quantized.config, 1, len(sequence), dtype=dtype)
            ours = _forward(quantized, cache, sequence, 0, all_logits=True)[first:]  # [new_tokens + 1, vocab]
            difference = (ours - reference_logits).abs()
            agreement = (ours.argmax(-1) == reference_logits.argmax(-1)).float().mean()
            rows[name].append((float(difference.max()), float(difference.mean()), float(agreement)))
    return {name: {"max_abs_diff": max(r[0] for r in values), "mean_abs_diff": statistics.mean(r[1] for r in values),
                   "argmax_agreement": statistics.mean(r[2] for r in values)} for name, values in rows.items()}


def main(argv: list[str] | None = None) -> int:
    from specdec.runtime import configure_threads, load_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--contexts", default="256,750,1500", help="comma list of cached tokens before T(n)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--accuracy-prompts", type=int, default=0, help="Spec-Bench prompts for the accuracy part")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument(
        "--prompts", default="../shared/data/spec_bench_dev.jsonl", help="Spec-Bench-format JSONL (first turns)"
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    configure_threads(args.threads)
    model, tokenizer = load_model(args.model, "q8")
    print(f"{args.model}, q8 weights, {args.threads} threads; ms, medians of {args.rounds} interleaved rounds")
    for context in (int(c) for c in args.contexts.split(",")):
        times = forward_times(model, context, args.rounds)
        cells = "  ".join(
            f"T({rows}) {name} {times[(name, rows)] * 1e3:7.2f}" for rows in (1, 8) for name in CACHE_DTYPES
        )
        change = "  ".join(f"T({rows}) {times[('fp16', rows)] / times[('fp32', rows)] - 1:+.1%}" for rows in (1, 8))
        print(f"context {context:5d}: {cells}   fp16 vs fp32: {change}", flush=True)
    if args.accuracy_prompts > 0:
        records = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
        chosen = records[:: max(1, len(records) // args.accuracy_prompts)][: args.accuracy_prompts]
        prompts = [tokenizer.encode_chat([{"role": "user", "content": r["turns"][0]}])
                   for r in chosen]
        reference, _ = load_model(args.model, "fp32")
        for name, row in accuracy(reference, model, prompts, args.new_tokens).items():
            print(f"q8 + {name} cache vs fp32 reference over {len(prompts)} prompts x {args.new_tokens + 1} positions: "
                  f"max |dlogit| {row['max_abs_diff']:.3f}, mean |dlogit| {row['mean_abs_diff']:.4f}, "
                  f"argmax agreement {row['argmax_agreement']:.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
