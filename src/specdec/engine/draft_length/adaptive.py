"""Adaptive draft length: per request, learn where its drafts stop hitting; per step, pick the k that buys the
most tokens per second under the measured cost of verification (`costs`, `measure`, `profile_store`).

Per request and draft position i we keep α_i, an exponential moving average of the conditional acceptance
P(token i accepted | tokens 0..i-1 accepted). It starts from where recently finished requests ended
(`PopulationPrior`; before any, an optimistic prior of 0.7: enough to try drafting), positions not drafted yet
take the estimate of the deepest drafted one, and it is updated from the request's own `SpecDecodeMetrics` after
every verify step; a position left undrafted behind fully accepted drafts for a while drifts back up toward the
draft's last position, so early misses are tried again. Each step the cost model splits the step's row budget (the
knee of T(n)) over the batch so that expected tokens per second is largest; a request may get k = 0. A
request held at k = 0 for `reprobe_interval` steps probes: it drafts one token in two consecutive steps, so a
request whose drafts start hitting later (a repeated passage, code) climbs back — unless even a surely accepted
draft token would not pay at the step's batch (then the probe waits). Two, because the first probe
step also catches the drafter up on every token since k = 0 (a draft model's chunk of them), which says nothing
about the cost of steady drafting; the second measures it, so a drafter whose cost was once overestimated (a
step slowed by another process) is measured again instead of staying off for good.

A draft may first need the drafter to catch up (`Drafter.catch_up_tokens`: a draft model prefills a request's
prompt at its first draft, and every token since when it drafts again after k = 0). That cost is paid once, so it
is weighed against the request's remaining tokens: the draft stays only if what it saves per step, at the planned
batch, times the steps the request has left repays the catch-up (`_repaid_catch_ups`). Every speed the policy
compares counts the tokens of the whole planned batch, the sequences that do not speculate (or are about to join)
included: a draft's rows slow all of them.

The cost model's levels follow what the engine measures (`observe_step`, `CostCalibration`): the target's
seconds per forward, the drafter's seconds per drafted token and per catch-up token, so an expensive drafter (a
draft model on a slow machine) is switched off by its measured cost, not by an estimate. With a measured profile, its
shape T(n) is learned from the steps too (`ProfileLearner`: the budgeted first profile bounds the row counts it did
not time, and the steps replace the bounds by measurements).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence as SequenceOf

from specdec.config import DRAFT_POLICIES
from specdec.drafters.base import Drafter, DrafterCostDescription
from specdec.engine.draft_length.costs import (CostCalibration, CostModel, DrafterCost, ForwardCosts,
                                               expected_accepted_length)
from specdec.engine.draft_length.policy import BatchDraftPolicy, DraftLengthPolicy, StepCost
from specdec.engine.draft_length.profile_store import ProfileKey, ProfileLearner, load_or_measure
from specdec.engine.metrics import SpecDecodeMetrics
from specdec.engine.sequence import Sequence


def _mean_weight(weight: float, earlier: int) -> float:
    """Weight of a new value after `earlier` ones: a running mean (1 / (earlier + 1)) until that falls below
    `weight`, then an EMA of that weight."""
    return max(weight, 1 / (earlier + 1))


@dataclass
class AcceptanceEstimate:
    """Per-position EMA of conditional acceptance for one request."""

    prior: float
    weight: float  # EMA weight of one observation
    stale_after: int = 8  # fully accepted steps without observing a position before its estimate counts as stale
    stale_weight: float = 0.2  # then: pull per fully accepted step toward the estimate of the draft's last position
    alphas: list[float] = field(default_factory=list)  # [max_k]
    observations: list[int] = field(default_factory=list)  # [max_k] steps folded in per position
    unobserved_full_steps: list[int] = field(default_factory=list)  # [max_k] fully accepted steps since observed
    seen_drafted: list[int] = field(default_factory=list)  # metrics counters at the last update
    seen_accepted: list[int] = field(default_factory=list)
    steps_at_zero: int = 0
    probe_steps_left: int = 0  # steps still to draft one token in the current probe
    last_draft_length: int = 0  # k of the request's previous step (0: it did not draft, or it is new)

    def alpha(self, position: int) -> float:
        """Positions never drafted yet take the estimate of the deepest drafted one (the prior before any): were
        they left at the prior, a request whose drafts all hit would stay at the k it first tried, each deeper
        position looking only prior-likely and so barely worth a costly draft token."""
        if position < len(self.alphas):
            return self.alphas[position]
        return self.alphas[-1] if self.alphas else self.prior

    def table(self, max_k: int) -> list[float]:
        return [self.alpha(i) for i in range(max_k)]

    def update(self, metrics: SpecDecodeMetrics) -> None:
        """Folds in the verify steps recorded since the last call.

        At position i, `reached` = steps that drafted token i with tokens 0..i-1 accepted, `hits` = of those,
        steps that accepted token i. For one new step (the usual case) this is exact; for several it is the
        pooled estimate.
        """
        drafted = _delta(metrics.drafted_per_position, self.seen_drafted)
        accepted = _delta(metrics.accepted_per_position, self.seen_accepted)
        self.seen_drafted, self.seen_accepted = list(metrics.drafted_per_position), list(metrics.accepted_per_position)
        planned = self.alpha(len(self.alphas))  # what the steps were planned with at positions never drafted before
        for i, drafted_i in enumerate(drafted):
            reached = drafted_i if i == 0 else min(drafted_i, accepted[i - 1])
            if reached:
                self._observe(i, accepted[i] / reached, reached, planned)
        deepest = max((i + 1 for i, drafted_i in enumerate(drafted) if drafted_i), default=0)
        if deepest and accepted[deepest - 1] > 0:
            self._relax_beyond(deepest, accepted[deepest - 1])

    def _relax_beyond(self, k: int, full_steps: int) -> None:
        """`full_steps` steps had all their k drafted tokens accepted. The positions beyond k were not drafted, so
        not observed; once one has gone `stale_after` such steps unobserved, its estimate, if below position
        k - 1's, moves up toward it by `stale_weight` per further step. Without this a position that missed a few
        times early kept its low estimate for good, since k never reached it again: a Gemma-3-270M qa answer
        drafted k = 2 for 36 steps after 3 misses at position 2, whose acceptance a fixed k = 8 measured at
        0.85. A position that really ends the drafts' hits is then tried again about every
        stale_after steps, one row each time."""
        target = self.alphas[k - 1]
        for position in range(k, len(self.alphas)):
            before = self.unobserved_full_steps[position]
            self.unobserved_full_steps[position] = before + full_steps
            stale_steps = self.unobserved_full_steps[position] - max(before, self.stale_after)
            if stale_steps > 0 and self.alphas[position] < target:
                self.alphas[position] += (1 - (1 - self.stale_weight) ** stale_steps) * (target - self.alphas[position])

    def _observe(self, position: int, rate: float, count: int, planned: float) -> None:
        """Folds in `count` steps with acceptance `rate` at `position`: each step weighs max(weight, 1 / (n + 2))
        for the n-th observation (the estimate before it counting as one), so the first steps replace it as a
        running mean would, and later ones average over about 1 / weight recent steps.

        A position drafted for the first time starts from `planned`, the estimate the step was planned with (the
        deepest drafted position's, see `alpha`), not from the prior: starting it at the prior made a deeper draft
        that was all accepted lower the new positions' estimates (planned at 0.95, then 0.7 + 0.5 · 0.3 = 0.85),
        so k fell back after every success and never climbed past where it first got."""
        while len(self.alphas) <= position:
            self.alphas.append(planned)
            self.observations.append(0)
            self.unobserved_full_steps.append(0)
        self.unobserved_full_steps[position] = 0
        for _ in range(count):
            earlier = self.observations[position] + 1  # the starting estimate counts as one observation
            self.alphas[position] += _mean_weight(self.weight, earlier) * (rate - self.alphas[position])
            self.observations[position] += 1


@dataclass
class PopulationPrior:
    """Where a new request's estimates start: per position, the estimates of recently finished requests.

    A request starting from the fixed prior (0.7) drafts k = 4 or so and needs several steps to reach the k its
    drafts deserve; on 128-token answers with ngram on Gemma-3-270M (≈ 10-15 verify steps) that warm-up was a
    good part of each answer. Requests of one workload accept alike, so a new one starts from what the last ones
    ended with: a running mean over the first finished requests (the first replaces the fixed prior, which is
    a guess), then an EMA (`weight` per request), of each position's estimate where the request drafted it. A new
    request's start counts as one observation, as the fixed prior did, and never lies below `floor`, so a request
    after a run of misses still tries a draft.
    """

    prior: float
    weight: float = 0.25
    floor: float = 0.3
    alphas: list[float] = field(default_factory=list)  # [positions drafted by some finished request]
    requests: list[int] = field(default_factory=list)  # per position: finished requests folded in

    def fold(self, estimate: AcceptanceEstimate) -> None:
        """Adds a finished request's estimates at the positions it drafted (a position no finished request drafted
        yet starts from the deepest one's estimate before this request, as a request's own positions do)."""
        deepest = self.alphas[-1] if self.alphas else self.prior
        for position, (alpha, observations) in enumerate(zip(estimate.alphas, estimate.observations)):
            if not observations:
                continue
            while len(self.alphas) <= position:
                self.alphas.append(deepest)
                self.requests.append(0)
            earlier = self.requests[position]  # the fixed prior does not count
            self.alphas[position] += _mean_weight(self.weight, earlier) * (alpha - self.alphas[position])
            self.requests[position] += 1

    def start(self, weight: float) -> AcceptanceEstimate:
        """A new request's estimate (EMA weight `weight`), from the population (the prior before any request)."""
        alphas = [max(self.floor, alpha) for alpha in self.alphas]
        return AcceptanceEstimate(self.prior, weight, alphas=alphas, observations=[0] * len(alphas),
                                  unobserved_full_steps=[0] * len(alphas))


@dataclass
class AcceptanceProbCalibration:
    """How a drafter's tree-node acceptance probabilities (its path probabilities) compare with what the target
    accepts.

    Decayed sums of the acceptance probabilities of the verified nodes that carry one and of the nodes accepted
    among them; `scale` (accepted nodes per unit of acceptance probability, starting from a prior of `prior_nodes`
    nodes taken at face value) multiplies the probabilities before the cost model prices the nodes. Measured here: the
    Qwen2.5-Coder EAGLE head's path probabilities are
    about 1.6x its acceptance (docs/draft-length.md, trees), which would make trees look worth more rows
    than they are.
    """

    decay: float = 0.95  # per verify step: about the last 20 steps count
    prior_nodes: float = 2.0
    acceptance_prob_sum: float = 0.0
    accepted: float = 0.0

    def observe(self, acceptance_prob_sum: float, accepted: int) -> None:
        self.acceptance_prob_sum = self.decay * self.acceptance_prob_sum + acceptance_prob_sum
        self.accepted = self.decay * self.accepted + accepted

    @property
    def scale(self) -> float:
        return (self.accepted + self.prior_nodes) / (self.acceptance_prob_sum + self.prior_nodes)


def _expected_per_request(draft_lengths: SequenceOf[int], estimates: SequenceOf[AcceptanceEstimate]) -> list[float]:
    """Each request's expected tokens this step: E(k) from its acceptance estimates (1 at k = 0)."""
    return [expected_accepted_length(k, e.table(k)) if k else 1.0 for k, e in zip(draft_lengths, estimates)]


def _batch_tokens(per_request: SequenceOf[float], batch_size: int) -> float:
    """The step's expected tokens over the whole planned batch: the speculating requests' (per_request) plus one
    for every other sequence (not speculating, or about to join)."""
    return sum(per_request) + batch_size - len(per_request)


def _delta(now: list[int], before: list[int]) -> list[int]:
    return [n - (before[i] if i < len(before) else 0) for i, n in enumerate(now)]


class AdaptiveDraftPolicy(DraftLengthPolicy):
    """k per request and step from acceptance estimates and a CostModel (`CostModel.fallback` without a profile).

    max_draft_tokens: the largest k (the speculative config's num_speculative_tokens).
    max_verify_tokens: a cap on the rows of one step on top of the cost model's knee.
    """

    def __init__(self, max_draft_tokens: int, cost_model: CostModel | None = None, max_verify_tokens: int = 32,
                 prior_alpha: float = 0.7, ema_weight: float = 0.3, reprobe_interval: int = 16,
                 learner: ProfileLearner | None = None) -> None:
        if max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {max_draft_tokens}")
        if not 0 < prior_alpha < 1 or not 0 < ema_weight <= 1:
            raise ValueError(f"need 0 < prior_alpha < 1 and 0 < ema_weight <= 1, got {prior_alpha}, {ema_weight}")
        if reprobe_interval < 1:
            raise ValueError(f"reprobe_interval must be >= 1, got {reprobe_interval}")
        self.max_draft_tokens = max_draft_tokens
        self.base_cost_model = cost_model or CostModel.fallback(max_verify_tokens)
        self.cost_model = self.base_cost_model  # with measured levels once steps are observed
        self.calibration = CostCalibration()
        self.learner = learner  # refines the cost model's T(n) from the timed steps (None: T(n) stays as given)
        self.max_verify_tokens = max_verify_tokens
        self.max_rows = min(self.cost_model.max_rows, max_verify_tokens)
        self.prior_alpha = prior_alpha
        self.ema_weight = ema_weight
        self.reprobe_interval = reprobe_interval
        self._estimates: dict[str, tuple[Sequence, AcceptanceEstimate]] = {}
        self.population = PopulationPrior(prior_alpha)
        self._steady_drafting = False  # whether the last step's drafting requests all drafted the step before
        self.acceptance_prob_calibration = AcceptanceProbCalibration()

    def estimate(self, seq: Sequence) -> AcceptanceEstimate:
        """The request's acceptance estimate, up to date with its metrics (a new one for a new Sequence)."""
        entry = self._estimates.get(seq.request_id)
        if entry is None or entry[0] is not seq:
            if entry is not None:
                self._retire(entry)
            entry = (seq, self.population.start(self.ema_weight))
            self._estimates[seq.request_id] = entry
        entry[1].update(seq.metrics)
        return entry[1]

    def observe_step(self, cost: StepCost) -> None:
        """Folds the step's measured target and drafter seconds into the cost model (see CostCalibration).

        The drafter's seconds count only in steady steps, where every drafting request also drafted in its
        previous step: a request's first draft (a draft model then prefills the prompt) and a re-probe after
        k = 0 (it catches up on every token since) cost what steady drafting does not, and counting them would
        keep a draft model switched off.
        """
        draft_s = cost.draft_s if self._steady_drafting else None
        self.calibration.observe(self.base_cost_model, cost.rows, cost.draft_lengths, draft_s, cost.target_s,
                                 cost.contexts)
        if draft_s is None and cost.catch_up_tokens:
            self.calibration.observe_catch_up(self.base_cost_model, cost.draft_lengths, cost.draft_s,
                                              cost.catch_up_tokens)
        if self.learner is not None:
            self._learn(cost)
        self.cost_model = self.calibration.apply(self.base_cost_model)

    def _learn(self, cost: StepCost) -> None:
        """Folds the step's target seconds into the learned T(n) (ProfileLearner) and plans with the new curve: its
        knee may have moved, e.g. once a row count reached under the conservative bound turns out cheaper. The
        context part is the profile's at the calibrated level."""
        base = self.base_cost_model
        context_s = base.target_seconds(cost.rows, cost.draft_lengths, cost.contexts) - base.forward(cost.rows)
        if self.learner.observe(cost.rows, cost.target_s, context_s * (self.calibration.target_scale or 1.0)):
            profile = self.learner.profile()
            self.base_cost_model = dataclasses.replace(base, forward=profile.forward, context=profile.context)
            self.max_rows = min(self.base_cost_model.max_rows, self.max_verify_tokens)
            self.learner.save_if_due()

    def draft_lengths(self, seqs: SequenceOf[Sequence], batch_size: int,
                      catch_up_tokens: SequenceOf[int] | None = None) -> list[int]:
        self._forget_others(seqs)  # first: a finished request's estimates are where a new one starts
        estimates = [self.estimate(seq) for seq in seqs]
        contexts = [seq.num_cached for seq in seqs]
        lengths = list(self.cost_model.allocate([e.table(self.max_draft_tokens) for e in estimates], batch_size,
                                                self.max_draft_tokens, self.max_rows, contexts))
        if catch_up_tokens is not None:
            # Until some request has measured the drafts' acceptance, a first draft is weighed as a probe is: the
            # prior is a guess, and only a draft can measure it (weighed at the prior, a draft model's prompt
            # catch-up vetoed every first draft, so none was ever made).
            unmeasured = [not self.population.alphas and not any(e.observations) for e in estimates]
            lengths = self._repaid_catch_ups(lengths, unmeasured, [True] * len(seqs), seqs, estimates, batch_size,
                                             contexts, catch_up_tokens)
        planned = list(lengths)
        # a request whose draft was vetoed counts as held at k = 0, so it is probed in time
        lengths = self._reprobe(lengths, estimates, batch_size, contexts)
        if catch_up_tokens is not None:
            probes = [k > 0 and not before for k, before in zip(lengths, planned)]
            if any(probes):
                lengths = self._repaid_catch_ups(lengths, probes, probes, seqs, estimates, batch_size, contexts,
                                                 catch_up_tokens)
        self._steady_drafting = all(e.last_draft_length > 0 for e, k in zip(estimates, lengths) if k > 0)
        for estimate, k in zip(estimates, lengths):
            estimate.last_draft_length = k
        return lengths

    def _repaid_catch_ups(self, lengths: list[int], probes: list[bool], considered: list[bool],
                          seqs: SequenceOf[Sequence], estimates: list[AcceptanceEstimate], batch_size: int,
                          contexts: list[int], catch_up_tokens: SequenceOf[int]) -> list[int]:
        """Keeps a draft that needs the drafter to catch up first only if the request's remaining tokens can repay
        the catch-up: what its drafts save per step at this batch, times the steps it has left, against the
        catch-up's seconds. Otherwise it stays at k = 0 (a draft model would prefill a prompt, or every token since
        its last draft, to draft for a request about to end, or about to lose its drafts to a growing batch: the
        saving counts at the planned batch).

        The saving of seq i's draft: the step's tokens, at the seconds per token the step would take without it,
        minus the step's seconds with it. A probe is weighed as if its draft were surely accepted (as
        `_probe_could_pay` does): its estimate is what it is there to correct. Only the `considered` requests'
        drafts are weighed (and may be dropped)."""
        per_token = self.cost_model.drafter.catch_up_per_token_s
        if not per_token or not any(k and c for k, c in zip(lengths, catch_up_tokens)):
            return lengths
        gains = [k + 1 if probe else expected
                 for k, probe, expected in zip(lengths, probes, _expected_per_request(lengths, estimates))]
        tokens = _batch_tokens(gains, batch_size)
        seconds = self.cost_model.step_seconds(lengths, batch_size, contexts)
        kept = list(lengths)
        for i, (seq, k, catch_up) in enumerate(zip(seqs, lengths, catch_up_tokens)):
            if not k or not catch_up or not considered[i]:
                continue
            without = lengths[:i] + [0] + lengths[i + 1 :]
            tokens_without = tokens - gains[i] + 1
            saving_per_step = (
                tokens * self.cost_model.step_seconds(without, batch_size, contexts) / tokens_without - seconds
            )
            remaining = min(seq.remaining_tokens, seq.max_model_len - len(seq.all_token_ids))
            if saving_per_step * remaining / gains[i] < catch_up * per_token:
                kept[i] = 0
        return kept

    def tree_nodes(self, seqs: SequenceOf[Sequence], draft_lengths: SequenceOf[int], verified_nodes: SequenceOf[int],
                   extra_acceptance_probs: SequenceOf[SequenceOf[float]], batch_size: int) -> list[int]:
        """Extra tree nodes while they raise the step's expected tokens per second (CostModel.tree_nodes); the
        chains' expected tokens come from the requests' acceptance estimates, the nodes' from their acceptance
        probabilities times the measured calibration (AcceptanceProbCalibration)."""
        tokens = _batch_tokens(_expected_per_request(draft_lengths, [self.estimate(seq) for seq in seqs]), batch_size)
        scale = self.acceptance_prob_calibration.scale
        return self.cost_model.tree_nodes(draft_lengths, verified_nodes, batch_size, tokens,
                                          [[prob * scale for prob in probs] for probs in extra_acceptance_probs],
                                          [seq.num_cached for seq in seqs], self.max_rows)

    def observe_tree_acceptance(self, acceptance_prob_sum: float, accepted: int) -> None:
        self.acceptance_prob_calibration.observe(acceptance_prob_sum, accepted)

    def _reprobe(self, lengths: list[int], estimates: list[AcceptanceEstimate], batch_size: int,
                 contexts: list[int]) -> list[int]:
        rows = batch_size + sum(lengths)
        could_pay: bool | None = None  # computed once per step, when a request is due for a probe
        for i, estimate in enumerate(estimates):
            if lengths[i]:
                estimate.steps_at_zero, estimate.probe_steps_left = 0, 0
                continue
            if not estimate.probe_steps_left:
                estimate.steps_at_zero += 1
                if estimate.steps_at_zero >= self.reprobe_interval:
                    if could_pay is None:
                        could_pay = self._probe_could_pay(lengths, estimates, batch_size, contexts)
                    if could_pay:
                        estimate.probe_steps_left, estimate.steps_at_zero = 2, 0
            if estimate.probe_steps_left and rows < self.max_rows:
                lengths[i], rows = 1, rows + 1
                estimate.probe_steps_left -= 1
        return lengths

    def _probe_could_pay(self, lengths: list[int], estimates: list[AcceptanceEstimate], batch_size: int,
                         contexts: list[int]) -> bool:
        """Whether one draft token for every request at k = 0 would raise the step's expected tokens per second
        if the drafts were surely accepted, at the drafter's profiled cost (the measured one may be what a probe
        is to correct). When not even that pays (a large batch, where verify rows are no longer nearly free),
        probes could not turn drafting on and would only cost the drafter's catch-up: a draft model then
        prefills the prompts and every token since, a quarter of a run of 8 Qwen HumanEval requests at once."""
        model = CostCalibration(target_scale=self.calibration.target_scale).apply(self.base_cost_model)
        tokens = _batch_tokens(_expected_per_request(lengths, estimates), batch_size)
        probed = [k or 1 for k in lengths]
        return ((tokens + lengths.count(0)) / model.step_seconds(probed, batch_size, contexts)
                > tokens / model.step_seconds(lengths, batch_size, contexts))

    def _forget_others(self, seqs: SequenceOf[Sequence]) -> None:
        """Drops finished requests (every running speculating request is in every decode step), folding their
        estimates into the population prior."""
        current = {seq.request_id for seq in seqs}
        for request_id in [r for r in self._estimates if r not in current]:
            self._retire(self._estimates.pop(request_id))

    def _retire(self, entry: tuple[Sequence, AcceptanceEstimate]) -> None:
        seq, estimate = entry
        estimate.update(seq.metrics)  # its last verify steps
        self.population.fold(estimate)


def build_draft_policy(choice: str | DraftLengthPolicy, num_speculative_tokens: int, max_verify_tokens: int,
                       target=None, drafter=None, model_name: str | None = None,
                       weight_format: str = "q8") -> DraftLengthPolicy | None:
    """The engine's draft policy for LLM(draft_policy=...): an instance as given; "fixed" -> BatchDraftPolicy;
    "adaptive" -> AdaptiveDraftPolicy over the profile of this (model, weight format, threads, machine, kernel
    build): the cached one, else measured now within a few seconds (`load_or_measure`) and cached, refined from the
    engine's timed steps and saved back as it runs (`ProfileLearner`); `CostModel.fallback` when the model has no
    name to key a profile by. None when not speculating."""
    if isinstance(choice, DraftLengthPolicy):
        return choice
    if choice not in DRAFT_POLICIES:
        raise ValueError(
            f"unknown draft policy {choice!r}; known: {', '.join(DRAFT_POLICIES)} (or a DraftLengthPolicy)"
        )
    if num_speculative_tokens < 1:
        return None
    if choice == "fixed":
        return BatchDraftPolicy(num_speculative_tokens, max_verify_tokens)
    profile, key = _cached_profile(target, model_name, weight_format)
    cost_model = _cost_model(profile, target, drafter, max_verify_tokens)
    learner = None if profile is None or profile.samples is None else ProfileLearner(profile.samples, key)
    return AdaptiveDraftPolicy(num_speculative_tokens, cost_model, max_verify_tokens, learner=learner)


def _cached_profile(target, model_name: str | None, weight_format: str):
    """(profile, its key) for a named model (cached or measured now), (None, None) without a name or a target."""
    if model_name is None or target is None:
        return None, None
    try:
        key = ProfileKey.current(model_name, weight_format, target.device)
    except (OSError, ValueError):
        return None, None
    if target.parallel is not None:  # a tensor-parallel leader: its own costs (communication included)
        key = dataclasses.replace(key, model=f"{key.model}+tp{target.parallel.world_size}")
    return load_or_measure(target, key), key


def _cached_cost_model(
    target, drafter, model_name: str | None, weight_format: str, max_verify_tokens: int
) -> CostModel:
    """The adaptive policy's starting cost model for this target and drafter (see build_draft_policy)."""
    return _cost_model(_cached_profile(target, model_name, weight_format)[0], target, drafter, max_verify_tokens)


def _cost_model(profile, target, drafter: Drafter | None, max_verify_tokens: int) -> CostModel:
    forward = profile.forward if profile is not None else CostModel.fallback(max_verify_tokens).forward
    described = drafter.cost_description() if drafter is not None and target is not None else None
    drafter_cost = DrafterCost()  # no model forward (ngram / suffix lookups): measured ≈ 0 next to a forward
    if described is not None and described.forward_weight_nbytes:
        drafter_cost = _estimated_drafter_cost(described, forward, target.weight_nbytes)
    if profile is None:
        return CostModel.fallback(max_verify_tokens, drafter_cost)
    return CostModel(profile.forward, drafter_cost, context=profile.context)


def _estimated_drafter_cost(described: DrafterCostDescription, forward: ForwardCosts,
                            target_weight_nbytes: int) -> DrafterCost:
    """A drafter running model forwards, priced from the target's T(n) until it is measured. Decoding is
    memory-bound: a draft forward ≈ the target's T(1) scaled by the weight bytes it streams, and a catch-up token ≈
    the target's per-row cost of its widest forward (a prefill is compute-bound) scaled by the weights
    (multiply-adds) it passes through; shared by the step's sequences. A draft model or EAGLE head runs one forward
    per draft position: k draft tokens cost k forwards, the first of which also feeds the committed tokens since
    the last step (per_step_s 0: no forward of its own). Medusa runs one forward per step, whatever k."""
    share = described.forward_weight_nbytes / max(1, target_weight_nbytes)
    per_forward = forward(1) * share
    per_row = forward(forward.max_rows) / forward.max_rows
    if described.forward_per_draft_token:
        return DrafterCost(per_token_s=per_forward, batched=True, catch_up_per_token_s=per_row * share)
    return DrafterCost(per_step_s=per_forward, batched=True, catch_up_per_token_s=per_row * share)
