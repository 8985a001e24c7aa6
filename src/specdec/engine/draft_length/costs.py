"""What one speculative step costs, and how many tokens per second a draft length buys: pure arithmetic over
timings measured elsewhere (`measure`: timing the forwards; `profile_store`: the profiles cached on disk and refined
from the engine's timed steps). Nothing here reads a clock, the machine or a file.

Glossary (see docs/draft-length.md for the derivations):
  T(n)      seconds of one target forward over n new token rows in total (all sequences of the step together,
            each row attending to its sequence's cache), n = 1..32. At a model's first use on a machine a few row
            counts are timed within a wall-clock budget (`measure.profile_costs`, PROFILE_BUDGET_S), the others
            bounded from them (`RowSamples.curve`); then every timed engine step refines it
            (`profile_store.ProfileLearner`).
  α_i       conditional acceptance at draft position i: P(draft token i accepted | tokens 0..i-1 accepted).
  E(k)      expected tokens emitted by one verify step of k draft tokens, including the recovered/bonus token:
            E(k) = sum_{i=0..k} prod_{j<i} α_j;  with a constant α this is (1 - α^(k+1)) / (1 - α).
  knee      the most rows one step may verify: the largest n <= 32 with T(n) <= knee_ratio · T(1)
            (default 2: a step never costs more than two plain decode steps).
  speed     a step of B sequences with draft lengths k_b emits sum_b E_b(k_b) tokens in
            T(B + sum_b k_b) + draft_cost(k_1..k_B) seconds.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence as SequenceOf

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
        if (
            any(not 1 <= n <= self.max_rows or v < 0 for n, v in self.values.items())
            or self.values.keys() != self.counts.keys()
        ):
            raise ValueError(
                f"RowSamples needs values >= 0 at row counts 1..{self.max_rows} with counts, got {self.values}"
            )

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
        return cls(
            {int(n): float(v) for n, (v, _) in payload.items()},
            {int(n): int(c) for n, (_, c) in payload.items()},
            max_rows,
        )


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

    def target_seconds(
        self, rows: int, draft_lengths: SequenceOf[int], contexts: SequenceOf[int] | None = None
    ) -> float:
        """The target forward of a step: T(rows), plus each sequence's context cost for its k + 1 rows when
        contexts (cached tokens per sequence of draft_lengths) are given."""
        seconds = self.forward(rows)
        if self.context is not None and contexts:
            seconds += sum(self.context(k + 1, context) for k, context in zip(draft_lengths, contexts))
        return seconds

    def step_seconds(
        self, draft_lengths: SequenceOf[int], batch_size: int, contexts: SequenceOf[int] | None = None
    ) -> float:
        """batch_size counts every sequence in the step (speculating or not); contexts: see target_seconds."""
        return self.target_seconds(batch_size + sum(draft_lengths), draft_lengths, contexts) + self.drafter(
            draft_lengths
        )

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
                   tokens: float, extra_acceptance_probs: SequenceOf[SequenceOf[float]],
                   contexts: SequenceOf[int] | None = None,
                   max_rows: int | None = None) -> list[int]:
        """How many of each sequence's extra tree nodes to verify, beyond the verified_nodes[b] it verifies anyway
        (its chain of draft_lengths[b], or a tree without acceptance probabilities).

        tokens: the step's expected tokens without extra nodes (the whole batch's). A node's acceptance probability
        (the drafter's estimate that the target accepts it) is the tokens it adds on average; a sequence's are in
        decreasing order (a node is no likelier than its parent). Nodes are added best first, over all sequences, while
        batch_size + rows stays
        within the knee (and max_rows); the count with the best expected tokens per second is kept (ties: fewer).
        The drafting is done, but its cost counts in the step's seconds as in `allocate`.
        """
        row_limit = self.max_rows if max_rows is None else min(self.max_rows, max_rows)
        extra = [0] * len(verified_nodes)

        def speed() -> float:
            nodes = [base + e for base, e in zip(verified_nodes, extra)]
            return tokens / (
                self.target_seconds(batch_size + sum(nodes), nodes, contexts) + self.drafter(draft_lengths)
            )

        best, best_speed = list(extra), speed()
        offers = sorted(
            ((prob, b, j) for b, probs in enumerate(extra_acceptance_probs) for j, prob in enumerate(probs)),
            key=lambda offer: (-offer[0], offer[1], offer[2]),
        )
        for prob, b, _ in offers:
            if batch_size + sum(verified_nodes) + sum(extra) >= row_limit:
                break
            extra[b] += 1
            tokens += prob
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

