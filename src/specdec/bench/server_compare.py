"""End-to-end comparison of OpenAI-compatible servers on the same chat prompts, requests interleaved.

    python -m specdec.bench.server_compare --dataset ../shared/data/spec_bench_dev.jsonl --per-category 2 \
        --server specdec-plain=http://127.0.0.1:8001 --server specdec-ngram=http://127.0.0.1:8002 \
        --server llama-plain=http://127.0.0.1:8003 --server llama-ngram-mod=http://127.0.0.1:8004 \
        --same specdec-plain,specdec-ngram --same llama-plain,llama-ngram-mod

Every prompt goes to every server in turn (one request at a time, greedy, `--max-tokens` new tokens, the first turn
of the question as the user message), so each server sees the machine in the same minutes. Per server: end-to-end
tok/s (completion tokens over the request's wall time, prefill included), summed over the prompts; per `--same`
pair (a plain and a speculative server of one engine), on how many prompts their texts are identical. Started
servers are the caller's: this script only sends requests to the given local URLs.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import httpx

from specdec.datasets import load_questions


@dataclass(frozen=True)
class Reply:
    text: str
    completion_tokens: int
    wall_s: float


def served_model(client: httpx.Client, url: str) -> str:
    """The id of the model a server serves (GET /v1/models)."""
    response = client.get(f"{url.rstrip('/')}/v1/models")
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def chat(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> Reply:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": False}
    start = time.perf_counter()
    response = client.post(f"{url.rstrip('/')}/v1/chat/completions", json=body)
    wall_s = time.perf_counter() - start
    response.raise_for_status()
    payload = response.json()
    return Reply(payload["choices"][0]["message"]["content"], int(payload["usage"]["completion_tokens"]), wall_s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--categories", default=None, help="comma-separated (default: all)")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--held-out-of", type=int, default=0, help="only questions `--holdout-every N` leaves out")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--server", action="append", required=True, help="LABEL=URL (repeatable)")
    parser.add_argument("--same", action="append", default=[], help="LABEL,LABEL whose texts are compared")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    servers = dict(item.split("=", 1) for item in args.server)
    questions = load_questions(args.dataset, args.categories.split(",") if args.categories else None,
                               limit=args.per_category, held_out_of=args.held_out_of)
    prompts = [(question.category, question.turns[0]) for question in questions]
    replies: dict[str, list[Reply]] = {label: [] for label in servers}
    with httpx.Client(timeout=args.timeout) as client:
        models = {label: served_model(client, url) for label, url in servers.items()}
        for label, url in servers.items():  # warm-up: one short request each
            chat(client, url, models[label], "Hello", 4)
        for _category, prompt in prompts:
            for label, url in servers.items():
                replies[label].append(chat(client, url, models[label], prompt, args.max_tokens))
    summary = {}
    print(f"{len(prompts)} prompts, {args.max_tokens} new tokens at most, greedy, requests interleaved")
    print("| server | completion tokens | wall s | end-to-end tok/s |\n|---|---|---|---|")
    for label, rows in replies.items():
        tokens, wall = sum(r.completion_tokens for r in rows), sum(r.wall_s for r in rows)
        summary[label] = {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}
        print(f"| {label} | {tokens} | {wall:.1f} | {tokens / wall:.1f} |")
    identical = {}
    for pair in args.same:
        a, b = pair.split(",")
        same = sum(x.text == y.text for x, y in zip(replies[a], replies[b]))
        identical[pair] = same
        print(f"{a} vs {b}: identical text on {same} of {len(prompts)} prompts")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"prompts": len(prompts), "servers": summary, "identical": identical,
                       "texts": {label: [r.text for r in rows] for label, rows in replies.items()}}, handle, indent=2)


if __name__ == "__main__":
    main()
