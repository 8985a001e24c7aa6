"""Replicas against threads: the load script against `specdec serve --replicas R --threads T`, one server at a time.

    python -m specdec.bench.replica_bench --model gemma-3-270m --configs 1x2,2x1 --methods plain,ngram \\
        --concurrency 1,2,4,8,16 --requests 32 --max-tokens 128 --category summarization

For each method (plain, or ngram with --ngram-config) and configuration, in that order:
- `RxT` starts `specdec serve MODEL --replicas R --threads T --max-num-seqs S/R` (S = --total-slots, so that every
  configuration holds the same KV slots), on a local Ray that the command starts;
- `single` starts the server without Ray (`--threads` = the cores, `--max-num-seqs S`), the reference for the
  router's own cost.
It waits for /health, sends one short request per replica (warm-up), runs the load script's levels
(specdec.bench.load_test: C closed-loop clients streaming chat completions, greedy, the same prompts for every
server), and stops the server (SIGTERM) before the next one starts. Prints one table (output tok/s, p50/p95
request latency, p50 time to first token, errors per level) and writes everything as JSON.

Run it on a quiet machine: the configurations share the cores in turn, and any other load moves the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from specdec.bench import load_test
from specdec.bench.soak import ServerProcess, free_port, git_commit, log_tail, specdec_command, stop_server

DEFAULT_NGRAM = '{"method": "ngram", "num_speculative_tokens": 16}'


@dataclass(frozen=True)
class ServerShape:
    """One configuration: `replicas` engines of `threads` threads (replicas None: the server without Ray)."""

    name: str
    replicas: int | None
    threads: int


def parse_configs(text: str, cores: int) -> list[ServerShape]:
    shapes = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        if item == "single":
            shapes.append(ServerShape(item, None, cores))
            continue
        replicas, separator, threads = item.partition("x")
        if not (separator and replicas.isdigit() and threads.isdigit() and int(replicas) > 0 and int(threads) > 0):
            raise SystemExit(f"replica_bench: a configuration is RxT (e.g. 2x1) or single, got {item!r}")
        shapes.append(ServerShape(item, int(replicas), int(threads)))
    return shapes


def server_command(args: argparse.Namespace, shape: ServerShape, speculative_config: str | None,
                   port: int) -> list[str]:
    slots = args.total_slots if shape.replicas is None else max(1, args.total_slots // shape.replicas)
    command = [*specdec_command(), "serve", args.model, "--port", str(port), "--threads", str(shape.threads),
               "--max-num-seqs", str(slots)]
    if shape.replicas is not None:
        command += ["--replicas", str(shape.replicas)]
    if speculative_config is not None:
        command += ["--speculative-config", speculative_config]
    return command + shlex.split(args.serve_args)


def start(command: list[str], log_path: Path, timeout_s: float) -> tuple[subprocess.Popen, str]:
    """The server process and its URL once /health answers 200."""
    port = int(command[command.index("--port") + 1])
    url = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise SystemExit(f"replica_bench: the server exited with {process.returncode}:\n{log_tail(log_path)}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"replica_bench: no /health 200 within {timeout_s:g} s:\n{log_tail(log_path)}")
        time.sleep(0.5)


def warm_up(url: str, count: int) -> None:
    """Short requests with distinct prompts, so that each replica has served before the levels are timed."""
    model = load_test.served_model(url, {})
    for i in range(count):
        body = {"model": model, "messages": [{"role": "user", "content": f"Warm-up {i}: say hello."}],
                "max_tokens": 4, "temperature": 0}
        httpx.post(url + "/v1/chat/completions", json=body, timeout=600).raise_for_status()


def run_one(args: argparse.Namespace, shape: ServerShape, method: str, work_dir: Path) -> dict:
    speculative_config = None if method == "plain" else args.ngram_config
    command = server_command(args, shape, speculative_config, free_port())
    label = f"{method}-{shape.name}"
    log_path, report_path = work_dir / f"{label}.log", work_dir / f"{label}.json"
    print(f"[{label}: {shlex.join(command)}]", file=sys.stderr)
    process, url = start(command, log_path, args.start_timeout)
    try:
        warm_up(url, 2 * (shape.replicas or 1))
        load_args = ["--url", url, "--concurrency", args.concurrency, "--prompts", args.prompts, "--category",
                     args.category, "--max-tokens", str(args.max_tokens), "--requests", str(args.requests),
                     "--output", str(report_path)]
        load_test.main(load_args)
    finally:
        stop = stop_server(ServerProcess(process, url, log_path, command))
    report = json.loads(report_path.read_text())
    return {"method": method, "config": shape.name, "replicas": shape.replicas, "threads": shape.threads,
            "command": command, "stop": stop, "levels": report["levels"]}


def format_table(runs: list[dict]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    rows = ["| method | config | concurrency | tok/s | latency p50 ms | latency p95 ms | TTFT p50 ms | errors |",
            "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        for level in run["levels"]:
            rows.append(f"| {run['method']} | {run['config']} | {level['concurrency']} | {level['output_tok_s']:.1f} "
                        f"| {ms(level['latency_p50_s'])} | {ms(level['latency_p95_s'])} | {ms(level['ttft_p50_s'])} "
                        f"| {level['errors']} |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--configs", default="1x2,2x1", help="comma-separated RxT (replicas x threads) or single")
    parser.add_argument("--methods", default="plain,ngram", help="plain and/or ngram")
    parser.add_argument("--ngram-config", default=DEFAULT_NGRAM, help="the --speculative-config of the ngram runs")
    parser.add_argument("--total-slots", type=int, default=16, help="KV slots of each configuration, all replicas "
                                                                    "together (default 16)")
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--requests", type=int, default=32, help="requests per level (at least the concurrency)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts", default="/work/shared/data/spec_bench_dev.jsonl")
    parser.add_argument("--category", default="summarization")
    parser.add_argument("--serve-args", default="--max-model-len 2048", help="more `specdec serve` options")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--work-dir", default="bench_results/replica-bench",
                        help="server logs and per-run load reports")
    parser.add_argument("--output", default="bench_results/replica-bench/replica_bench.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    shapes = parse_configs(args.configs, cores)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if unknown := [m for m in methods if m not in ("plain", "ngram")]:
        raise SystemExit(f"replica_bench: unknown methods {unknown} (plain, ngram)")
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    runs = [run_one(args, shape, method, work_dir) for method in methods for shape in shapes]
    print(format_table(runs))
    report = {"model": args.model, "category": args.category, "max_tokens": args.max_tokens,
              "requests_per_level": args.requests, "total_slots": args.total_slots, "cores": cores,
              "commit": git_commit(), "runs": runs}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}", file=sys.stderr)
    return 1 if any(level["errors"] or level["malformed"] for run in runs for level in run["levels"]) else 0


if __name__ == "__main__":
    sys.exit(main())
