"""Load test for `specdec serve` (or any OpenAI-compatible server): closed-loop clients at each concurrency.

    python -m specdec.bench.load_test --url http://127.0.0.1:8000 --concurrency 1,2,4,8,16 \\
        --prompts /work/shared/data/spec_bench_dev.jsonl --category summarization --max-tokens 128 [--duration S]

Each of C clients streams chat completions back to back (prompts taken round-robin from the category, continuing
across levels, so a level does not resend the prompts of the level before and find them in the server's prefix
cache; the share of prompt tokens the server reports as cached is printed per level). Without
--duration every level sends max(C, --requests) requests; with --duration it keeps sending for S seconds (soak).
Per level: output tok/s (completion tokens / wall time), p50/p95 time to first token and request latency,
errors (HTTP or in-band) and malformed responses (bad SSE, missing [DONE], usage that disagrees with the stream),
server RSS and spec-decode counters from /metrics before and after. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import AsyncIterator

import httpx

SPEC_COUNTERS = ("specdec:spec_decode_num_drafts_total", "specdec:spec_decode_num_draft_tokens_total",
                 "specdec:spec_decode_num_accepted_tokens_total")


@dataclass
class RequestResult:
    ok: bool
    malformed: bool = False
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens (a prefix cache's hit)


@dataclass
class LevelReport:
    concurrency: int
    requests: int
    errors: int
    malformed: int
    wall_s: float
    completion_tokens: int
    prompt_tokens: int
    cached_prompt_tokens: int
    output_tok_s: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    latency_p50_s: float | None
    latency_p95_s: float | None
    server_rss_mb: float | None
    server_rss_growth_mb: float | None  # mean RSS of the level's last quarter minus its second quarter (soak)
    acceptance_rate: float | None  # accepted / drafted during this level, from /metrics
    mean_accepted_length: float | None
    error_samples: list[str] = field(default_factory=list)
    server_rss_samples_mb: list[float] = field(default_factory=list)  # sampled every --rss-interval seconds


def load_prompts(path: str, category: str | None) -> list[str]:
    """The first user turn of every question of a Spec-Bench or HumanEval JSONL file (specdec.datasets), optionally
    of one category only (HumanEval's is "humaneval")."""
    from specdec.datasets import load_questions

    prompts = [question.turns[0] for question in load_questions(path, None if category is None else [category])]
    if not prompts:
        raise ValueError(f"no prompts with category {category!r} in {path}")
    return prompts


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class MalformedStream(Exception):
    """A server-sent event stream that breaks the format: a line that is not `data: ...`, a payload that is not a
    JSON object, or anything after `data: [DONE]`."""


async def sse_payloads(response: httpx.Response) -> AsyncIterator[dict | None]:
    """The JSON objects of a stream's `data:` lines in order, then None for `data: [DONE]`; MalformedStream for a
    line that breaks the format. Ends without None when the stream ends without [DONE]."""
    done = False
    async for line in response.aiter_lines():
        if not line:
            continue
        if done:
            raise MalformedStream(f"a line after [DONE]: {line[:80]!r}")
        if not line.startswith("data: "):
            raise MalformedStream(f"not an SSE data line: {line[:80]!r}")
        payload = line[len("data: "):]
        if payload == "[DONE]":
            done = True
            yield None
            continue
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError as error:
            raise MalformedStream(f"not JSON ({error}): {payload[:80]!r}") from None
        if not isinstance(chunk, dict):
            raise MalformedStream(f"not a JSON object: {payload[:80]!r}")
        yield chunk


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                      headers: dict[str, str]) -> RequestResult:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, usage, done, pieces = None, None, False, 0
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return RequestResult(ok=False, error=f"HTTP {response.status_code}: {text[:200]}")
            async for chunk in sse_payloads(response):
                if chunk is None:
                    done = True
                    continue
                if "error" in chunk:
                    return RequestResult(ok=False, error=f"in-band error: {chunk['error'].get('message')}")
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    if choice.get("delta", {}).get("content"):
                        pieces += 1
                        ttft = ttft if ttft is not None else time.perf_counter() - start
    except (httpx.HTTPError, MalformedStream, KeyError, AttributeError) as error:
        return RequestResult(ok=False, malformed=isinstance(error, (MalformedStream, KeyError, AttributeError)),
                             error=f"{type(error).__name__}: {error}")
    latency = time.perf_counter() - start
    if not done or usage is None or usage.get("completion_tokens", 0) < pieces:
        return RequestResult(ok=False, malformed=True, error=f"stream incomplete (done={done}, usage={usage})")
    details = usage.get("prompt_tokens_details") or {}
    return RequestResult(
        ok=True,
        ttft_s=ttft if ttft is not None else latency,
        latency_s=latency,
        completion_tokens=int(usage["completion_tokens"]),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_prompt_tokens=int(details.get("cached_tokens") or 0),
    )


async def run_level(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int, num_requests: int,
                    duration_s: float | None, headers: dict[str, str], timeout_s: float,
                    first_prompt: int = 0) -> tuple[list[RequestResult], float]:
    """first_prompt: the round-robin index of the level's first request (levels continue where the last stopped)."""
    counter = iter(range(10**12))
    results: list[RequestResult] = []
    start = time.perf_counter()

    def more() -> int | None:
        i = next(counter)
        if duration_s is not None:
            return i if time.perf_counter() - start < duration_s else None
        return i if i < num_requests else None

    async def client_loop(client: httpx.AsyncClient) -> None:
        while (i := more()) is not None:
            results.append(await one_request(client, url, model, prompts[(first_prompt + i) % len(prompts)],
                                             max_tokens, headers))

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return results, time.perf_counter() - start


async def sample_rss(url: str, interval_s: float, samples_mb: list[float], stop: asyncio.Event) -> None:
    """Appends the server's resident memory (MB, from /metrics) every interval until stopped."""
    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            try:
                text = (await client.get(url + "/metrics")).text
                value = parse_samples(text).get("process_resident_memory_bytes")
                if value:
                    samples_mb.append(value / 2**20)
            except httpx.HTTPError:
                pass
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except asyncio.TimeoutError:
                pass


async def run_level_sampled(
    url: str,
    model: str,
    prompts: list[str],
    concurrency: int,
    max_tokens: int,
    num_requests: int,
    duration_s: float | None,
    headers: dict[str, str],
    timeout_s: float,
    rss_interval_s: float,
    first_prompt: int = 0,
) -> tuple[list[RequestResult], float, list[float]]:
    samples_mb: list[float] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(url, rss_interval_s, samples_mb, stop))
    try:
        results, wall_s = await run_level(url, model, prompts, concurrency, max_tokens, num_requests, duration_s,
                                          headers, timeout_s, first_prompt)
    finally:
        stop.set()
        await sampler
    return results, wall_s, samples_mb


def rss_growth_mb(samples_mb: list[float]) -> float | None:
    """Mean of the last quarter minus mean of the second quarter (the first quarter is warm-up)."""
    if len(samples_mb) < 8:
        return None
    quarter = len(samples_mb) // 4
    second, last = samples_mb[quarter : 2 * quarter], samples_mb[-quarter:]
    return sum(last) / len(last) - sum(second) / len(second)


def scrape(url: str) -> dict[str, float]:
    """Unlabelled samples of /metrics ({} when the server has none)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    return parse_samples(text)


def parse_samples(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.rpartition(" ")
            try:
                samples[name] = float(value)
            except ValueError:
                pass
    return samples


def summarize(concurrency: int, results: list[RequestResult], wall_s: float, before: dict, after: dict,
              rss_samples_mb: list[float] | None = None) -> LevelReport:
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    drafted = after.get(SPEC_COUNTERS[1], 0) - before.get(SPEC_COUNTERS[1], 0)
    accepted = after.get(SPEC_COUNTERS[2], 0) - before.get(SPEC_COUNTERS[2], 0)
    steps = after.get(SPEC_COUNTERS[0], 0) - before.get(SPEC_COUNTERS[0], 0)
    rss = after.get("process_resident_memory_bytes")
    return LevelReport(
        concurrency=concurrency, requests=len(results), errors=len(results) - len(ok),
        malformed=sum(r.malformed for r in results), wall_s=wall_s, completion_tokens=tokens,
        prompt_tokens=sum(r.prompt_tokens for r in ok), cached_prompt_tokens=sum(r.cached_prompt_tokens for r in ok),
        output_tok_s=tokens / wall_s if wall_s > 0 else 0.0,
        ttft_p50_s=percentile([r.ttft_s for r in ok], 0.5), ttft_p95_s=percentile([r.ttft_s for r in ok], 0.95),
        latency_p50_s=percentile([r.latency_s for r in ok], 0.5),
        latency_p95_s=percentile([r.latency_s for r in ok], 0.95),
        server_rss_mb=rss / 2**20 if rss else None,
        server_rss_growth_mb=rss_growth_mb(rss_samples_mb or []),
        acceptance_rate=accepted / drafted if drafted else None,
        mean_accepted_length=1 + accepted / steps if steps else None,
        error_samples=sorted({r.error for r in results if r.error})[:5],
        server_rss_samples_mb=[round(v, 1) for v in rss_samples_mb or []],
    )


def format_table(reports: list[LevelReport]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    header = (f"{'conc':>4} {'reqs':>5} {'err':>4} {'bad':>4} {'tok/s':>8} {'ttft p50':>9} {'ttft p95':>9} "
              f"{'lat p50':>8} {'lat p95':>8} {'alpha':>6} {'tau':>5} {'cached':>6} {'rss MB':>7} {'rss +MB':>7}")
    rows = [header, "-" * len(header)]
    for r in reports:
        rows.append(f"{r.concurrency:>4} {r.requests:>5} {r.errors:>4} {r.malformed:>4} {r.output_tok_s:>8.1f} "
                    f"{ms(r.ttft_p50_s):>9} {ms(r.ttft_p95_s):>9} {ms(r.latency_p50_s):>8} {ms(r.latency_p95_s):>8} "
                    f"{num(r.acceptance_rate, '.2f'):>6} {num(r.mean_accepted_length, '.2f'):>5} "
                    f"{num(r.cached_prompt_tokens / r.prompt_tokens if r.prompt_tokens else None, '.0%'):>6} "
                    f"{num(r.server_rss_mb, '.0f'):>7} {num(r.server_rss_growth_mb, '+.1f'):>7}")
    return "\n".join(rows) + (
        "\n(times in ms; tok/s = completion tokens / wall time of the level; cached = share of the "
        "prompt tokens the server took from its prefix cache; rss +MB = mean RSS of the level's "
        "last quarter minus its second quarter, shown with >= 8 samples)"
    )


def served_model(url: str, headers: dict[str, str]) -> str:
    response = httpx.get(url + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated client counts")
    parser.add_argument("--prompts", default="/work/shared/data/spec_bench_dev.jsonl")
    parser.add_argument("--category", default="summarization", help="'all' for every category")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=16, help="requests per level (at least the concurrency)")
    parser.add_argument("--duration", type=float, default=None, help="seconds per level (soak) instead of --requests")
    parser.add_argument("--model", default=None, help="model id (default: the server's first /v1/models entry)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    parser.add_argument("--output", default="load_test.json", help="JSON report path")
    parser.add_argument("--rss-interval", type=float, default=5.0,
                        help="seconds between samples of the server's resident memory during each level")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    prompts = load_prompts(args.prompts, None if args.category == "all" else args.category)
    model = args.model or served_model(args.url, headers)
    reports, sent = [], 0
    for concurrency in [int(c) for c in args.concurrency.split(",") if c.strip()]:
        before = scrape(args.url)
        results, wall_s, rss_samples_mb = asyncio.run(run_level_sampled(
            args.url, model, prompts, concurrency, args.max_tokens, max(concurrency, args.requests), args.duration,
            headers, args.timeout, args.rss_interval, first_prompt=sent))
        sent += len(results)
        reports.append(summarize(concurrency, results, wall_s, before, scrape(args.url), rss_samples_mb))
        print(f"[concurrency {concurrency}: {len(results)} requests in {wall_s:.1f} s]", file=sys.stderr)
    print(format_table(reports))
    report = {"url": args.url, "model": model, "category": args.category, "max_tokens": args.max_tokens,
              "duration_s": args.duration, "levels": [asdict(r) for r in reports],
              "errors": sum(r.errors for r in reports), "malformed": sum(r.malformed for r in reports)}
    Path(args.output).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}", file=sys.stderr)
    return 1 if report["errors"] or report["malformed"] else 0


if __name__ == "__main__":
    sys.exit(main())
