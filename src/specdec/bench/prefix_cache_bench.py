"""Second turns of a chat with and without the prefix cache, one process, interleaved.

    python -m specdec.bench.prefix_cache_bench --model gemma-3-270m --questions 8 [--categories writing,roleplay]

For each two-turn Spec-Bench question: turn 1 is generated once (greedy); turn 2's prompt is the conversation so
far (question, answer, follow-up) in the chat template. It is served by an LLM with a prefix cache that has just
answered turn 1 and by one without, alternately; printed: time to the first token and whole-request time
(medians), the prompt tokens copied from the cache, and whether both gave the same tokens.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from specdec.config import SamplingParams


@dataclass(frozen=True)
class TurnTiming:
    first_token_s: float
    total_s: float
    cached_prompt_tokens: int
    token_ids: tuple[int, ...]


def timed_generate(llm, prompt_token_ids: list[int], params: SamplingParams) -> TurnTiming:
    first_token_at: list[float] = []

    def on_output(step_output) -> None:
        if step_output.new_token_ids and not first_token_at:
            first_token_at.append(time.perf_counter())
        if step_output.cached_prompt_tokens is not None:
            cached.append(step_output.cached_prompt_tokens)

    cached: list[int] = []
    started = time.perf_counter()
    (output,) = llm.generate([prompt_token_ids], params, on_output=on_output)
    total = time.perf_counter() - started
    return TurnTiming(first_token_at[0] - started, total, cached[0] if cached else 0, output.token_ids)


def main(argv: list[str] | None = None) -> int:
    from specdec.llm import LLM
    from specdec.runtime import configure_threads, load_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dataset", default="../shared/data/spec_bench_dev.jsonl")
    parser.add_argument("--categories", default="", help="comma list (default: all)")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prefix-cache-tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    configure_threads(args.threads)
    wanted = {c for c in args.categories.split(",") if c}
    records = [json.loads(line) for line in Path(args.dataset).read_text().splitlines() if line.strip()]
    questions = [r for r in records if len(r.get("turns", [])) >= 2 and (not wanted or r.get("category") in wanted)]
    questions = questions[: args.questions]
    if not questions:
        parser.error("no two-turn questions match")
    loaded = load_model(args.model)
    tokenizer = loaded[1]
    cached_llm = LLM(loaded=loaded, max_num_seqs=1, prefix_cache_tokens=args.prefix_cache_tokens)
    plain_llm = LLM(loaded=loaded, max_num_seqs=1)
    params = SamplingParams(max_tokens=args.max_new_tokens)
    encode = lambda messages: cached_llm.encode_prompt(messages, chat=True)  # noqa: E731
    rows = []
    for question in questions:
        first_messages = [{"role": "user", "content": question["turns"][0]}]
        answer = timed_generate(cached_llm, encode(first_messages), params)  # leaves turn 1 in the cache
        messages = first_messages + [{"role": "assistant", "content": tokenizer.decode(list(answer.token_ids))},
                                     {"role": "user", "content": question["turns"][1]}]
        second_prompt = encode(messages)
        with_cache = timed_generate(cached_llm, second_prompt, params)
        without = timed_generate(plain_llm, second_prompt, params)
        rows.append((len(second_prompt), with_cache, without))
        print(f"question {question.get('question_id')} ({question.get('category')}): turn-2 prompt "
              f"{len(second_prompt)} tokens, {with_cache.cached_prompt_tokens} from the cache; first token "
              f"{without.first_token_s:.3f} -> {with_cache.first_token_s:.3f} s, request "
              f"{without.total_s:.3f} -> {with_cache.total_s:.3f} s, same tokens: "
              f"{with_cache.token_ids == without.token_ids}", flush=True)

    def median(values) -> float:
        return statistics.median(list(values))

    print(f"\n{args.model}, {len(rows)} second turns, median prompt {median(r[0] for r in rows):.0f} tokens, "
          f"median {median(r[1].cached_prompt_tokens for r in rows):.0f} from the cache:")
    print(f"  time to first token  without {median(r[2].first_token_s for r in rows):.3f} s  "
          f"with {median(r[1].first_token_s for r in rows):.3f} s  "
          f"({median(r[2].first_token_s / r[1].first_token_s for r in rows):.2f}x, median of ratios)")
    print(f"  whole request        without {median(r[2].total_s for r in rows):.3f} s  "
          f"with {median(r[1].total_s for r in rows):.3f} s  "
          f"({median(r[2].total_s / r[1].total_s for r in rows):.2f}x)")
    print(f"  identical outputs: {sum(r[1].token_ids == r[2].token_ids for r in rows)}/{len(rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
