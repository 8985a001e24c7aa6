"""What one speculative step costs on this machine, and how many tokens per second a draft length buys.

Glossary (see docs/draft-length.md for the derivations):
  T(n)      seconds of one target forward over n new token rows in total (all sequences of the step together,
            each row attending to its sequence's cache). Measured for n = 1..32 by `measure_forward_costs`.
  α_i       conditional acceptance at draft position i: P(draft token i accepted | tokens 0..i-1 accepted).
  E(k)      expected tokens emitted by one verify step of k draft tokens, including the recovered/bonus token:
            E(k) = sum_{i=0..k} prod_{j<i} α_j;  with a constant α this is (1 - α^(k+1)) / (1 - α).
  knee      the most rows one step may verify: the largest measured n with T(n) <= knee_ratio · T(1)
            (default 2: a step never costs more than two plain decode steps), never beyond the measured range.
  speed     a step of B sequences with draft lengths k_b emits sum_b E_b(k_b) tokens in
            T(B + sum_b k_b) + draft_cost(k_1..k_B) seconds.

Profiles are cached as JSON under ``$XDG_CACHE_HOME/specdec/costs/`` (``~/.cache/specdec/costs``), one file per
(model identity, weight format, thread count, machine, kernel build) — see `ProfileKey`.
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
from typing import Sequence as SequenceOf

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
        """Largest measured n with T(n) <= knee_ratio · T(1) (at least 1)."""
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


@dataclass(frozen=True)
class CostProfile:
    """A model's measured costs on this machine: T(n) after a short context, and what longer contexts add."""

    forward: ForwardCosts
    context: ContextCosts | None = None


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


# ---- measuring and caching --------------------------------------------------------------------------------
def measure_forward_costs(model, max_rows: int = MAX_PROFILE_ROWS, context: int = 128, repeats: int = 5) -> ForwardCosts:
    """T(n) for n = 1..max_rows (`forward_seconds` in a cache of its own), made monotone.

    model: a specdec Transformer. Rows of one sequence stand for the rows of a batch: the weights are streamed
    once per forward either way; only the (small at this context) attention reads differ.
    """
    from specdec.cache.kv_cache import KVCache

    cache = KVCache(model.config, 1, context + max_rows + 1, model.device, dtype=model.kv_cache_dtype)
    return ForwardCosts(monotone(forward_seconds(model, cache, 0, context, max_rows, repeats)))


CONTEXT_PROFILE_ROWS = (1, 2, 4, 8, 12, 16, 24, 32)  # row counts timed at the long context (interpolated between)


def measure_context_costs(model, forward: ForwardCosts, base_context: int = 128, long_context: int = 1024,
                          repeats: int = 3) -> ContextCosts:
    """ContextCosts from T(n) after long_context tokens (n in CONTEXT_PROFILE_ROWS up to forward's rows) against
    `forward` (T(n) after base_context): per n, the difference per extra context token, interpolated linearly in
    n between the timed row counts and made non-decreasing in n (more rows never read less)."""
    from specdec.cache.kv_cache import KVCache

    row_counts = [n for n in CONTEXT_PROFILE_ROWS if n <= forward.max_rows]
    cache = KVCache(model.config, 1, long_context + row_counts[-1] + 1, model.device, dtype=model.kv_cache_dtype)
    long_seconds = forward_seconds(model, cache, 0, long_context, row_counts[-1], repeats, row_counts)
    timed = [max(0.0, (seconds - forward(n)) / (long_context - base_context)) for n, seconds in zip(row_counts, long_seconds)]
    per_token, highest = [], 0.0
    for n in range(1, row_counts[-1] + 1):
        upper = next(i for i, m in enumerate(row_counts) if m >= n)
        if row_counts[upper] == n or upper == 0:
            value = timed[upper]
        else:
            low_n, high_n = row_counts[upper - 1], row_counts[upper]
            value = timed[upper - 1] + (timed[upper] - timed[upper - 1]) * (n - low_n) / (high_n - low_n)
        highest = max(highest, value)
        per_token.append(highest)
    return ContextCosts(base_context, tuple(per_token))


def measure_cost_profile(model, max_rows: int = MAX_PROFILE_ROWS) -> CostProfile:
    """T(n) after 128 cached tokens and the context costs up to 1024 (fewer when the model's context is shorter)."""
    forward = measure_forward_costs(model, max_rows=max_rows)
    long_context = min(1024, model.config.max_position_embeddings - max_rows - 1)
    context = measure_context_costs(model, forward, long_context=long_context) if long_context > 256 else None
    return CostProfile(forward, context)


def prefilled_row_batches(model, cache, slot: int, context: int, row_counts: SequenceOf[int], max_rows: int) -> dict:
    """Prefills `context` random token ids (seed 0; max_rows more drawn after them) into `slot` and returns, per n in
    row_counts, the batch of the next n of them: {n: ForwardBatch}, every logit row wanted."""
    from specdec.engine.batch import ForwardBatch

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


def monotone(seconds: SequenceOf[float]) -> tuple[float, ...]:
    """T(n) = min over m >= n of the measured T(m): more rows never cost less, so a lone slow sample (another
    process on the cores) is discarded rather than taken as a cliff."""
    result, lowest = [], float("inf")
    for value in reversed(seconds):
        lowest = min(lowest, value)
        result.append(lowest)
    return tuple(reversed(result))


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


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
    protocol: int = 3  # how costs are measured (3: paired ratios, context costs): a new one measures afresh

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
    path = costs_dir() / key.filename()
    path.parent.mkdir(parents=True, exist_ok=True)
    context = profile.context
    payload = {"key": dataclasses.asdict(key), "forward_s": list(profile.forward.seconds),
               "context": None if context is None else {"base_context": context.base_context,
                                                        "per_token_s": list(context.per_token_s)},
               "measured_at": time.time(), **(extra or {})}
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
        context = payload.get("context")
        return CostProfile(ForwardCosts(tuple(float(s) for s in payload["forward_s"])),
                           None if context is None else ContextCosts(int(context["base_context"]),
                                                                     tuple(float(s) for s in context["per_token_s"])))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_or_measure(model, key: ProfileKey, max_rows: int = MAX_PROFILE_ROWS) -> CostProfile:
    """The cached profile for key, else one measured now (with a notice on stderr) and cached; an unwritable
    cache keeps the measurement for this run only."""
    cached = load_profile(key)
    if cached is not None and cached.forward.max_rows >= max_rows:
        return cached
    print(f"[measuring the forward costs of {key.model.split('@')[0]}: once per model, machine and kernel build]",
          file=sys.stderr)
    profile = measure_cost_profile(model, max_rows=max_rows)
    try:
        save_profile(key, profile)
    except OSError:
        pass
    return profile
