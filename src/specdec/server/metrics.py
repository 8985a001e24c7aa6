"""Server metrics in the Prometheus text format (0.0.4), names following vLLM's (`vllm:` -> `specdec:`).

Counters (monotonic):
  specdec:spec_decode_num_drafts_total                     verify steps that checked a draft (.verify_steps)
  specdec:spec_decode_num_draft_tokens_total               draft tokens proposed
  specdec:spec_decode_num_accepted_tokens_total            draft tokens accepted (recovered/bonus tokens not counted)
  specdec:spec_decode_num_accepted_tokens_per_pos_total{position=i}   steps whose draft token i was accepted
  specdec:prompt_tokens_total / specdec:generation_tokens_total
  specdec:request_success_total{finished_reason}           requests that ended with stop / length
  specdec:request_failure_total{reason}                    requests failed by the engine, or aborted (client gone)
  specdec:engine_step_errors_total                         Engine.step() calls that raised
  specdec:prefix_cache_queries_total / specdec:prefix_cache_hits_total   prompt tokens looked up in the prefix
      cache / of those, copied from it instead of prefilled (tokens, as vLLM's)
Histograms (seconds, measured in the engine thread from the moment the HTTP handler submitted the request):
  specdec:time_to_first_token_seconds, specdec:e2e_request_latency_seconds,
  specdec:inter_token_latency_seconds (a step that emits n tokens after a gap g observes g/n n times, so
      speculation shows up as lower per-token latency)
Gauges: specdec:num_requests_running, specdec:num_requests_waiting (engine queue + not yet handed to the
  engine), specdec:kv_cache_free_slots, specdec:kv_cache_total_slots, process_resident_memory_bytes.
"""
from __future__ import annotations

import bisect
import math
import os
import threading
from dataclasses import dataclass, field

from specdec.engine.metrics import SpecDecodeMetrics

PREFIX = "specdec:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bucket (not cumulative), plus +Inf at the end
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, help_text: str) -> list[str]:
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, count in zip((*self.buckets, math.inf), self.counts):
            cumulative += count
            out.append(f'{name}_bucket{{le="{_format(bound)}"}} {cumulative}')
        out += [f"{name}_sum {_format(self.total)}", f"{name}_count {self.count}"]
        return out


@dataclass(frozen=True)
class EngineSnapshot:
    """What the engine thread publishes after each step (readers never touch the Engine)."""

    running: int = 0
    waiting: int = 0
    free_slots: int = 0
    total_slots: int = 0
    spec: SpecDecodeMetrics = field(default_factory=SpecDecodeMetrics)
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0


class ServerMetrics:
    """Thread-safe: the engine thread records, the HTTP thread renders."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ttft = Histogram()
        self.e2e = Histogram()
        self.itl = Histogram()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.successes: dict[str, int] = {}
        self.failures: dict[str, int] = {}
        self.step_errors = 0

    def record_tokens(self, first: bool, num_tokens: int, since_arrival_s: float, since_last_s: float) -> None:
        with self._lock:
            self.generation_tokens += num_tokens
            if first:
                self.ttft.observe(since_arrival_s)
            elif num_tokens:
                for _ in range(num_tokens):
                    self.itl.observe(since_last_s / num_tokens)

    def record_prompt(self, num_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += num_tokens

    def record_finish(self, reason: str, latency_s: float) -> None:
        with self._lock:
            self.successes[reason] = self.successes.get(reason, 0) + 1
            self.e2e.observe(latency_s)

    def record_failure(self, reason: str) -> None:
        with self._lock:
            self.failures[reason] = self.failures.get(reason, 0) + 1

    def record_step_error(self) -> None:
        with self._lock:
            self.step_errors += 1

    def render(self, snapshot: EngineSnapshot, pending: int) -> str:
        with self._lock:
            lines = (_spec_lines(snapshot.spec) + self._request_lines() + _prefix_cache_lines(snapshot)
                     + _gauge_lines(snapshot, pending))
        return "\n".join(lines) + "\n"

    def _request_lines(self) -> list[str]:
        lines = _counter("prompt_tokens", "Prompt tokens of admitted requests.", {(): self.prompt_tokens})
        lines += _counter("generation_tokens", "Generated tokens.", {(): self.generation_tokens})
        lines += _counter("request_success", "Finished requests by finish reason.",
                          {(("finished_reason", r),): n for r, n in sorted(self.successes.items())})
        lines += _counter("request_failure", "Requests failed by the engine or aborted.",
                          {(("reason", r),): n for r, n in sorted(self.failures.items())})
        lines += _counter("engine_step_errors", "Engine steps that raised.", {(): self.step_errors})
        lines += self.ttft.lines(PREFIX + "time_to_first_token_seconds", "Time to first token.")
        lines += self.e2e.lines(PREFIX + "e2e_request_latency_seconds", "End-to-end request latency.")
        lines += self.itl.lines(PREFIX + "inter_token_latency_seconds", "Latency per output token after the first.")
        return lines


def _spec_lines(spec: SpecDecodeMetrics) -> list[str]:
    lines = _counter("spec_decode_num_drafts", "Verify steps that checked a draft.", {(): spec.verify_steps})
    lines += _counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", {(): spec.drafted_tokens})
    lines += _counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", {(): spec.accepted_tokens})
    lines += _counter("spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by draft position.",
                      {(("position", str(i)),): n for i, n in enumerate(spec.accepted_per_position)})
    return lines


def _prefix_cache_lines(snapshot: EngineSnapshot) -> list[str]:
    lines = _counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     {(): snapshot.prefix_cache_queries})
    lines += _counter("prefix_cache_hits", "Prompt tokens copied from the prefix cache instead of prefilled.",
                      {(): snapshot.prefix_cache_hits})
    return lines


def _gauge_lines(snapshot: EngineSnapshot, pending: int) -> list[str]:
    lines = _gauge(PREFIX + "num_requests_running", "Requests in the running batch.", snapshot.running)
    lines += _gauge(PREFIX + "num_requests_waiting", "Requests waiting for a KV slot.", snapshot.waiting + pending)
    lines += _gauge(PREFIX + "kv_cache_free_slots", "Free KV-cache slots.", snapshot.free_slots)
    lines += _gauge(PREFIX + "kv_cache_total_slots", "KV-cache slots (max_num_seqs).", snapshot.total_slots)
    rss = resident_memory_bytes()
    if rss is not None:
        lines += _gauge("process_resident_memory_bytes", "Resident memory size in bytes.", rss)
    return lines


def _counter(name: str, help_text: str, samples: dict[tuple[tuple[str, str], ...], int]) -> list[str]:
    full = PREFIX + name
    out = [f"# HELP {full} {help_text}", f"# TYPE {full} counter"]
    for labels, value in samples.items():
        out.append(f"{full}_total{_labels(labels)} {_format(value)}")
    return out


def _gauge(name: str, help_text: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {_format(value)}"]


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    escaped = (
        f'{key}="{_escape_label(value)}"'
        for key, value in labels
    )
    return "{" + ",".join(escaped) + "}"


def _format(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


def resident_memory_bytes() -> int | None:
    """RSS from /proc (Linux); None elsewhere."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _escape_label(value: str) -> str:
    """A label value in the text format: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
