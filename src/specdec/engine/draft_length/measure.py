"""Measuring what a model's forwards cost on this machine: T(n) and the context costs within a wall-clock budget
(`profile_costs`, on a real model `measure_cost_profile`), the forward timings of the benchmarks (`forward_seconds`)
and the memory read bandwidth (`read_bandwidth_gbs`). The arithmetic over the timings is in `costs`; where the
profiles are kept, in `profile_store`.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence as SequenceOf

import torch

from specdec.engine.draft_length.costs import CostSamples, RowSamples

PROFILE_BUDGET_S = 8.0  # wall-clock cap of the profile measured at a model's first use on a machine
# row counts timed, most useful first: a round times them in this order while the budget allows
PROFILE_ROW_COUNTS = (1, 2, 4, 8, 16, 32, 3, 6, 12, 24)
CONTEXT_PROFILE_ROWS = (1, 2, 4, 8, 16, 32, 12, 24)  # the same at the long context (the rest interpolated)
PAST_KNEE_RATIO = 3.0  # once T(m) > 3 T(1), no count above m is timed: the policy never verifies that many rows
CONTEXT_SHARE = 0.35  # of the budget, for the context costs
MIN_PAIRS = 2  # a count timed fewer times is timed again by a later start (one pair on a busy machine can be far off)
CONTINUE_BUDGET_SHARE = 0.5  # a later start continuing an incomplete profile spends at most this share of the budget
MAX_IDLE_CONTINUATIONS = 2  # after this many continuing starts that timed nothing new, a profile is left as it is


@dataclass(frozen=True)
class ProfileRun:
    """What `profile_costs` measured and what it took."""

    samples: CostSamples  # the profile: what this run timed, merged into what was known before it
    seconds: float  # wall time, warm-up included
    rounds: int  # rounds that timed at least one row count (after base_context)
    forward_timed: tuple[int, ...]  # row counts timed by this run (after base_context)
    context_timed: tuple[int, ...]  # row counts whose context costs this run measured

    def summary(self) -> str:
        rounds = f"{self.rounds} round{'s' * (self.rounds != 1)}"
        line = f"T(n) at n = {', '.join(map(str, self.forward_timed))} ({rounds})" if self.forward_timed else \
            "nothing timed after the warm-up"
        if self.context_timed:
            line += f", context costs at n = {', '.join(map(str, self.context_timed))}"
        return line


def untimed_row_counts(samples: CostSamples, row_counts: SequenceOf[int] = PROFILE_ROW_COUNTS) -> list[int]:
    """The row counts a profile still wants timed: not timed yet, or fewer than MIN_PAIRS times, and not past its
    knee (PAST_KNEE_RATIO)."""
    ratios, counts = samples.forward.values, samples.forward.counts
    return [n for n in row_counts if counts.get(n, 0) < MIN_PAIRS and not _past_knee(n, ratios)]


def _untimed_context_counts(samples: CostSamples, row_counts: SequenceOf[int] = CONTEXT_PROFILE_ROWS) -> list[int]:
    """The same for the context costs: of the counts with T(n) timed, those with fewer than MIN_PAIRS pairs."""
    counts = {} if samples.context is None else samples.context.counts
    return [n for n in row_counts if n in samples.forward.values and counts.get(n, 0) < MIN_PAIRS]


def _past_knee(n: int, values: dict[int, float]) -> bool:
    """Whether some count m < n costs more than PAST_KNEE_RATIO · T(1) (values: T(m) or T(m) / T(1), by m)."""
    return 1 in values and any(m < n and value > PAST_KNEE_RATIO * values[1] for m, value in values.items())


def profile_costs(
    time_forward: Callable[[int, int], float],
    budget_s: float = PROFILE_BUDGET_S,
    clock: Callable[[], float] = time.perf_counter,
    base_context: int = 128,
    long_context: int | None = 1024,
    row_counts: SequenceOf[int] = PROFILE_ROW_COUNTS,
    context_row_counts: SequenceOf[int] = CONTEXT_PROFILE_ROWS,
    repeats: int = 5,
    context_repeats: int = 3,
    context_share: float = CONTEXT_SHARE,
    known: CostSamples | None = None,
) -> ProfileRun:
    """T(n) at a few row counts and what a long context adds, within a wall-clock budget.

    time_forward(rows, context): seconds of one target forward of `rows` new rows of one sequence after `context`
    cached tokens (measured, or synthetic in tests, with `clock` the matching clock).

    After one warm-up forward, each of `repeats` rounds walks row_counts and times n rows right after one row:
    T(n) = median T(1) · median of the paired ratios T(n) / T(1) (a slow spell of the machine scales both sides of a
    ratio instead of bending the curve). A pair is timed only if what it is expected to cost still fits the budget
    (1 - context_share of it; the context costs get the rest): T(1) + T(m) · n / m from the largest count m <= n
    timed so far, an upper bound where rows never cost more than the average of fewer rows. A slow machine (the
    scalar kernels: T(n) ≈ n · T(1)) so times fewer counts in fewer rounds; and no count above one costing
    PAST_KNEE_RATIO · T(1) is timed, as no step verifies so many rows. Then, with what is left of the budget, the
    same at long_context tokens for the counts timed (`context_repeats` rounds): the context cost per token is
    (T_long(n) − T(n)) / (long_context − base_context) (none when nothing fitted, or long_context is None).

    known: a profile measured before (by an earlier process, whose budget ran out): only the counts it lacks or
    timed fewer than MIN_PAIRS times are timed; the new ratios to T(1) join its own (means weighted by the pairs).
    """
    start = clock()
    if known is not None and known.base_context != base_context:
        known = None
    forward_budget = budget_s * (1 - context_share) if long_context else budget_s
    one_row_s, one_row_count, forward, rounds, forward_timed = _profile_forward(
        time_forward, base_context, row_counts, repeats, known, start, forward_budget, clock)
    context, context_timed = known.context if known else None, ()
    if long_context is not None and long_context > base_context:
        context, context_timed = _profile_context(time_forward, one_row_s, forward, context, base_context, long_context,
                                                  context_row_counts, context_repeats, start, budget_s, clock)
    idle = 0
    if known is not None:  # T(1) timed now only set this run's level; the profile's is the long-run one
        one_row_s, one_row_count = known.one_row_s, known.one_row_count
        idle = 0 if context_timed or any(n != 1 for n in forward_timed) else known.idle_continuations + 1
    samples = CostSamples(one_row_s, forward, context, base_context, one_row_count, idle)
    return ProfileRun(samples, clock() - start, rounds, forward_timed, context_timed)


def _profile_forward(time_forward, base_context: int, row_counts: SequenceOf[int], repeats: int,
                     known: CostSamples | None, start: float, budget_s: float, clock):
    """profile_costs' first part: (T(1) timed now, the pairs behind it, the ratios T(n) / T(1) known before or timed
    now, rounds, the counts timed now)."""
    warm_up = time_forward(1, base_context)  # also T(1)'s first upper bound (a first forward may cost more)
    # the ratios known before this run, and the counts to time (in a continuation, T(1) is timed in each pair, for
    # this run's level; alone only if nothing else is left, for the context costs)
    before, counts = ({1: 1.0}, list(row_counts)) if known is None else \
        (known.forward.values, [n for n in untimed_row_counts(known, row_counts) if n != 1] or [1])

    def bound(n: int, timed: dict[int, float]) -> float:
        one_row_s = timed.get(1, warm_up)
        values = {**{m: ratio * one_row_s for m, ratio in before.items()}, **timed}
        if _past_knee(n, values):
            return float("inf")
        largest = max(m for m in values if m <= n)
        return values[largest] * n / largest

    timed, rounds = _timed_rounds(time_forward, base_context, counts, repeats, bound, start, budget_s, clock)
    if not timed.values and known is not None:  # no count fitted: this run's level from T(1) alone, if it fits
        timed, _ = _timed_rounds(time_forward, base_context, [1], 3, bound, start, budget_s, clock)
    timed_counts = tuple(sorted(timed.values))
    if not timed.values:  # the warm-up alone took the budget: it is all there is
        timed = RowSamples({1: warm_up}, {1: 1})
    one_row_s = timed.values[1]
    ratios = RowSamples({n: seconds / one_row_s for n, seconds in timed.values.items()}, dict(timed.counts))
    forward = ratios if known is None else _merged(known.forward, ratios)
    return one_row_s, timed.counts[1], forward, rounds, timed_counts


def _profile_context(time_forward, one_row_s: float, forward: RowSamples, context: RowSamples | None,
                     base_context: int, long_context: int, row_counts: SequenceOf[int], repeats: int, start: float,
                     budget_s: float, clock) -> tuple[RowSamples | None, tuple[int, ...]]:
    """profile_costs' second part: the context cost samples (those known before, plus the row counts of T(n) they
    lack) and the counts timed now. one_row_s: T(1) at the base context, timed now; forward: T(n) / T(1)."""
    wanted = _untimed_context_counts(CostSamples(one_row_s, forward, context), row_counts)
    at_base = [ratio * one_row_s for ratio in forward.curve()]  # T(n) at the base context, at this run's level

    def bound(n: int, timed: dict[int, float]) -> float:
        if 1 not in timed:
            return 2.0 * at_base[n - 1]  # a guess: the long context doubles a forward
        # what the context adds to one row, for each of the n rows; or the largest count timed, scaled
        per_rows = at_base[n - 1] + n * max(0.0, timed[1] - at_base[0])
        largest = max(m for m in timed if m <= n)
        return max(per_rows, timed[largest] * n / largest) if largest > 1 else per_rows

    timed, _ = _timed_rounds(time_forward, long_context, wanted, repeats, bound, start, budget_s, clock)
    extra = (long_context - base_context) * one_row_s
    ratios = {n: max(0.0, (seconds - forward.values[n] * one_row_s) / extra)
              for n, seconds in timed.values.items() if n in wanted}
    if ratios:
        context = _merged(context, RowSamples(ratios, {n: timed.counts[n] for n in ratios}))
    return context, tuple(sorted(ratios))


def _merged(known: RowSamples | None, timed: RowSamples) -> RowSamples:
    """The known samples and the timed ones: by row count, their mean weighted by the measurements behind each."""
    values, counts = (dict(known.values), dict(known.counts)) if known is not None else ({}, {})
    for n, value in timed.values.items():
        before, weight = values.get(n, 0.0), counts.get(n, 0)
        counts[n] = weight + timed.counts[n]
        values[n] = (before * weight + value * timed.counts[n]) / counts[n]
    return RowSamples(values, counts, known.max_rows if known is not None else timed.max_rows)


def _timed_rounds(time_forward, context: int, row_counts: SequenceOf[int], repeats: int,
                  bound: Callable[[int, dict[int, float]], float], start: float, budget_s: float,
                  clock) -> tuple[RowSamples, int]:
    """T(n) at `context` cached tokens from paired rounds (see profile_costs) while they fit budget_s since start,
    with the number of pairs behind each value, and the number of rounds that timed anything. bound(n, timed): an
    upper bound of T(n) given the {n: T(n)} this call has timed so far (inf: not to be timed)."""
    one_row: list[float] = []
    ratios: dict[int, list[float]] = {}

    def timed() -> dict[int, float]:
        if not one_row:
            return {}
        one_row_s = statistics.median(one_row)
        return {1: one_row_s, **{n: one_row_s * statistics.median(r) for n, r in ratios.items()}}

    rounds = 0
    for _ in range(repeats if row_counts else 0):
        timed_in_round = False
        for n in row_counts:
            so_far = timed()
            if clock() - start + bound(1, so_far) + (bound(n, so_far) if n > 1 else 0.0) > budget_s:
                continue
            one_row_s = time_forward(1, context)
            one_row.append(one_row_s)
            if n > 1:
                ratios.setdefault(n, []).append(time_forward(n, context) / one_row_s)
            timed_in_round = True
        if not timed_in_round:
            break
        rounds += 1
    values = timed()
    return RowSamples(values, {n: len(ratios[n]) if n > 1 else len(one_row) for n in values}), rounds


class _ForwardTimer:
    """time_forward for `profile_costs` on a real model: one sequence in a cache whose keys and values up to
    max_context are random numbers. A forward's cost does not depend on the values it attends to, so no prefill is
    needed — on a machine running the scalar kernels a 1024-token prefill alone would take minutes."""

    def __init__(self, model, max_context: int, max_rows: int) -> None:
        from specdec.cache.kv_cache import KVCache

        self.model = model
        self.cache = KVCache(model.shard_config, 1, max_context + max_rows + 1, model.device,
                             dtype=model.kv_cache_dtype)  # this rank's heads under tensor parallelism
        generator = torch.Generator(device=self.cache.keys[0].device).manual_seed(0)
        for entries in self.cache.keys + self.cache.values:  # each [1, kv_heads, positions, head_dim]
            entries[:, :, :max_context].normal_(generator=generator)
        token_generator = torch.Generator().manual_seed(0)
        self.token_ids = torch.randint(0, model.config.vocab_size, (max_rows,), generator=token_generator).tolist()
        self.batches: dict[tuple[int, int], object] = {}

    def __call__(self, rows: int, context: int) -> float:
        from specdec.models.batch import ForwardBatch

        batch = self.batches.get((rows, context))
        if batch is None:
            batch = self.batches[rows, context] = ForwardBatch.build([self.token_ids[:rows]], [context], [0],
                                                                     all_logits=True, device=self.model.device)
        return _timed_forward(self.model, batch, self.cache)


def measure_cost_profile(model, budget_s: float = PROFILE_BUDGET_S, row_counts: SequenceOf[int] = PROFILE_ROW_COUNTS,
                         repeats: int = 5, base_context: int = 128, known: CostSamples | None = None) -> ProfileRun:
    """`profile_costs` on a specdec Transformer: T(n) after base_context cached tokens, and the context costs up to
    1024 tokens (fewer when the model's context is shorter; none below base_context + 128). Rows of one sequence
    stand for the rows of a batch: the weights are streamed once per forward either way. known: see profile_costs."""
    long_context = long_context_for(model, max(row_counts), base_context)
    timer = _ForwardTimer(model, long_context or base_context, max(row_counts))
    return profile_costs(timer, budget_s, base_context=base_context, long_context=long_context, row_counts=row_counts,
                         repeats=repeats, known=known)


def long_context_for(model, max_rows: int, base_context: int) -> int | None:
    """The long context the context costs are timed at: 1024 tokens, fewer when the model's context is shorter;
    None below base_context + 128."""
    long_context = min(1024, model.config.max_position_embeddings - max_rows - 1)
    return long_context if long_context >= base_context + 128 else None


def has_count_to_continue(samples: CostSamples, long_context: int | None, budget_s: float) -> bool:
    """Whether a profile an earlier process left incomplete has a row count still to time that one pair of forwards
    (bounded from what it holds) fits the budget for: after the warm-up, the first T(1) and the T(1) of its pair (and
    one more, for a slower start), T(n) at the base context; or for a missing context cost, two such pairs at the
    long context, taken as twice as dear. Without such a count a start would spend its budget timing nothing new;
    and after MAX_IDLE_CONTINUATIONS starts that did anyway (the machine slower than the profile says), none does."""
    if samples.idle_continuations >= MAX_IDLE_CONTINUATIONS:
        return False
    curve = samples.profile().forward.seconds
    forward_budget = budget_s * (1 - CONTEXT_SHARE)
    if any(4 * curve[0] + curve[n - 1] <= forward_budget for n in untimed_row_counts(samples)):
        return True
    if long_context is None or samples.base_context >= long_context:
        return False
    return any(curve[0] + 4 * (curve[0] + curve[n - 1]) <= budget_s * CONTEXT_SHARE
               for n in _untimed_context_counts(samples))


def prefilled_row_batches(model, cache, slot: int, context: int, row_counts: SequenceOf[int], max_rows: int) -> dict:
    """Prefills `context` random token ids (seed 0; max_rows more drawn after them) into `slot` and returns, per n in
    row_counts, the batch of the next n of them: {n: ForwardBatch}, every logit row wanted."""
    from specdec.models.batch import ForwardBatch

    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (context + max_rows,), generator=generator).tolist()
    model.forward(ForwardBatch.build([prompt[:context]], [0], [slot], all_logits=False, device=model.device), cache)
    return {rows: ForwardBatch.build([prompt[context : context + rows]], [context], [slot], all_logits=True,
                                     device=model.device) for rows in row_counts}


def forward_seconds(model, cache, slot: int, context: int, max_rows: int, repeats: int,
                    row_counts: SequenceOf[int] | None = None) -> list[float]:
    """Seconds of one forward of n new tokens of one sequence after `context` cached tokens (random token ids,
    prefilled into `slot` first), n = 1..max_rows (or n in row_counts, each <= max_rows).

    Each of `repeats` rounds walks the row counts and times a forward of 1 row right before each forward of n
    rows: T(n) = median T(1) · median of the paired ratios T(n) / T(1). A slow spell of the machine (another
    process on the cores) then scales both sides of a ratio instead of bending the curve — measured here, three
    unpaired rounds once put T(9) / T(1) at 1.88 against 1.47 idle, and the policy planned shorter drafts with it.
    """
    row_counts = list(row_counts or range(1, max_rows + 1))
    by_rows = prefilled_row_batches(model, cache, slot, context, sorted({1, *row_counts}), max_rows)
    batches = [by_rows[rows] for rows in row_counts]
    one_row_batch = by_rows[1]
    for batch in batches:
        model.forward(batch, cache)  # warm-up
    one_row_times: list[float] = []
    ratios: list[list[float]] = [[] for _ in batches]
    for _ in range(repeats):
        for batch, batch_ratios in zip(batches, ratios):
            one_row = _timed_forward(model, one_row_batch, cache)
            one_row_times.append(one_row)
            batch_ratios.append(_timed_forward(model, batch, cache) / one_row)
    one_row_s = statistics.median(one_row_times)
    return [one_row_s * statistics.median(batch_ratios) for batch_ratios in ratios]


def _timed_forward(model, batch, cache) -> float:
    _sync(model.device)
    start = time.perf_counter()
    model.forward(batch, cache)
    _sync(model.device)
    return time.perf_counter() - start


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def read_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """Memory read bandwidth: one pass over a large fp32 buffer as the matrix of a matrix-vector product
    ([rows, 4096] · [4096]: one multiply-add per 4 bytes read, no writes but the short result), fastest of
    `repeats`. A reduction such as the buffer's max is not memory-bound on every CPU: on a two-core Xeon it read
    15–16 GB/s (sum 18–19) where this product read 24–25."""
    matrix = torch.ones(megabytes * 2**20 // (4 * 4096), 4096, dtype=torch.float32)
    vector = torch.ones(4096, dtype=torch.float32)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mv(matrix, vector)
        times.append(time.perf_counter() - start)
    return matrix.numel() * 4 / min(times) / 1e9

