"""Soak test of `specdec serve`: a mixed load at a fixed concurrency for minutes, every response checked.

    python -m specdec.bench.soak --model gemma-3-270m --minutes 10 --concurrency 16 \\
        [--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'] [--output FILE]

Starts `specdec serve MODEL --threads 2 --max-num-seqs 8` as a subprocess with an API key (with a speculative
config also `--draft-policy fixed`, so that every step drafts), or with --url drives a running server. Then C
clients send requests back to back until the time is up, each request drawn from MIX: streamed and non-streamed
chat and text completions (greedy or seeded sampling, some with a stop string), the same with `"speculative":
false` (the per-request opt-out), clients that leave at a random point (a non-streamed request abandoned after a
random delay, a stream closed after a random number of chunks), and bad requests (`bad_requests`: malformed JSON,
missing or wrong fields, a context overflow, a wrong Content-Type, a body over the limit, a missing API key, an
unknown path, a wrong method). Requests started before the end run to completion.

Every answer is checked against what its kind expects. Outcomes:
  ok         the expected answer: a well-formed completion or stream (ids, objects, one finish_reason, [DONE],
             usage that matches the token ids received), the expected 4xx with an OpenAI error body, or a client
             that left as planned (what it received until then well-formed)
  failed     a well-formed answer that is not the expected one: another status code, an in-band error event
  malformed  an answer that breaks the format (bad JSON or SSE, missing fields, counts that disagree)
  lost       no complete answer: a transport error, the client's timeout, a stream that ends without [DONE]
At the end the server must be idle within 30 s with every KV slot free, /health 200, and (subprocess) no traceback
in its log and a clean stop on SIGTERM. Meanwhile the server's resident memory is sampled (/proc, or /metrics with
--url) every --rss-interval
seconds. The report has the requests by kind and outcome, completion tokens and requests per minute (client side;
the server's generated tokens per minute too, which include abandoned requests), the median RSS of the first and
the last minute, and the KV slots at the end. Prints a summary, writes JSON (bench_results/soak-*.json, the server's
log beside it), exits 1 when anything was lost, malformed or failed, or the server was not idle and healthy.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import secrets
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from specdec.bench.load_test import MalformedStream, load_prompts, parse_samples, served_model, sse_payloads

DEFAULT_PROMPTS = "/work/shared/data/spec_bench_dev.jsonl"
SERVER_THREADS = 2
SETTLE_TIMEOUT_S = 30.0  # how long the server may take to be idle after the last client
OUTCOMES = ("ok", "failed", "malformed", "lost")
STOP_STRING = "\n\n"


@dataclass(frozen=True)
class Kind:
    """A kind of generation request. leave: None (read to the end), "waiting" (a non-streamed request abandoned
    after a random delay), "stream" (a stream closed after a random number of chunks)."""

    name: str
    chat: bool
    stream: bool
    speculative: bool = True
    leave: str | None = None


KINDS = {kind.name: kind for kind in (
    Kind("chat_stream", chat=True, stream=True),
    Kind("chat", chat=True, stream=False),
    Kind("completion_stream", chat=False, stream=True),
    Kind("completion", chat=False, stream=False),
    Kind("opt_out_stream", chat=True, stream=True, speculative=False),
    Kind("opt_out", chat=False, stream=False, speculative=False),
    Kind("leave_waiting", chat=True, stream=False, leave="waiting"),
    Kind("leave_stream", chat=True, stream=True, leave="stream"),
)}
BAD = "bad_request"
MIX = {"chat_stream": 20, "chat": 10, "completion_stream": 10, "completion": 5, "opt_out_stream": 10, "opt_out": 5,
       "leave_waiting": 8, "leave_stream": 12, BAD: 20}  # relative weights
LEAVE_WAITING_MAX_S = 3.0  # a leave_waiting client leaves after a uniform delay in [0, this]
LEAVE_STREAM_MAX_CHUNKS = 8  # a leave_stream client leaves after a uniform number of chunks in [0, this]


@dataclass(frozen=True)
class BadRequest:
    name: str
    method: str
    path: str
    content: bytes | None
    content_type: str | None
    status: int
    code: str | None  # the error body's code; None: not checked
    with_key: bool = True  # send the API key (where there is one)


def bad_requests(model: str, max_request_bytes: int, has_key: bool) -> list[BadRequest]:
    """What a client can get wrong, each with the status and error code the server must answer (its default
    limits of 16 stop strings, and the body limit `max_request_bytes`)."""
    chat, completions = "/v1/chat/completions", "/v1/completions"
    good = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}

    def post(name: str, body: Any, status: int, code: str | None, path: str = chat,
             content_type: str = "application/json", with_key: bool = True) -> BadRequest:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return BadRequest(name, "POST", path, content, content_type, status, code, with_key)

    padding = max_request_bytes + 1 - len(json.dumps({**good, "user": ""}).encode())
    requests = [
        post("malformed_json", b'{"model": "' + model.encode() + b'", "messages": [', 400, "invalid_json"),
        post("not_an_object", [1, 2, 3], 400, "invalid_json"),
        post("missing_messages", {"model": model, "max_tokens": 4}, 400, "missing_required_parameter"),
        post("unknown_model", {**good, "model": model + "-nonexistent"}, 400, "model_not_found"),
        post("string_temperature", {**good, "temperature": "0.5"}, 400, "invalid_value"),
        post("n_2", {**good, "n": 2}, 400, "invalid_value"),
        post("bad_role", {**good, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "invalid_value"),
        post("too_many_stops", {**good, "stop": [f"<{i}>" for i in range(17)]}, 400, None),
        post("context_overflow", {**good, "max_tokens": 10**7}, 400, "context_length_exceeded"),
        post("token_id_out_of_range", {"model": model, "prompt": [2**30], "max_tokens": 4}, 400, None, completions),
        post("text_plain", good, 415, "unsupported_media_type", content_type="text/plain"),
        post("body_too_large", {**good, "user": "x" * padding}, 413, "request_too_large"),
        BadRequest("unknown_path", "GET", "/v1/nonexistent", None, None, 404, None),
        BadRequest("wrong_method", "GET", chat, None, None, 405, None),
    ]
    if has_key:
        requests.append(post("missing_api_key", good, 401, "invalid_api_key", with_key=False))
    return requests


@dataclass
class Result:
    kind: str
    outcome: str  # one of OUTCOMES
    started_s: float  # since the start of the soak
    finished_s: float
    status: int | None = None
    detail: str | None = None  # what went wrong, or which bad request / where the client left
    completion_tokens: int = 0  # tokens received (a finished request's usage)
    left: bool = False  # the client left before the end, as planned


class Malformed(Exception):
    """An answer that breaks the OpenAI format or disagrees with itself."""


class Failed(Exception):
    """A well-formed answer that is not the one expected (another status, an in-band error)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise Malformed(message)


def check_error_body(body: Any) -> dict:
    """The OpenAI error shape {"error": {"message", "type", "param", "code"}}; returns the inner object."""
    expect(isinstance(body, dict) and isinstance(body.get("error"), dict), f"not an error body: {str(body)[:120]}")
    error = body["error"]
    expect(set(error) == {"message", "type", "param", "code"}, f"error keys {sorted(error)}")
    expect(isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str),
           f"error message/type: {error}")
    return error


def response_json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise Malformed(f"HTTP {response.status_code} body is not JSON ({error}): {response.text[:120]!r}") from None


def check_unexpected_status(response: httpx.Response, body: Any) -> None:
    """A non-200 answer to a generation request: Failed when it is a well-formed error, else Malformed."""
    error = check_error_body(body)
    raise Failed(f"HTTP {response.status_code} {error.get('code')}: {error['message'][:160]}", response.status_code)


def check_completion(body: Any, kind: Kind, max_tokens: int) -> int:
    """A non-streamed completion body; returns its completion tokens."""
    expect(isinstance(body, dict), "the body is not an object")
    expected = "chat.completion" if kind.chat else "text_completion"
    expect(body.get("object") == expected, f"object {body.get('object')!r}")
    expect(isinstance(body.get("id"), str) and isinstance(body.get("created"), int), "id / created")
    choices = body.get("choices")
    expect(isinstance(choices, list) and len(choices) == 1, f"choices {str(choices)[:80]}")
    choice = choices[0]
    text = (choice.get("message") or {}).get("content") if kind.chat else choice.get("text")
    expect(isinstance(text, str), f"no text in {str(choice)[:120]}")
    return check_counts(choice.get("finish_reason"), body.get("usage"), choice.get("token_ids"), max_tokens)


def check_counts(finish_reason: Any, usage: Any, token_ids: Any, max_tokens: int) -> int:
    expect(finish_reason in ("stop", "length"), f"finish_reason {finish_reason!r}")
    expect(isinstance(usage, dict), f"usage {usage!r}")
    completion = usage.get("completion_tokens")
    expect(isinstance(token_ids, list) and completion == len(token_ids),
           f"usage.completion_tokens {completion} but {None if token_ids is None else len(token_ids)} token ids")
    expect(completion <= max_tokens, f"{completion} tokens for max_tokens {max_tokens}")
    expect(finish_reason != "length" or completion == max_tokens, f"length after {completion} of {max_tokens}")
    expect(usage.get("total_tokens") == usage.get("prompt_tokens", -1) + completion, f"usage {usage}")
    return completion


class StreamCheck:
    """Checks a stream's chunks as they arrive: one id and object, chat's first chunk with the role, one
    finish_reason (last), then the usage chunk, whose completion_tokens must equal the token ids received."""

    def __init__(self, kind: Kind, max_tokens: int) -> None:
        self.kind = kind
        self.max_tokens = max_tokens
        self.object = "chat.completion.chunk" if kind.chat else "text_completion"
        self.id: str | None = None
        self.token_ids: list[int] = []
        self.chunks = 0
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.error: dict | None = None
        self.done = False

    def add(self, chunk: dict | None) -> None:
        expect(not self.done, "a chunk after [DONE]")
        if chunk is None:
            self.done = True
            return
        expect(self.usage is None and self.error is None, "a chunk after the usage chunk or an error event")
        if "error" in chunk:
            self.error = check_error_body(chunk)
            return
        expect(chunk.get("object") == self.object, f"chunk object {chunk.get('object')!r}")
        expect(isinstance(chunk.get("id"), str) and chunk["id"] == (self.id or chunk["id"]), "chunk ids differ")
        self.id = chunk["id"]
        choices = chunk.get("choices")
        if chunk.get("usage") is not None:
            expect(choices == [], "a usage chunk with choices")
            self.usage = chunk["usage"]
            return
        expect(isinstance(choices, list) and len(choices) == 1, f"choices {str(choices)[:80]}")
        expect(self.finish_reason is None, "a chunk after the one with finish_reason")
        choice = choices[0]
        if self.kind.chat:
            delta = choice.get("delta")
            expect(isinstance(delta, dict) and isinstance(delta.get("content", ""), str), f"delta {delta!r}")
            expect((self.chunks == 0) == ("role" in delta), "the role in a chunk other than the first")
        else:
            expect(isinstance(choice.get("text"), str), f"no text in {str(choice)[:120]}")
        ids = choice.get("token_ids", [])
        expect(isinstance(ids, list), "token_ids")
        self.token_ids += ids
        self.finish_reason = choice.get("finish_reason")
        self.chunks += 1

    def finish(self) -> int:
        """After the stream ended: its completion tokens; Failed for an in-band error, lost without [DONE]."""
        if not self.done:
            raise httpx.RemoteProtocolError(f"the stream ended without [DONE] after {self.chunks} chunks")
        if self.error is not None:
            raise Failed(f"in-band error {self.error.get('code')}: {self.error['message'][:160]}")
        return check_counts(self.finish_reason, self.usage, self.token_ids, self.max_tokens)


@dataclass
class Soak:
    """One soak run's settings and the state its clients share."""

    url: str
    model: str
    prompts: list[str]
    minutes: float
    concurrency: int
    max_tokens: int
    seed: int = 0
    api_key: str | None = None
    max_request_bytes: int = 65536
    request_timeout_s: float = 300.0
    rss_interval_s: float = 5.0
    pid: int | None = None  # the server's process (RSS from /proc); None: RSS from /metrics
    results: list[Result] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)  # t_s, rss_mb, generated, running, waiting, free_slots
    start: float = 0.0

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def now(self) -> float:
        return time.monotonic() - self.start

    # ---- one request of each kind -----------------------------------------------------------------------
    def body(self, kind: Kind, rng: random.Random) -> tuple[dict, int]:
        max_tokens = rng.randint(max(1, self.max_tokens // 4), self.max_tokens)
        prompt = rng.choice(self.prompts)
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "return_token_ids": True}
        if kind.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if rng.random() < 0.5:
            body["temperature"] = 0
        else:
            body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(2**31))
        if rng.random() < 0.2:
            body["stop"] = [STOP_STRING]
        if kind.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        if not kind.speculative:
            body["speculative"] = False
        return body, max_tokens

    async def generation(self, client: httpx.AsyncClient, kind: Kind, rng: random.Random) -> Result:
        body, max_tokens = self.body(kind, rng)
        path = "/v1/chat/completions" if kind.chat else "/v1/completions"
        started = self.now()
        result = Result(kind.name, "ok", started, started)
        try:
            if kind.stream:
                leave_after = rng.randint(0, LEAVE_STREAM_MAX_CHUNKS) if kind.leave == "stream" else None
                await self.stream(client, path, body, kind, max_tokens, leave_after, result)
            else:
                leave_after_s = rng.uniform(0, LEAVE_WAITING_MAX_S) if kind.leave == "waiting" else None
                await self.whole(client, path, body, kind, max_tokens, leave_after_s, result)
        except Failed as error:
            result.outcome, result.status, result.detail = "failed", error.status or result.status, str(error)
        except (Malformed, MalformedStream) as error:
            result.outcome, result.detail = "malformed", str(error)
        except httpx.HTTPError as error:  # transport errors, the client's timeout, a stream cut short
            result.outcome, result.detail = "lost", f"{type(error).__name__}: {error}"
        result.finished_s = self.now()
        return result

    async def whole(self, client: httpx.AsyncClient, path: str, body: dict, kind: Kind, max_tokens: int,
                    leave_after_s: float | None, result: Result) -> None:
        request = client.post(self.url + path, json=body, headers=self.headers)
        if leave_after_s is None:
            response = await request
        else:
            try:
                response = await asyncio.wait_for(request, leave_after_s)
            except TimeoutError:  # asyncio's (httpx's own timeout is an httpx.HTTPError)
                result.left, result.detail = True, f"left after {leave_after_s:.2f} s"
                return
        result.status = response.status_code
        payload = response_json(response)
        if response.status_code != 200:
            check_unexpected_status(response, payload)
        result.completion_tokens = check_completion(payload, kind, max_tokens)

    async def stream(self, client: httpx.AsyncClient, path: str, body: dict, kind: Kind, max_tokens: int,
                     leave_after: int | None, result: Result) -> None:
        check = StreamCheck(kind, max_tokens)
        async with client.stream("POST", self.url + path, json=body, headers=self.headers) as response:
            result.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                check_unexpected_status(response, response_json(response))
            expect(response.headers.get("content-type", "").startswith("text/event-stream"),
                   f"content-type {response.headers.get('content-type')!r}")
            received = 0
            async with contextlib.aclosing(sse_payloads(response)) as payloads:
                async for chunk in payloads:
                    if leave_after is not None and received >= leave_after:  # close the connection mid-stream
                        result.left, result.detail = True, f"left after {received} chunks"
                        result.completion_tokens = len(check.token_ids)
                        return
                    check.add(chunk)
                    received += 1
        result.completion_tokens = check.finish()

    async def bad(self, client: httpx.AsyncClient, rng: random.Random, catalogue: list[BadRequest]) -> Result:
        bad = rng.choice(catalogue)
        started = self.now()
        result = Result(BAD, "ok", started, started, detail=bad.name)
        headers = dict(self.headers) if bad.with_key else {}
        if bad.content_type:
            headers["Content-Type"] = bad.content_type
        try:
            response = await client.request(bad.method, self.url + bad.path, content=bad.content, headers=headers)
            result.status = response.status_code
            error = check_error_body(response_json(response))
            if response.status_code != bad.status or (bad.code is not None and error["code"] != bad.code):
                raise Failed(f"{bad.name}: HTTP {response.status_code} {error['code']}, expected {bad.status} "
                             f"{bad.code}: {error['message'][:120]}", response.status_code)
        except Failed as error:
            result.outcome, result.detail = "failed", str(error)
        except Malformed as error:
            result.outcome, result.detail = "malformed", f"{bad.name}: {error}"
        except httpx.HTTPError as error:
            result.outcome, result.detail = "lost", f"{bad.name}: {type(error).__name__}: {error}"
        result.finished_s = self.now()
        return result

    # ---- the run ----------------------------------------------------------------------------------------
    async def client_loop(self, client: httpx.AsyncClient, index: int, deadline_s: float,
                          catalogue: list[BadRequest]) -> None:
        rng = random.Random(self.seed * 1_000_003 + index)
        names, weights = list(MIX), list(MIX.values())
        while self.now() < deadline_s:
            name = rng.choices(names, weights)[0]
            if name == BAD:
                self.results.append(await self.bad(client, rng, catalogue))
            else:
                self.results.append(await self.generation(client, KINDS[name], rng))

    async def sample(self, client: httpx.AsyncClient) -> None:
        values = {}
        try:
            values = parse_samples((await client.get(self.url + "/metrics")).text)
        except httpx.HTTPError:
            pass
        rss_bytes = process_rss_bytes(self.pid) if self.pid is not None else values.get("process_resident_memory_bytes")
        self.samples.append({
            "t_s": round(self.now(), 2), "rss_mb": None if rss_bytes is None else round(rss_bytes / 2**20, 1),
            "generated": values.get("specdec:generation_tokens_total"),
            "running": values.get("specdec:num_requests_running"),
            "waiting": values.get("specdec:num_requests_waiting"),
            "free_slots": values.get("specdec:kv_cache_free_slots")})

    async def sampler(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            while not stop.is_set():
                await self.sample(client)
                try:
                    await asyncio.wait_for(stop.wait(), self.rss_interval_s)
                except TimeoutError:
                    pass
            await self.sample(client)

    async def settle(self) -> dict:
        """Waits until the server runs and waits for nothing and every KV slot is free (SETTLE_TIMEOUT_S at
        most); its /status, /health and /metrics then."""
        async with httpx.AsyncClient(timeout=30) as client:
            deadline = time.monotonic() + SETTLE_TIMEOUT_S
            while True:
                status = (await client.get(self.url + "/status")).json()
                idle = (status["num_requests_running"] == 0 and status["num_requests_waiting"] == 0
                        and status["kv_cache_free_slots"] == status["kv_cache_total_slots"])
                if idle or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            health = await client.get(self.url + "/health")
            metrics = parse_samples((await client.get(self.url + "/metrics")).text)
        return {"kv_cache_free_slots": status["kv_cache_free_slots"],
                "kv_cache_total_slots": status["kv_cache_total_slots"],
                "num_requests_running": status["num_requests_running"],
                "num_requests_waiting": status["num_requests_waiting"],
                "metrics_free_slots": metrics.get("specdec:kv_cache_free_slots"),
                "health_status": health.status_code, "engine_alive": status["engine_alive"],
                "spec_decode": status["spec_decode"], "idle": idle}

    async def run(self) -> dict:
        catalogue = bad_requests(self.model, self.max_request_bytes, self.api_key is not None)
        self.start = time.monotonic()
        deadline_s = self.minutes * 60
        stop = asyncio.Event()
        sampler = asyncio.create_task(self.sampler(stop))
        limits = httpx.Limits(max_connections=self.concurrency + 4, max_keepalive_connections=self.concurrency + 4)
        try:
            async with httpx.AsyncClient(timeout=self.request_timeout_s, limits=limits) as client:
                await asyncio.gather(*(self.client_loop(client, i, deadline_s, catalogue)
                                       for i in range(self.concurrency)))
        finally:
            wall_s = self.now()
            stop.set()
            await sampler
        end = await self.settle()
        return self.report(wall_s, end)

    # ---- the report -------------------------------------------------------------------------------------
    def report(self, wall_s: float, end: dict) -> dict:
        by_kind: dict[str, dict[str, int]] = {}
        for name in MIX:
            rows = [r for r in self.results if r.kind == name]
            by_kind[name] = {"requests": len(rows), **{o: sum(r.outcome == o for r in rows) for o in OUTCOMES},
                             "left": sum(r.left for r in rows),
                             "completion_tokens": sum(r.completion_tokens for r in rows)}
        problems = [r for r in self.results if r.outcome != "ok"]
        generated = [r for r in self.results if r.kind != BAD and r.outcome == "ok" and not r.left]
        tokens = sum(r.completion_tokens for r in generated)
        slots_free = bool(end["idle"] and end["kv_cache_free_slots"] == end["kv_cache_total_slots"])
        rss = [(s["t_s"], s["rss_mb"]) for s in self.samples if s["rss_mb"] is not None]
        loaded_s = min(wall_s, self.minutes * 60)  # the clients' deadline; the drain after it is not compared
        first = [mb for t, mb in rss if t <= min(60.0, loaded_s)]
        last = [mb for t, mb in rss if max(0.0, loaded_s - 60.0) <= t <= loaded_s]
        counts = {o: sum(r.outcome == o for r in self.results) for o in OUTCOMES}
        return {
            "url": self.url, "model": self.model, "minutes": self.minutes, "concurrency": self.concurrency,
            "max_tokens": self.max_tokens, "seed": self.seed, "mix": MIX, "wall_s": round(wall_s, 1),
            "requests": len(self.results), **counts, "by_kind": by_kind,
            "problem_samples": [asdict(r) for r in problems[:20]],
            "completed_generations": len(generated), "completion_tokens": tokens,
            "tok_s": round(tokens / wall_s, 1) if wall_s > 0 else 0.0,
            "requests_per_minute": round(len(self.results) / wall_s * 60, 1) if wall_s > 0 else 0.0,
            "per_minute": self.per_minute(wall_s, self.minutes * 60),
            "rss_first_minute_median_mb": median(first), "rss_last_minute_median_mb": median(last),
            "rss_change_mb": None if not first or not last else round(median(last) - median(first), 1),
            "rss_samples": [[t, mb] for t, mb in rss],
            "end": end, "slots_free": slots_free, "speculation": speculation(end["spec_decode"]),
            "passed": not (counts["failed"] or counts["malformed"] or counts["lost"]) and slots_free
                      and end["health_status"] == 200,
        }

    def per_minute(self, wall_s: float, deadline_s: float) -> list[dict]:
        """Per minute of the run: requests ended, generations completed, their completion tokens per second (at
        the time each one completed), the server's generated tokens per second (its counter; abandoned requests
        included) and the median RSS. A last, shorter row ("drain": true) covers the time after the clients'
        deadline, while the requests in flight finish."""
        edges = [60.0 * m for m in range(math.ceil(min(deadline_s, wall_s) / 60))] + [min(deadline_s, wall_s)]
        if wall_s > deadline_s:
            edges.append(wall_s)
        rows = []
        for index, (lo, hi) in enumerate(zip(edges, edges[1:])):
            last_one = index == len(edges) - 2
            ended = [r for r in self.results if lo <= r.finished_s < hi or (last_one and r.finished_s >= hi)]
            done = [r for r in ended if r.kind != BAD and r.outcome == "ok" and not r.left]
            window = [s for s in self.samples if lo <= s["t_s"] <= (math.inf if last_one else hi)]
            counter = [s for s in window if s["generated"] is not None]
            server_tok_s = None
            if len(counter) >= 2 and counter[-1]["t_s"] > counter[0]["t_s"]:
                server_tok_s = round((counter[-1]["generated"] - counter[0]["generated"])
                                     / (counter[-1]["t_s"] - counter[0]["t_s"]), 1)
            tokens = sum(r.completion_tokens for r in done)
            rows.append({"minute": index + 1, "drain": lo >= deadline_s, "seconds": round(hi - lo, 1),
                         "requests": len(ended), "completed_generations": len(done), "completion_tokens": tokens,
                         "tok_s": round(tokens / max(hi - lo, 1e-9), 1), "server_tok_s": server_tok_s,
                         "rss_median_mb": median([s["rss_mb"] for s in window if s["rss_mb"] is not None])})
        return rows


def speculation(spec: dict) -> dict:
    """What the engine speculated during the run (its counters since start, from /status)."""
    return {"verify_steps": spec["verify_steps"], "drafted_tokens": spec["drafted_tokens"],
            "accepted_tokens": spec["accepted_tokens"], "acceptance_rate": round(spec["acceptance_rate"], 3),
            "mean_accepted_length": round(spec["mean_accepted_length"], 3)}


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def process_rss_bytes(pid: int) -> float | None:
    """VmRSS of a process, from /proc (None once it has gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def format_summary(report: dict) -> str:
    header = f"{'kind':<18} {'reqs':>6} {'ok':>6} {'left':>5} {'failed':>6} {'malformed':>9} {'lost':>5} {'tokens':>8}"
    lines = [header]
    rows = list(report["by_kind"].items())
    total = {key: sum(row[key] for _, row in rows) for key in ("requests", "ok", "left", "failed", "malformed", "lost",
                                                                 "completion_tokens")}
    for name, row in [*rows, ("all", total)]:
        lines.append(f"{name:<18} {row['requests']:>6} {row['ok']:>6} {row['left']:>5} {row['failed']:>6} "
                     f"{row['malformed']:>9} {row['lost']:>5} {row['completion_tokens']:>8}")
    lines.append("(left: clients that left before the end, as planned, counted in ok; tokens: completion tokens "
                 "received)")
    lines.append("")
    lines.append(f"{'minute':>6} {'reqs':>5} {'done':>5} {'tok/s':>7} {'server tok/s':>12} {'rss MB':>7}")
    for row in report["per_minute"]:
        server = "-" if row["server_tok_s"] is None else f"{row['server_tok_s']:.1f}"
        rss = "-" if row["rss_median_mb"] is None else f"{row['rss_median_mb']:.0f}"
        minute = "drain" if row["drain"] else row["minute"]
        lines.append(f"{minute:>6} {row['requests']:>5} {row['completed_generations']:>5} {row['tok_s']:>7.1f} "
                     f"{server:>12} {rss:>7}")
    end = report["end"]
    lines += ["", f"{report['requests']} requests in {report['wall_s']:.0f} s "
                  f"({report['requests_per_minute']:.0f}/min), {report['completion_tokens']} completion tokens of "
                  f"completed generations, {report['tok_s']:.1f} tok/s",
              f"lost {report['lost']}, malformed {report['malformed']}, failed {report['failed']}",
              f"RSS median first minute {report['rss_first_minute_median_mb']} MB, last minute "
              f"{report['rss_last_minute_median_mb']} MB (change {report['rss_change_mb']} MB)",
              f"at the end: {end['kv_cache_free_slots']}/{end['kv_cache_total_slots']} KV slots free, "
              f"{end['num_requests_running']} running, {end['num_requests_waiting']} waiting, "
              f"/health {end['health_status']}",
              "speculation: {verify_steps} verify steps with drafts, {drafted_tokens} tokens drafted, "
              "{accepted_tokens} accepted (acceptance {acceptance_rate}, mean accepted length {mean_accepted_length})"
              .format(**report["speculation"])]
    for problem in report["problem_samples"][:5]:
        lines.append(f"  {problem['outcome']}: {problem['kind']}: {problem['detail']}")
    lines.append("PASSED" if report["passed"] else "FAILED")
    return "\n".join(lines)


# ---- the server subprocess ----------------------------------------------------------------------------------
@dataclass
class ServerProcess:
    process: subprocess.Popen
    url: str
    log_path: Path
    command: list[str]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def specdec_command() -> list[str]:
    """The `specdec` script beside this Python (a virtual environment's), else the one on PATH."""
    beside = Path(sys.executable).with_name("specdec")
    found = str(beside) if beside.exists() else shutil.which("specdec")
    if found is None:
        raise SystemExit("soak: the `specdec` command is not installed")
    return [found]


def server_command(args: argparse.Namespace, port: int) -> list[str]:
    command = [*specdec_command(), "serve", args.model, "--port", str(port), "--threads", str(SERVER_THREADS),
               "--max-num-seqs", str(args.max_num_seqs), "--max-request-bytes", str(args.max_request_bytes)]
    if args.speculative_config:
        command += ["--speculative-config", args.speculative_config, "--draft-policy", args.draft_policy]
    return command + shlex.split(args.serve_args)


def start_server(args: argparse.Namespace, api_key: str, log_path: Path) -> ServerProcess:
    port = free_port()
    command = server_command(args, port)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "SPECDEC_API_KEY": api_key})
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log_path, command)
    deadline = time.monotonic() + args.start_timeout
    while True:
        if process.poll() is not None:
            raise SystemExit(f"soak: the server exited with {process.returncode} while starting:\n{log_tail(log_path)}")
        try:
            if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(server)
            raise SystemExit(f"soak: the server did not answer /health within {args.start_timeout:g} s:\n"
                             f"{log_tail(log_path)}")
        time.sleep(0.5)


def stop_server(server: ServerProcess, timeout_s: float = 60.0) -> dict:
    """SIGTERM (a graceful shutdown), SIGKILL after timeout_s; the exit code, how long the stop took, and whether
    it was clean."""
    started = time.monotonic()
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
    try:
        code = server.process.wait(timeout_s)
        killed = False
    except subprocess.TimeoutExpired:
        server.process.kill()
        code, killed = server.process.wait(), True
    # uvicorn re-raises the signal once it has shut down gracefully: -SIGTERM is a clean stop, as 0 is
    clean = not killed and code in (0, -signal.SIGTERM)
    return {"exit_code": code, "stop_s": round(time.monotonic() - started, 2), "killed": killed, "clean_stop": clean}


def log_tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def log_problems(path: Path) -> list[str]:
    """Lines of the server's log that speak of an error or a traceback (a clean soak has none)."""
    return [line for line in path.read_text(errors="replace").splitlines()
            if "Traceback" in line or line.startswith(("ERROR", "CRITICAL")) or " ERROR " in line]


def disconnect_lines(path: Path) -> list[str]:
    """The server's info lines of clients that left (one per request aborted for it)."""
    return [line for line in path.read_text(errors="replace").splitlines()
            if "client disconnected" in line or "(the client left or the server is stopping)" in line]


def git_commit() -> str | None:
    """The checkout's commit, with "+changes" when tracked files differ from it (None outside a git checkout)."""
    def git(*command: str) -> str:
        return subprocess.run(["git", *command], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-270m", help="the model `specdec serve` serves")
    parser.add_argument("--speculative-config", default=None, help="JSON for `specdec serve` (default: plain)")
    parser.add_argument("--minutes", type=float, default=10.0, help="how long clients start new requests")
    parser.add_argument("--concurrency", type=int, default=16, help="clients sending back to back")
    parser.add_argument("--max-tokens", type=int, default=128, help="each request asks for [max/4, max] tokens")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="the server's KV slots (the rest wait)")
    parser.add_argument("--draft-policy", default="fixed", choices=("fixed", "adaptive"),
                        help="the server's draft policy when speculating. fixed (default): every step drafts, so the "
                             "speculative path runs under the whole mix; adaptive: the server's default, which may "
                             "keep k = 0 throughout at larger batches on a small CPU")
    parser.add_argument("--max-request-bytes", type=int, default=65536,
                        help="the server's body limit (the body_too_large request sends one byte more)")
    parser.add_argument("--serve-args", default="", help="more options for `specdec serve`, e.g. "
                        "'--prefix-cache-tokens 0'")
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS, help="Spec-Bench or HumanEval JSONL")
    parser.add_argument("--category", default="all")
    parser.add_argument("--seed", type=int, default=0, help="seeds the clients' choices (the same sequence per run)")
    parser.add_argument("--rss-interval", type=float, default=5.0, help="seconds between samples of the server")
    parser.add_argument("--request-timeout", type=float, default=300.0,
                        help="seconds a client waits for one answer before it counts as lost")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds the server may take to start")
    parser.add_argument("--url", default=None, help="drive this running server instead of starting one")
    parser.add_argument("--api-key", default=None, help="with --url: the server's API key")
    parser.add_argument("--output", default=None,
                        help="JSON report (default bench_results/soak-MODEL-METHOD-TIME.json)")
    return parser.parse_args(argv)


def default_output(args: argparse.Namespace) -> Path:
    method = json.loads(args.speculative_config).get("method", "spec") if args.speculative_config else "plain"
    return Path("bench_results") / f"soak-{Path(args.model).name}-{method}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    commit = git_commit()  # the code the server starts with
    output = Path(args.output) if args.output else default_output(args)
    prompts = load_prompts(args.prompts, None if args.category == "all" else args.category)
    server = None
    if args.url:
        url, api_key = args.url.rstrip("/"), args.api_key
        model = served_model(url, {"Authorization": f"Bearer {api_key}"} if api_key else {})
    else:
        api_key = secrets.token_hex(16)
        server = start_server(args, api_key, output.with_suffix(".server.log"))
        url, model = server.url, args.model
        print(f"[soak: {' '.join(server.command)} (log {server.log_path})]", file=sys.stderr)
    soak = Soak(url=url, model=model, prompts=prompts, minutes=args.minutes, concurrency=args.concurrency,
                max_tokens=args.max_tokens, seed=args.seed, api_key=api_key, max_request_bytes=args.max_request_bytes,
                request_timeout_s=args.request_timeout, rss_interval_s=args.rss_interval,
                pid=server.process.pid if server else None)
    try:
        report = asyncio.run(soak.run())
    finally:
        stopped = stop_server(server) if server else None
    from specdec.bench.provenance import cpu_name

    report.update(cpu=cpu_name(), commit=commit, date=time.strftime("%Y-%m-%d"),
                  speculative_config=json.loads(args.speculative_config) if args.speculative_config else None,
                  draft_policy=args.draft_policy if server and args.speculative_config else None,
                  max_num_seqs=args.max_num_seqs if server else None, server_threads=SERVER_THREADS if server else None,
                  soak_command=" ".join(["python", "-m", "specdec.bench.soak",
                                         *(argv if argv is not None else sys.argv[1:])]))
    if server:
        problems = log_problems(server.log_path)
        report["server"] = {"command": " ".join(server.command), "log": str(server.log_path), **stopped,
                            "log_problem_lines": len(problems), "log_problem_samples": problems[:10],
                            "disconnect_lines": len(disconnect_lines(server.log_path))}
        report["passed"] = report["passed"] and not problems and stopped["clean_stop"]
    if args.speculative_config and not report["speculation"]["drafted_tokens"]:
        report["warning"] = ("the server never drafted (its draft policy kept k = 0 throughout): the run did not "
                             "exercise speculation; use --draft-policy fixed")
    print(format_summary(report))
    if report.get("warning"):
        print(f"WARNING: {report['warning']}")
    if server:
        print(f"server log: {len(problems)} error lines, {report['server']['disconnect_lines']} lines of clients that "
              f"left; stopped {'cleanly' if stopped['clean_stop'] else 'NOT cleanly'} (exit code "
              f"{stopped['exit_code']}) in {stopped['stop_s']} s")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2))
    print(f"wrote {output}", file=sys.stderr)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
