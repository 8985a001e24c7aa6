#!/usr/bin/env python
"""Compare this checkout's adaptive draft policy with another version of `specdec/engine/draft_length/adaptive.py`
(`specdec/engine/adaptive.py` before the draft_length package), in one process.

Plain decoding, the current policy and the other one run on the same prompts, interleaved per prompt (the order
alternating), so the machine's drift between processes does not enter the comparison. Prints per category the
speed-up of each policy over plain decoding (median per request, and total tokens / total time) and whether every
output equals plain decoding's.

    git show REV:src/specdec/engine/draft_length/adaptive.py > /tmp/adaptive_other.py
    .venv/bin/python scripts/compare_policies.py --other /tmp/adaptive_other.py --model gemma-3-270m \\
        --spec '{"method": "ngram", "num_speculative_tokens": 16}' --dataset ../shared/data/spec_bench_dev.jsonl \\
        --categories qa --limit 40
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time


def load_other(path: str):
    spec = importlib.util.spec_from_file_location("adaptive_other", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["adaptive_other"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def main() -> int:
    from specdec.datasets import load_questions
    from specdec.models.tokenizer import encode_chat
    from specdec.config import SamplingParams
    from specdec.llm import LLM

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--other", required=True, help="another version of specdec/engine/draft_length/adaptive.py")
    parser.add_argument("--model", required=True)
    parser.add_argument("--spec", required=True, help="speculative config (JSON)")
    parser.add_argument("--dataset", action="append", required=True, help="Spec-Bench / HumanEval JSONL (repeatable)")
    parser.add_argument("--categories", default=None, help="comma list (default: all)")
    parser.add_argument("--limit", type=int, default=None, help="questions per category")
    parser.add_argument("--held-out-of", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()

    other = load_other(args.other)
    current = LLM(args.model, speculative_config=json.loads(args.spec))
    policy = current.engine.draft_policy
    other_policy = other.AdaptiveDraftPolicy(current.spec_config.num_speculative_tokens, policy.base_cost_model,
                                             policy.max_rows)
    runs = {"plain": LLM(args.model), "current": current,
            "other": LLM(args.model, speculative_config=json.loads(args.spec), draft_policy=other_policy)}
    categories = args.categories.split(",") if args.categories else None
    questions = [q for path in args.dataset for q in load_questions(path, categories, args.limit, args.held_out_of)]
    params = SamplingParams(max_tokens=args.max_new_tokens)
    for name, llm in runs.items():  # warm-up
        llm.generate([encode_chat(llm.tokenizer, [{"role": "user", "content": "Hello"}])], params,
                     speculative=name != "plain")
    results: dict[str, dict[str, list[tuple[int, float, tuple[int, ...]]]]] = {}
    for index, question in enumerate(questions):
        prompt = encode_chat(current.tokenizer, [{"role": "user", "content": question.turns[0]}])
        for name in (list(runs) if index % 2 == 0 else list(reversed(runs))):
            start = time.perf_counter()
            output = runs[name].generate([prompt], params, speculative=name != "plain")[0]
            seconds = time.perf_counter() - start
            results.setdefault(question.category, {}).setdefault(name, []).append((len(output.token_ids), seconds,
                                                                                  output.token_ids))
    for category, by_run in results.items():
        median = {name: statistics.median(n / s for n, s, _ in rows) for name, rows in by_run.items()}
        total = {name: sum(n for n, _, _ in rows) / sum(s for _, s, _ in rows) for name, rows in by_run.items()}
        identical = all(rows[i][2] == by_run["plain"][i][2] for rows in by_run.values() for i in range(len(rows)))
        print(f"{category:15s} n={len(by_run['plain'])}  current {median['current'] / median['plain']:.2f}x "
              f"(total {total['current'] / total['plain']:.2f}x)  other {median['other'] / median['plain']:.2f}x "
              f"(total {total['other'] / total['plain']:.2f}x)  identical to plain: {identical}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
