"""Where one forward's time goes, kernel by kernel, for n = 1 and n = 8 new tokens (or other row counts).

    python -m specdec.bench.forward_breakdown --model smollm2-135m-instruct [--context 256] [--rows 1,8]
        [--weight-format auto]

Every kernel entry point the model calls (attention, the row-wise kernels, each linear by its shape) is
wrapped in a timer for the measurement and restored afterwards; the forwards themselves run unchanged. Each
round times `--forwards` forwards of every row count one after the other, and the table gives, per part, the
median over `--rounds` rounds of its time per forward. "the rest" is the forward's time outside the timed
kernels (embedding, residual adds, cache writes, Python).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

import specdec.models.transformer as transformer_module
from specdec.engine.draft_length.measure import prefilled_row_batches
from specdec.models.layers import Linear

TIMED_KERNELS = ("attention", "rms_norm", "qk_norm_rope", "gated_activation")
REST = "the rest"


@dataclass(frozen=True)
class ForwardBreakdown:
    """Seconds per forward: total[rows] and parts[part][rows] (medians over rounds)."""

    total: dict[int, float]
    parts: dict[str, dict[int, float]]


def _linear_label(linear: Linear) -> str:
    """'linear INxOUT', with ' q4', ' q5' or ' q6' after a layer in those formats (a model in auto mixes q4, q6 and q8
    layers)."""
    if linear.blocks is not None:
        return f"linear {linear.blocks.in_features}x{linear.out_features} {linear.format}"
    if linear.quantized is not None:
        return f"linear {linear.quantized.in_features}x{linear.out_features}"
    return f"linear {linear.dense.shape[1]}x{linear.out_features}"


@contextlib.contextmanager
def timed_kernels(seconds: dict[str, float]) -> Iterator[None]:
    """While active, every call of the model's kernels adds its wall time to seconds[part]."""

    def timed(fn: Callable, label: Callable[..., str]) -> Callable:
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            seconds[label(*args)] += time.perf_counter() - start
            return result

        return wrapper

    originals = {name: getattr(transformer_module, name) for name in TIMED_KERNELS}
    linear_call = Linear.__call__
    try:
        for name, fn in originals.items():
            setattr(transformer_module, name, timed(fn, lambda *_, name=name: name))
        Linear.__call__ = timed(linear_call, lambda linear, *_: _linear_label(linear))
        yield
    finally:
        for name, fn in originals.items():
            setattr(transformer_module, name, fn)
        Linear.__call__ = linear_call


def forward_breakdown(model, cache, slot: int, context: int, rows: Sequence[int], forwards: int = 30,
                      rounds: int = 3) -> ForwardBreakdown:
    """Per-part seconds of one forward of n new tokens of one sequence after `context` cached tokens (random ids,
    prefilled into `slot` first), n in rows."""
    batches = prefilled_row_batches(model, cache, slot, context, rows, max(rows))
    totals: dict[int, list[float]] = defaultdict(list)
    parts: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for _ in range(rounds):
        for n, batch in batches.items():
            model.forward(batch, cache)  # warm-up
            seconds: dict[str, float] = defaultdict(float)
            with timed_kernels(seconds):
                start = time.perf_counter()
                for _ in range(forwards):
                    model.forward(batch, cache)
                total = (time.perf_counter() - start) / forwards
            totals[n].append(total)
            for part, value in seconds.items():
                parts[part][n].append(value / forwards)
            parts[REST][n].append(total - sum(seconds.values()) / forwards)
    return ForwardBreakdown(
        total={n: statistics.median(values) for n, values in totals.items()},
        parts={part: {n: statistics.median(by_rows.get(n, [0.0])) for n in rows} for part, by_rows in parts.items()},
    )


def format_breakdown(result: ForwardBreakdown, rows: Sequence[int]) -> str:
    head = "| part | " + " | ".join(f"n = {n}, ms" for n in rows) + f" | n = {rows[-1]} − n = {rows[0]} |"
    lines = [head, "|---" * (len(rows) + 2) + "|"]

    def line(label: str, values: dict[int, float]) -> str:
        cells = " | ".join(f"{1e3 * values[n]:.3f}" for n in rows)
        return f"| {label} | {cells} | {1e3 * (values[rows[-1]] - values[rows[0]]):+.3f} |"

    lines.append(line("whole forward", result.total))
    ordered = sorted((p for p in result.parts if p != REST), key=lambda p: -result.parts[p][rows[-1]])
    lines += [line(part, result.parts[part]) for part in ordered + [REST]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rows", default="1,8", help="row counts, comma-separated (the first is the reference)")
    parser.add_argument("--forwards", type=int, default=30, help="forwards per row count and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weight-format", default="auto", help="the target's weight format (models/layers.py)")
    args = parser.parse_args(argv)
    from specdec.llm import LLM

    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    if not rows or min(rows) < 1:
        parser.error(f"--rows must list row counts >= 1, got {args.rows!r}")
    llm = LLM(model=args.model, max_model_len=args.context + max(rows) + 16, max_num_seqs=1,
              weight_format=args.weight_format)
    slot = llm.engine.cache.allocate()
    result = forward_breakdown(llm.model, llm.engine.cache, slot, args.context, rows, args.forwards, args.rounds)
    print(f"{args.model} ({args.weight_format}): {args.context} cached tokens, {args.threads} threads, medians of "
          f"{args.rounds} rounds")
    print(format_breakdown(result, rows))


if __name__ == "__main__":
    main()
