"""Speed-up of speculation against the batch size, with and without the batch-aware draft-length rule.

    python -m specdec.bench.batch_sweep --model gemma-3-270m --method 'ngram:{"num_speculative_tokens":5}' \\
        --dataset ../shared/data/spec_bench_dev.jsonl --category summarization --batch-sizes 1,2,4,8,16 \\
        --max-new-tokens 64 --out bench_results/batch-sweep

For each batch size B, B prompts of the category are generated together (greedy, one engine step loop) three
ways on one loaded target, interleaved per repeat: plain decoding; speculation with the default adaptive
policy, whose row budget (the knee of T(n)) shortens drafts as B grows and turns them off past it
("batch-aware"); and speculation with a fixed k for every sequence whatever B ("fixed k, no batch rule").
Reports output tokens per second (all B requests, prefill included) and the speed-ups over plain in the same
run, checks every speculative output equals the plain one, writes JSON and a PNG plot.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from specdec.config import SamplingParams

CONFIGS = ("plain", "batch-aware", "fixed")
NO_ROW_LIMIT = 10**6


@dataclass(frozen=True)
class SweepPoint:
    batch_size: int
    config: str  # one of CONFIGS
    tokens_per_s: float  # median over repeats of (output tokens of all B requests / wall time)
    speedup: float  # over plain at the same batch size, same run
    mean_accepted_length: float | None
    identical: bool  # every output equals plain decoding's


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--method", default='ngram:{"num_speculative_tokens":5}',
                        help='speculative method as NAME or NAME:{json config} (as in specdec bench)')
    parser.add_argument("--dataset", default="../shared/data/spec_bench_dev.jsonl")
    parser.add_argument("--category", default="summarization")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-verify-tokens", type=int, default=32, help="the batch-aware policy's row cap")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="bench_results/batch-sweep")
    parser.add_argument("--no-plots", action="store_true")
    return parser.parse_args(argv)


def method_config(method: str, model: str) -> dict:
    """The speculative config of --method (NAME or NAME:{json}), with the benchmark's defaults."""
    from specdec.bench.methods import parse_methods

    specs = [spec for spec in parse_methods([method], model) if spec.config is not None]
    if len(specs) != 1:
        raise ValueError(f"--method must name exactly one speculative method, got {method!r}")
    return specs[0].config


def build_llms(loaded, config: dict, max_batch: int, max_verify_tokens: int = 32) -> dict:
    """One LLM per entry of CONFIGS, all sharing the loaded (target, tokenizer); separate engines and caches."""
    from specdec.engine.draft_length.policy import BatchDraftPolicy
    from specdec.llm import LLM

    common = dict(loaded=loaded, max_num_seqs=max_batch, max_model_len=4096)
    return {
        "plain": LLM(**common),
        "batch-aware": LLM(speculative_config=config, max_verify_tokens=max_verify_tokens, **common),
        "fixed": LLM(speculative_config=config, max_verify_tokens=NO_ROW_LIMIT, **common,
                     draft_policy=BatchDraftPolicy(config["num_speculative_tokens"], NO_ROW_LIMIT)),
    }


def load_prompts(path: str, category: str, count: int, llm) -> list[list[int]]:
    from specdec.datasets import load_questions

    questions = load_questions(path, [category])
    if not questions:
        raise ValueError(f"no questions of category {category!r} in {path}")
    return [llm.tokenizer.encode_chat([{"role": "user", "content": questions[i % len(questions)].turns[0]}])
            for i in range(count)]


def run_once(llm, prompts: list[list[int]], max_new_tokens: int, speculative: bool):
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, speculative=speculative)
    return outputs, time.perf_counter() - start


def sweep(llms: dict, prompts: list[list[int]], batch_sizes: list[int], max_new_tokens: int,
          repeats: int) -> list[SweepPoint]:
    points = []
    for batch_size in batch_sizes:
        batch = prompts[:batch_size]
        speeds = {config: [] for config in CONFIGS}
        outputs = {}
        for _ in range(repeats):
            for config in CONFIGS:  # interleaved, so drift on the machine hits all three alike
                result, wall_s = run_once(llms[config], batch, max_new_tokens, speculative=config != "plain")
                speeds[config].append(sum(len(o.token_ids) for o in result) / wall_s)
                outputs[config] = result
        plain_speed = statistics.median(speeds["plain"])
        for config in CONFIGS:
            steps = sum(o.metrics.verify_steps for o in outputs[config])
            accepted = sum(o.metrics.accepted_tokens for o in outputs[config])
            speed = statistics.median(speeds[config])
            points.append(SweepPoint(
                batch_size, config, speed, speed / plain_speed,
                1 + accepted / steps if config != "plain" and steps else None,
                all(o.token_ids == p.token_ids for o, p in zip(outputs[config], outputs["plain"]))))
        print(format_rows([p for p in points if p.batch_size == batch_size]), file=sys.stderr)
    return points


def format_rows(points: list[SweepPoint]) -> str:
    return "\n".join(
        f"B={p.batch_size:>3} {p.config:>12}: {p.tokens_per_s:7.1f} tok/s  x{p.speedup:.2f}  "
        f"tau {'-' if p.mean_accepted_length is None else f'{p.mean_accepted_length:.2f}'}  "
        f"{'identical' if p.identical else 'MISMATCH'}" for p in points)


def plot(points: list[SweepPoint], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for config, label in (("batch-aware", "adaptive k (batch-aware rule)"), ("fixed", "fixed k (no batch rule)")):
        series = [p for p in points if p.config == config]
        axis.plot([p.batch_size for p in series], [p.speedup for p in series], marker="o", label=label)
    axis.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    axis.set_xscale("log", base=2)
    axis.set_xticks(sorted({p.batch_size for p in points}), [str(b) for b in sorted({p.batch_size for p in points})])
    axis.set_xlabel("batch size (concurrent requests)")
    axis.set_ylabel("speed-up over plain decoding")
    axis.set_title(title)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from specdec.runtime import configure_threads, load_model

    configure_threads(args.threads)
    batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",") if b.strip()})
    config = method_config(args.method, args.model)
    llms = build_llms(load_model(args.model), config, max(batch_sizes), args.max_verify_tokens)
    prompts = load_prompts(args.dataset, args.category, max(batch_sizes), llms["plain"])
    points = sweep(llms, prompts, batch_sizes, args.max_new_tokens, args.repeats)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"model": args.model, "speculative_config": config, "category": args.category,
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "points": [asdict(p) for p in points]}
    (out / "batch_sweep.json").write_text(json.dumps(report, indent=2))
    if not args.no_plots:
        plot(points, out / "batch_sweep.png", f"{args.model}, {config['method']}, {args.category}")
    print(format_rows(points))
    return 0 if all(p.identical for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
