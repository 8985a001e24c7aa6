"""What one speculative step costs on this machine, and how many tokens per second a draft length buys.

Glossary (see docs/draft-length.md for the derivations):
  T(n)      seconds of one target forward over n new token rows in total (all sequences of the step together,
            each row attending to its sequence's cache), n = 1..32. At a model's first use on a machine a few row
            counts are timed within a wall-clock budget (`profile_costs`, PROFILE_BUDGET_S), the others bounded
            from them (`RowSamples.curve`); then every timed engine step refines it (`ProfileLearner`).
  α_i       conditional acceptance at draft position i: P(draft token i accepted | tokens 0..i-1 accepted).
  E(k)      expected tokens emitted by one verify step of k draft tokens, including the recovered/bonus token:
            E(k) = sum_{i=0..k} prod_{j<i} α_j;  with a constant α this is (1 - α^(k+1)) / (1 - α).
  knee      the most rows one step may verify: the largest n <= 32 with T(n) <= knee_ratio · T(1)
            (default 2: a step never costs more than two plain decode steps).
  speed     a step of B sequences with draft lengths k_b emits sum_b E_b(k_b) tokens in
            T(B + sum_b k_b) + draft_cost(k_1..k_B) seconds.

Profiles are cached as JSON under ``$XDG_CACHE_HOME/specdec/costs/`` (``~/.cache/specdec/costs``), one file per
(model identity, weight format, thread count, machine, kernel build) — see `ProfileKey` — and re-saved as the
engine's steps refine them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence as SequenceOf

import torch

MAX_PROFILE_ROWS = 32


def expected_accepted_length(k: int, alpha_per_position: float | SequenceOf[float]) -> float:
    """E(k) = sum_{i=0..k} prod_{j<i} α_j: tokens per verify step (the i = 0 term is the recovered/bonus token).

    A float α means every position has it; a list shorter than k repeats its last entry.
    """
    alphas = _alphas(alpha_per_position, k)
    total, reach = 1.0, 1.0
    for alpha in alphas:
        reach *= alpha
        total += reach
    return total


def _alphas(alpha_per_position: float | SequenceOf[float], k: int) -> list[float]:
    if isinstance(alpha_per_position, (int, float)):
        return [float(alpha_per_position)] * k
    alphas = [float(a) for a in alpha_per_position][:k]
    if len(alphas) < k:
        if not alphas:
            raise ValueError("alpha_per_position is empty")
        alphas += [alphas[-1]] * (k - len(alphas))
    return alphas


@dataclass(frozen=True)
class ForwardCosts:
    """T(n) for n = 1..len(seconds): seconds[n - 1] is one target forward of n new token rows."""

    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.seconds or any(not s > 0 for s in self.seconds):
            raise ValueError(f"ForwardCosts needs positive times for n = 1..N, got {self.seconds}")

    @classmethod
    def from_ratios(cls, t1_s: float, ratios: SequenceOf[float]) -> ForwardCosts:
        """ratios[n - 1] = T(n) / T(1)."""
        return cls(tuple(t1_s * r for r in ratios))

    @classmethod
    def linear(cls, t1_s: float, slope: float, max_rows: int = MAX_PROFILE_ROWS) -> ForwardCosts:
        """Synthetic T(n) = T(1) · (1 + slope · (n - 1)) (tests, and the no-profile fallback)."""
        return cls.from_ratios(t1_s, [1 + slope * (n - 1) for n in range(1, max_rows + 1)])

    @property
    def max_rows(self) -> int:
        return len(self.seconds)

    def __call__(self, rows: int) -> float:
        """T(rows); beyond the measured range it grows linearly with the last measured slope."""
        if rows < 1:
            raise ValueError(f"a forward has at least one row, got {rows}")
        if rows <= self.max_rows:
            return self.seconds[rows - 1]
        last = self.seconds[-1]
        slope = max(last - self.seconds[-2], last / self.max_rows) if self.max_rows > 1 else last
        return last + slope * (rows - self.max_rows)

    def knee(self, knee_ratio: float = 2.0) -> int:
        """Largest n of the curve with T(n) <= knee_ratio · T(1) (at least 1)."""
        limit = knee_ratio * self.seconds[0]
        return max([n for n in range(1, self.max_rows + 1) if self.seconds[n - 1] <= limit] or [1])


@dataclass(frozen=True)
class ContextCosts:
    """What a sequence's cached context adds to a forward beyond the profile's `base_context`: per_token_s[n - 1]
    seconds per context token for a sequence with n rows in the forward (its attention reads the keys/values once
    and, for each of its rows, does arithmetic over them — NVIDIA's "decode-attention intensity grows with D").
    Measured as (T(n) after long_context tokens − T(n) after base_context tokens) / (long_context − base_context).
    """

    base_context: int
    per_token_s: tuple[float, ...]  # [n - 1], n = 1..len

    def __post_init__(self) -> None:
        if not self.per_token_s or any(s < 0 for s in self.per_token_s) or self.base_context < 0:
            raise ValueError(f"ContextCosts needs per-token seconds >= 0 for n = 1..N, got {self.per_token_s}")

    def __call__(self, rows: int, context: int) -> float:
        """Extra seconds of a sequence with `rows` rows after `context` cached tokens (0 up to base_context);
        beyond the measured rows, growing linearly with the last measured slope."""
        extra_tokens = context - self.base_context
        if extra_tokens <= 0:
            return 0.0
        n = len(self.per_token_s)
        if rows <= n:
            per_token = self.per_token_s[rows - 1]
        else:
            slope = self.per_token_s[-1] - self.per_token_s[-2] if n > 1 else 0.0
            per_token = self.per_token_s[-1] + max(0.0, slope) * (rows - n)
        return extra_tokens * per_token

    def scaled(self, factor: float) -> ContextCosts:
        return ContextCosts(self.base_context, tuple(s * factor for s in self.per_token_s))


@dataclass
class RowSamples:
    """Measured values by row count n = 1..max_rows (seconds of a forward, or a context cost per token), each with
    how many measurements back it; the values at the other row counts follow from them (`curve`).

    `observe` folds a new measurement in: a running mean over the first ones, then an EMA of weight `weight_floor`
    (so a value measured thousands of times still follows a lasting change), each measurement clipped to
    [1 / max_jump, max_jump] times the current value. A row count never measured starts from the curve's value
    there, counted as one measurement: being an upper bound (see `curve`), it makes the first measurements move it
    half way, not all the way, down.
    """

    values: dict[int, float] = field(default_factory=dict)  # {n: value}, only the measured row counts
    counts: dict[int, int] = field(default_factory=dict)  # {n: measurements folded in}
    max_rows: int = MAX_PROFILE_ROWS

    def __post_init__(self) -> None:
        if any(not 1 <= n <= self.max_rows or v < 0 for n, v in self.values.items()) or self.values.keys() != self.counts.keys():
            raise ValueError(f"RowSamples needs values >= 0 at row counts 1..{self.max_rows} with counts, got {self.values}")

    def curve(self) -> tuple[float, ...]:
        """Values for n = 1..max_rows, never below what was measured at fewer rows (more rows never cost less):
        the measured values made non-decreasing (running maximum), interpolated linearly between measured row counts,
        the smallest measured count's value below it, and beyond the largest measured count m, value(m) · n / m —
        the rows there costing what the measured ones cost on average, no further economy assumed (an upper bound
        wherever the per-row cost does not grow with the rows)."""
        if not self.values:
            raise ValueError("no row count measured")
        points, highest = [], 0.0
        for n in sorted(self.values):
            highest = max(highest, self.values[n])
            points.append((n, highest))
        curve = []
        for n in range(1, self.max_rows + 1):
            upper = next((i for i, (m, _) in enumerate(points) if m >= n), None)
            if upper is None:
                last_n, last = points[-1]
                curve.append(last * n / last_n)
            elif upper == 0 or points[upper][0] == n:
                curve.append(points[upper][1])
            else:
                (low_n, low), (high_n, high) = points[upper - 1], points[upper]
                curve.append(low + (high - low) * (n - low_n) / (high_n - low_n))
        return tuple(curve)

    def observe(self, rows: int, value: float, weight_floor: float = 1 / 32, max_jump: float = 3.0) -> None:
        if not 1 <= rows <= self.max_rows or not value >= 0:
            return
        if rows in self.values:
            current, count = self.values[rows], self.counts[rows]
        elif self.values:
            current, count = self.curve()[rows - 1], 1
        else:
            current, count = value, 0
        self.values[rows] = folded(current, count, value, weight_floor, max_jump)
        self.counts[rows] = count + 1

    def to_json(self) -> dict:
        return {str(n): [self.values[n], self.counts[n]] for n in sorted(self.values)}

    @classmethod
    def from_json(cls, payload: dict, max_rows: int = MAX_PROFILE_ROWS) -> RowSamples:
        return cls({int(n): float(v) for n, (v, _) in payload.items()}, {int(n): int(c) for n, (_, c) in payload.items()},
                   max_rows)


def folded(current: float, count: int, value: float, weight_floor: float = 1 / 32, max_jump: float = 3.0) -> float:
    """current (the mean of `count` measurements) with one more: a running mean while 1 / (count + 1) exceeds
    weight_floor, then an EMA of that weight; the new value clipped to [1 / max_jump, max_jump] times current."""
    if current > 0:
        value = min(max(value, current / max_jump), current * max_jump)
    return current + max(weight_floor, 1 / (count + 1)) * (value - current)


@dataclass
class CostSamples:
    """What was measured of a model's costs on this machine, from which its `CostProfile` follows; the engine's timed
    steps keep refining it (`ProfileLearner`).

    The shape of the costs is kept apart from their level: a count timed while another process held the cores,
    next to T(1) refined later on an idle machine, would otherwise bend the curve for good (measured: T(2) timed at
    738 ms in a compile's slow spell, T(1) then learned at 100 ms, and the policy never drafted again).

    one_row_s: T(1) after `base_context` cached tokens, seconds (one_row_count measurements behind it).
    forward: T(n) / T(1) at the row counts measured (1 at n = 1): measured in pairs with T(1) (`profile_costs`), or
        against the level of the moment (`ProfileLearner`).
    context: seconds per context token beyond base_context for a sequence with n rows (see ContextCosts), over T(1),
        at the row counts measured; None when not measured (the model's context is short, or the budget ran out).
    """

    one_row_s: float
    forward: RowSamples
    context: RowSamples | None = None
    base_context: int = 128
    one_row_count: int = 1
    idle_continuations: int = 0  # later starts in a row that continued the profile and timed nothing new

    def __post_init__(self) -> None:
        if not self.one_row_s > 0 or self.forward.values.get(1) != 1.0:
            raise ValueError(f"CostSamples needs T(1) > 0 and ratios with 1 at n = 1, got {self.one_row_s}, "
                             f"{self.forward.values}")

    def profile(self) -> CostProfile:
        one_row_s = self.one_row_s
        context = None if self.context is None else \
            ContextCosts(self.base_context, tuple(one_row_s * ratio for ratio in self.context.curve()))
        return CostProfile(ForwardCosts(tuple(one_row_s * ratio for ratio in self.forward.curve())), context, self)

    def to_json(self) -> dict:
        return {"base_context": self.base_context, "one_row_s": [self.one_row_s, self.one_row_count],
                "forward_ratios": self.forward.to_json(),
                "context_ratios": None if self.context is None else self.context.to_json(),
                "idle_continuations": self.idle_continuations}

    @classmethod
    def from_json(cls, payload: dict) -> CostSamples:
        context = payload.get("context_ratios")
        one_row_s, count = payload["one_row_s"]
        return cls(float(one_row_s), RowSamples.from_json(payload["forward_ratios"]),
                   None if context is None else RowSamples.from_json(context), int(payload["base_context"]), int(count),
                   int(payload.get("idle_continuations", 0)))


@dataclass(frozen=True)
class CostProfile:
    """A model's costs on this machine: T(n) after a short context, and what longer contexts add; `samples`: the
    measurements they follow from (None for a profile given whole, e.g. a synthetic one)."""

    forward: ForwardCosts
    context: ContextCosts | None = None
    samples: CostSamples | None = field(default=None, compare=False)


@dataclass(frozen=True)
class DrafterCost:
    """Seconds the drafter spends per step.

    per_token_s: per proposed token. ngram/suffix: measured ≈ 0 (a dictionary / trie lookup per sequence).
        draft model: its own T(1) — one draft forward per draft position, batched over the sequences.
    per_step_s: once per step that drafts at all (the draft model's catch-up forward of the committed tokens).
    batched: True when the sequences' tokens at one position share one forward (draft model): the step then
        costs max(k) · per_token_s; False (lookup drafters): sum(k) · per_token_s.
    catch_up_per_token_s: per committed token a drafter must ingest before it can draft for a request, beyond
        what a request drafting every step feeds (`Drafter.catch_up_tokens`): a draft model's prefill of the
        prompt at a request's first draft, and of every token since when it drafts again after k = 0. Paid once,
        so it is weighed against the request's remaining tokens, not against one step.
    """

    per_token_s: float = 0.0
    per_step_s: float = 0.0
    batched: bool = False
    catch_up_per_token_s: float = 0.0

    def __call__(self, draft_lengths: SequenceOf[int]) -> float:
        if not any(draft_lengths):
            return 0.0
        tokens = max(draft_lengths) if self.batched else sum(draft_lengths)
        return self.per_step_s + self.per_token_s * tokens


@dataclass(frozen=True)
class CostModel:
    """Target forward costs T(n) + drafter costs -> expected tokens per second of a step."""

    forward: ForwardCosts
    drafter: DrafterCost = field(default_factory=DrafterCost)
    knee_ratio: float = 2.0
    context: ContextCosts | None = None  # None: T(n) whatever the sequences' contexts

    @classmethod
    def fallback(cls, max_verify_tokens: int = 32, drafter: DrafterCost | None = None) -> CostModel:
        """No profile: a nearly flat T (2 % per extra row) whose knee is max_verify_tokens — the same row budget
        as `BatchDraftPolicy`; the small slope makes drafts that never hit not worth their rows."""
        forward = ForwardCosts.linear(1.0, 0.02, max(1, max_verify_tokens))
        return cls(forward, drafter or DrafterCost(), knee_ratio=float("inf"))

    @property
    def max_rows(self) -> int:
        """The knee: most token rows one step verifies."""
        return self.forward.knee(self.knee_ratio)

    def target_seconds(self, rows: int, draft_lengths: SequenceOf[int], contexts: SequenceOf[int] | None = None) -> float:
        """The target forward of a step: T(rows), plus each sequence's context cost for its k + 1 rows when
        contexts (cached tokens per sequence of draft_lengths) are given."""
        seconds = self.forward(rows)
        if self.context is not None and contexts:
            seconds += sum(self.context(k + 1, context) for k, context in zip(draft_lengths, contexts))
        return seconds

    def step_seconds(self, draft_lengths: SequenceOf[int], batch_size: int, contexts: SequenceOf[int] | None = None) -> float:
        """batch_size counts every sequence in the step (speculating or not); contexts: see target_seconds."""
        return self.target_seconds(batch_size + sum(draft_lengths), draft_lengths, contexts) + self.drafter(draft_lengths)

    def expected_tokens_per_s(self, k: int, alpha_per_position: float | SequenceOf[float], batch: int = 1) -> float:
        """B sequences all drafting k with the same α: B · E(k) / (T(B · (k + 1)) + draft_cost(k, B))."""
        lengths = [k] * batch
        return batch * expected_accepted_length(k, alpha_per_position) / self.step_seconds(lengths, batch)

    def best_k(self, alpha_per_position: float | SequenceOf[float], batch: int = 1, max_k: int = 16) -> int:
        """The draft length maximising `expected_tokens_per_s` for B identical sequences within the knee."""
        return self.allocate([alpha_per_position] * batch, batch, max_k)[0] if batch else 0

    def allocate(self, alphas: SequenceOf[float | SequenceOf[float]], batch_size: int, max_k: int | SequenceOf[int],
                 max_rows: int | None = None, contexts: SequenceOf[int] | None = None) -> list[int]:
        """Draft length per speculating sequence maximising the step's expected tokens per second.

        For a fixed total of draft rows R, sum_b E_b is largest when each next row goes to the sequence whose
        next position adds most (prod_{j<=k_b} α_{b,j}; it shrinks as k_b grows, so greedy is optimal).
        Walking R = 0, 1, ... while batch_size + R stays within the knee (and max_rows), keep the R with the
        best speed (ties: fewer rows). contexts: cached tokens per speculating sequence (rows cost more at long
        contexts, see ContextCosts). Speed counts the tokens of the whole batch: each of the batch_size -
        len(alphas) other sequences (not speculating, or about to join) adds one token per step, so a draft must
        pay for its rows against the batch's rate, not only against its own sequence's.
        """
        row_limit = self.max_rows if max_rows is None else min(self.max_rows, max_rows)
        caps = [max_k] * len(alphas) if isinstance(max_k, int) else list(max_k)
        lengths, reach = [0] * len(alphas), [1.0] * len(alphas)
        tables = [_alphas(a, cap) for a, cap in zip(alphas, caps)]
        tokens = float(max(batch_size, len(alphas)))
        best, best_speed = list(lengths), tokens / self.step_seconds(lengths, batch_size, contexts)
        while batch_size + sum(lengths) < row_limit:
            gains = [reach[b] * tables[b][lengths[b]] if lengths[b] < caps[b] else -1.0 for b in range(len(alphas))]
            b = max(range(len(alphas)), key=gains.__getitem__, default=None)
            if b is None or gains[b] < 0:
                break
            lengths[b] += 1
            reach[b] = gains[b]
            tokens += gains[b]
            speed = tokens / self.step_seconds(lengths, batch_size, contexts)
            if speed > best_speed * (1 + 1e-9):
                best, best_speed = list(lengths), speed
        return best


    def tree_nodes(self, draft_lengths: SequenceOf[int], verified_nodes: SequenceOf[int], batch_size: int,
                   tokens: float, extra_worths: SequenceOf[SequenceOf[float]], contexts: SequenceOf[int] | None = None,
                   max_rows: int | None = None) -> list[int]:
        """How many of each sequence's extra tree nodes to verify, beyond the verified_nodes[b] it verifies anyway
        (its chain of draft_lengths[b], or a tree the drafter did not weigh).

        tokens: the step's expected tokens without extra nodes (the whole batch's). A node's worth is the drafter's estimate that it is
        accepted, i.e. the tokens it adds on average; a sequence's worths are in decreasing order (a node is worth
        no more than its parent). Nodes are added best first, over all sequences, while batch_size + rows stays
        within the knee (and max_rows); the count with the best expected tokens per second is kept (ties: fewer).
        The drafting is done, but its cost counts in the step's seconds as in `allocate`.
        """
        row_limit = self.max_rows if max_rows is None else min(self.max_rows, max_rows)
        extra = [0] * len(verified_nodes)

        def speed() -> float:
            nodes = [base + e for base, e in zip(verified_nodes, extra)]
            return tokens / (self.target_seconds(batch_size + sum(nodes), nodes, contexts) + self.drafter(draft_lengths))

        best, best_speed = list(extra), speed()
        offers = sorted(((worth, b, j) for b, worths in enumerate(extra_worths) for j, worth in enumerate(worths)),
                        key=lambda offer: (-offer[0], offer[1], offer[2]))
        for worth, b, _ in offers:
            if batch_size + sum(verified_nodes) + sum(extra) >= row_limit:
                break
            extra[b] += 1
            tokens += worth
            current = speed()
            if current > best_speed * (1 + 1e-9):
                best, best_speed = list(extra), current
        return best


@dataclass
class CostCalibration:
    """Corrects a CostModel with the costs the engine actually measures, step by step.

    The profile's T(n) gives the shape of the target's cost over row counts, but its level drifts (another
    process on the cores, a thermal state, a stale profile), and the drafter's cost is only estimated until a
    step is timed. Both matter only relative to each other: the best k depends on draft cost / target cost.
    So we keep exponential moving averages of
      target_scale = measured target seconds / T(rows)          (over every decode step)
      per_token_s  = measured drafter seconds / drafted tokens   (max k for a batched drafter, sum k otherwise)
    and plan with T'(n) = target_scale · T(n) and draft cost per_token_s per token.

    One step may cost far more than the usual: the first draft of a draft model also prefills the prompt in
    the draft model, a re-probe after k = 0 catches it up on many tokens, a page fault or a preempted thread
    stalls a forward. So each observation is clipped to `max_jump` times the current estimate before it is
    averaged: a lone outlier moves the estimate by at most weight · (max_jump − 1), while a real, lasting
    change still takes over within a few steps. The target's level is set by its first measured step (the
    fallback profile counts in units of T(1), so a prior of 1 would be off by the whole T(1)); the drafter's
    estimate is the profile's (for a draft model: its T(1) scaled by weight bytes) times the measured target
    scale until the drafter itself is measured, so the two stay in proportion from the first step on.

    Those costly steps measure the drafter's catch-up instead (`observe_catch_up`):
      catch_up_per_token_s = (drafter seconds − the steady drafting estimate) / catch-up tokens
    from steps that fed at least `min_catch_up_tokens` of them.
    """

    weight: float = 0.2  # EMA weight of one step
    max_jump: float = 3.0  # an observation counts at most this many times the current estimate
    min_catch_up_tokens: int = 8  # fewer say more about the step's noise than about the drafter's prefill
    target_scale: float | None = None
    draft_per_token_s: float | None = None
    catch_up_per_token_s: float | None = None

    def observe(self, base: CostModel, rows: int, draft_lengths: SequenceOf[int], draft_s: float | None,
                target_s: float, contexts: SequenceOf[int] | None = None) -> None:
        """draft_s None: the step's drafter time is not representative (the drafter estimate stays).
        contexts: cached tokens per sequence of draft_lengths (the model's context costs count them)."""
        if target_s > 0:
            measured = target_s / base.target_seconds(rows, draft_lengths, contexts)
            self.target_scale = measured if self.target_scale is None else self._average(self.target_scale, measured)
        drafted = (max(draft_lengths) if base.drafter.batched else sum(draft_lengths)) if draft_lengths else 0
        if drafted > 0 and draft_s is not None and draft_s >= 0:
            current = self.draft_per_token_s
            if current is None and base.drafter.per_token_s > 0:  # the profile's estimate, at the measured level
                current = base.drafter.per_token_s * (self.target_scale or 1.0)
            self.draft_per_token_s = draft_s / drafted if current is None else self._average(current, draft_s / drafted)

    def observe_catch_up(self, base: CostModel, draft_lengths: SequenceOf[int], draft_s: float,
                         catch_up_tokens: int) -> None:
        """A step whose drafter also caught up on catch_up_tokens committed tokens took draft_s seconds."""
        if catch_up_tokens < self.min_catch_up_tokens or draft_s < 0:
            return
        calibrated = self.apply(base).drafter
        measured = max(0.0, draft_s - calibrated(draft_lengths)) / catch_up_tokens
        current = self.catch_up_per_token_s
        if current is None and calibrated.catch_up_per_token_s > 0:
            current = calibrated.catch_up_per_token_s
        self.catch_up_per_token_s = measured if current is None else self._average(current, measured)

    def _average(self, current: float, value: float) -> float:
        return (1 - self.weight) * current + self.weight * min(value, self.max_jump * current)

    def apply(self, base: CostModel) -> CostModel:
        """The base model with measured levels (unchanged until something was measured)."""
        forward, context = base.forward, base.context
        if self.target_scale is not None:
            forward = ForwardCosts(tuple(seconds * self.target_scale for seconds in base.forward.seconds))
            context = None if context is None else context.scaled(self.target_scale)
        drafter = base.drafter
        if self.target_scale is not None:  # not measured yet: the profile's estimates at the measured level
            drafter = dataclasses.replace(drafter, per_token_s=drafter.per_token_s * self.target_scale,
                                          per_step_s=drafter.per_step_s * self.target_scale,
                                          catch_up_per_token_s=drafter.catch_up_per_token_s * self.target_scale)
        if self.draft_per_token_s is not None:
            drafter = dataclasses.replace(drafter, per_token_s=self.draft_per_token_s, per_step_s=0.0)
        if self.catch_up_per_token_s is not None:
            drafter = dataclasses.replace(drafter, catch_up_per_token_s=self.catch_up_per_token_s)
        return dataclasses.replace(base, forward=forward, drafter=drafter, context=context)


@dataclass
class ProfileLearner:
    """Refines a profile's T(n) with the target forwards the engine times, and keeps its cached file up to date.

    The profile measured at first use times a few row counts within a budget (`profile_costs`); the rest of T(n) is
    bounded from them (`RowSamples.curve`). Every decode step measures T at its row count n, less what its
    sequences' contexts add (`ContextCosts`); a step whose context part is over `max_context_share` of it says more
    about the context than about T(n), and is left out. A one-row step is folded into T(1), the level. A step of n
    rows is folded into T(n) / T(1), against the level of the moment: the median of the last `recent` one-row
    steps, if the latest of them is at most `level_horizon` steps old (otherwise the step is not learned from). So
    the profile's shape — measured in pairs with T(1) — is compared with T(1) measured at about the same time, and a
    slow spell of the machine moves the level, not the shape (measured: a profile timed in a compile's slow spell
    with T(1) then learned at an idle 100 ms left T(2) at 7x T(1), and the policy never drafted again). A count the
    policy reaches for the first time (the conservative bound is what lets it try one at all) replaces the bound by a
    measurement; the knee and the draft lengths follow. Each value is a running mean, then an EMA of weight
    `weight_floor` per step. Every `save_every` new measurements (at most every `min_save_interval_s`), the samples
    are written back under `key`, so the next process starts from them.

    Where the steps never verify one row (drafts that always hit), nothing tells the shape from the level: T(n) /
    T(1) stays as profiled, and the policy's calibration (`CostCalibration`) follows the level.
    """

    samples: CostSamples
    key: ProfileKey | None = None  # None: not saved
    weight_floor: float = 1 / 32
    max_jump: float = 3.0
    max_context_share: float = 0.5
    recent: int = 5
    level_horizon: int = 16
    save_every: int = 32
    min_save_interval_s: float = 2.0
    clock: Callable[[], float] = time.monotonic
    unsaved: int = 0
    last_save: float | None = None
    recent_one_row_s: list[float] = field(default_factory=list)  # the last `recent` one-row steps' seconds
    steps_since_one_row: int | None = None  # None: no one-row step yet

    def observe(self, rows: int, target_s: float, context_s: float = 0.0) -> bool:
        """A target forward of `rows` rows took target_s seconds, context_s of which the context costs account for.
        Returns whether T(n) changed."""
        if self.steps_since_one_row is not None:
            self.steps_since_one_row += 1
        if not target_s > 0 or not 0 <= context_s <= self.max_context_share * target_s:
            return False
        seconds, samples = target_s - context_s, self.samples
        if rows == 1:
            self.recent_one_row_s = [*self.recent_one_row_s[1 - self.recent:], seconds]
            self.steps_since_one_row = 0
            samples.one_row_s = folded(samples.one_row_s, samples.one_row_count, seconds, self.weight_floor,
                                       self.max_jump)
            samples.one_row_count += 1
        elif self.steps_since_one_row is not None and self.steps_since_one_row <= self.level_horizon:
            samples.forward.observe(rows, seconds / statistics.median(self.recent_one_row_s), self.weight_floor,
                                    self.max_jump)
        else:
            return False
        self.unsaved += 1
        return True

    def profile(self) -> CostProfile:
        return self.samples.profile()

    def save_if_due(self) -> Path | None:
        """Writes the samples back under key when save_every measurements are unsaved (and the last save is at least
        min_save_interval_s ago); an unwritable cache keeps them for this process."""
        now = self.clock()
        if (self.key is None or self.unsaved < self.save_every
                or (self.last_save is not None and now - self.last_save < self.min_save_interval_s)):
            return None
        self.unsaved, self.last_save = 0, now
        try:
            return save_profile(self.key, self.samples.profile())
        except OSError:
            return None


# ---- measuring and caching --------------------------------------------------------------------------------
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


def profile_costs(time_forward: Callable[[int, int], float], budget_s: float = PROFILE_BUDGET_S,
                  clock: Callable[[], float] = time.perf_counter, base_context: int = 128,
                  long_context: int | None = 1024, row_counts: SequenceOf[int] = PROFILE_ROW_COUNTS,
                  context_row_counts: SequenceOf[int] = CONTEXT_PROFILE_ROWS, repeats: int = 5,
                  context_repeats: int = 3, context_share: float = CONTEXT_SHARE, known: CostSamples | None = None) -> ProfileRun:
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
        self.cache = KVCache(model.config, 1, max_context + max_rows + 1, model.device, dtype=model.kv_cache_dtype)
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
    long_context = _long_context(model, max(row_counts), base_context)
    timer = _ForwardTimer(model, long_context or base_context, max(row_counts))
    return profile_costs(timer, budget_s, base_context=base_context, long_context=long_context, row_counts=row_counts,
                         repeats=repeats, known=known)


def _long_context(model, max_rows: int, base_context: int) -> int | None:
    long_context = min(1024, model.config.max_position_embeddings - max_rows - 1)
    return long_context if long_context >= base_context + 128 else None


def _worth_continuing(samples: CostSamples, long_context: int | None, budget_s: float) -> bool:
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


def machine_name(device: str | torch.device = "cpu") -> str:
    """The CPU model string (and the GPU's name when profiling on one)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_identity(name_or_path: str) -> str:
    """Catalogue models: name + the pinned sha256 of their file. Other paths: name + a fingerprint of
    (resolved path, size, mtime) of the file or the directory's files (hashing GBs at every start is too slow)."""
    from specdec.models.catalog import CATALOG

    if name_or_path in CATALOG:
        return f"{name_or_path}@sha256:{CATALOG[name_or_path].sha256}"
    path = Path(name_or_path).expanduser().resolve()
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        if file.is_file():
            stat = file.stat()
            digest.update(f"{file}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return f"{path.name}@files:{digest.hexdigest()[:16]}"


@dataclass(frozen=True)
class ProfileKey:
    model: str  # model_identity(...)
    weight_format: str
    threads: int
    machine: str
    kernels: str = "torch"  # kernels.ops.kernel_build_id(): a rebuilt kernel measures afresh
    protocol: int = 4  # how costs are measured (4: budgeted samples, learned online): a new one measures afresh

    @classmethod
    def current(cls, model_name_or_path: str, weight_format: str, device: str | torch.device = "cpu") -> ProfileKey:
        from specdec.kernels.ops import kernel_build_id

        return cls(model_identity(model_name_or_path), weight_format, torch.get_num_threads(), machine_name(device),
                   kernel_build_id())

    def filename(self) -> str:
        digest = hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", self.model.split("@")[0])[:60]
        return f"{stem}-{self.weight_format}-{self.threads}t-{digest}.json"


def costs_dir() -> Path:
    """``$XDG_CACHE_HOME/specdec/costs`` (``~/.cache/specdec/costs`` when unset)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "specdec" / "costs"


def save_profile(key: ProfileKey, profile: CostProfile, extra: dict | None = None) -> Path:
    """Writes the profile under key (atomically: a reader sees the old file or the new one). With samples, those
    are what a later load reads back; forward_s and context are their curves, for people and other tools."""
    path = costs_dir() / key.filename()
    path.parent.mkdir(parents=True, exist_ok=True)
    context = profile.context
    payload = {"key": dataclasses.asdict(key), "forward_s": list(profile.forward.seconds),
               "context": None if context is None else {"base_context": context.base_context,
                                                        "per_token_s": list(context.per_token_s)},
               "samples": None if profile.samples is None else profile.samples.to_json(),
               "saved_at": time.time(), **(extra or {})}
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(payload, indent=2))
    os.replace(partial, path)
    return path


def load_profile(key: ProfileKey) -> CostProfile | None:
    """The cached profile for exactly this key, or None (missing, unreadable or for another key)."""
    path = costs_dir() / key.filename()
    try:
        payload = json.loads(path.read_text())
        if payload["key"] != dataclasses.asdict(key):
            return None
        if payload.get("samples") is not None:
            return CostSamples.from_json(payload["samples"]).profile()
        context = payload.get("context")
        return CostProfile(ForwardCosts(tuple(float(s) for s in payload["forward_s"])),
                           None if context is None else ContextCosts(int(context["base_context"]),
                                                                     tuple(float(s) for s in context["per_token_s"])))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def load_or_measure(model, key: ProfileKey, budget_s: float = PROFILE_BUDGET_S) -> CostProfile:
    """The cached profile for key, else one measured now within budget_s (`measure_cost_profile`; one line on stderr
    says what and how long) and cached; an unwritable cache keeps the measurement for this process only. A cached
    profile whose budget ran out before some row counts (or context costs) it wants — or left them with fewer than
    MIN_PAIRS pairs — is continued within CONTINUE_BUDGET_SHARE of the budget, when one of them can fit (so each
    start is bounded, and the profile completes over a few starts)."""
    cached = load_profile(key)
    known = None if cached is None else cached.samples
    if known is not None:
        budget_s *= CONTINUE_BUDGET_SHARE
    if cached is not None and (known is None or not _worth_continuing(known, _long_context(model, MAX_PROFILE_ROWS,
                                                                                          known.base_context), budget_s)):
        return cached
    name = key.model.split("@")[0]
    what = "profiling the forward costs of" if known is None else "continuing the cost profile of"
    print(f"[{what} {name} (at most {budget_s:g} s; once per model, machine and kernel build, then refined from the "
          "timed steps) ...", end="", file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        run = measure_cost_profile(model, budget_s, known=known)
    except BaseException:
        print(" failed]", file=sys.stderr)
        raise
    print(f" {time.perf_counter() - started:.1f} s: {run.summary()}]", file=sys.stderr)
    profile = run.samples.profile()
    try:
        save_profile(key, profile)
    except OSError:
        pass
    return profile
