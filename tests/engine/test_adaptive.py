"""Adaptive draft length: EMA acceptance per position, k from the cost model, the re-probe after k = 0, and
greedy output identical to plain decoding (batch 1 and 4) on tiny models. Every cost a policy plans with is
synthetic: a given CostModel, steps timed by it (`SyntheticTimings`) or by hand (StepCost), profiles measured on a
fake clock."""
import dataclasses

import pytest

from specdec.config import SamplingParams
from specdec.engine.draft_length.adaptive import (
    AcceptanceEstimate,
    AdaptiveDraftPolicy,
    PopulationPrior,
    build_draft_policy,
)
from specdec.engine.draft_length.costs import CostCalibration, CostModel, DrafterCost, ForwardCosts
from specdec.engine.draft_length.policy import BatchDraftPolicy, StepCost
from specdec.engine.metrics import SpecDecodeMetrics
from specdec.engine.sequence import new_sequence

from engine.test_speculative import ARCHITECTURES, METHODS, PROMPTS, make_drafter, run

CPU_LIKE = CostModel(ForwardCosts.linear(0.010, 0.05))  # every extra row costs 5 % of a decode step


def make_seq(tokenizer, request_id="0"):
    return new_sequence(request_id, [1, 2, 3], SamplingParams(max_tokens=100), tokenizer, 256, None, True)


def step(policy, seqs, accepted, batch_size=None):
    """One engine step: ask for k, then record that `accepted[i]` of seq i's k drafts were accepted."""
    lengths = policy.draft_lengths(seqs, batch_size=batch_size or len(seqs))
    for seq, k, a in zip(seqs, lengths, accepted):
        if k:
            seq.metrics.record_step(k, min(k, a))
    return lengths


def test_estimate_updates_conditional_acceptance_per_position():
    estimate = AcceptanceEstimate(prior=0.7, weight=0.5)
    metrics = SpecDecodeMetrics()
    assert estimate.table(2) == pytest.approx([0.7, 0.7])  # nothing drafted yet: the prior
    metrics.record_step(4, 2)  # positions 0, 1 accepted; 2 rejected; 3 not reached
    estimate.update(metrics)
    assert estimate.table(5) == pytest.approx([0.85, 0.85, 0.35, 0.35, 0.35])  # 3, 4 never reached: as 2
    estimate.update(metrics)  # nothing new: unchanged
    assert estimate.table(4) == pytest.approx([0.85, 0.85, 0.35, 0.35])
    metrics.record_step(1, 0)
    estimate.update(metrics)
    assert estimate.alpha(0) == pytest.approx(0.425)


def test_k_drops_to_zero_when_drafts_never_hit(tiny_tokenizer):
    policy = AdaptiveDraftPolicy(6, CPU_LIKE, reprobe_interval=1000)
    seq = make_seq(tiny_tokenizer)
    lengths = [step(policy, [seq], [0])[0] for _ in range(20)]
    assert lengths[0] == 6  # optimistic prior: explore
    assert lengths[-1] == 0 and lengths.index(0) < 12


def test_long_k_when_drafts_always_hit(tiny_tokenizer):
    policy = AdaptiveDraftPolicy(8, CostModel(ForwardCosts.linear(0.010, 0.0)))
    seq = make_seq(tiny_tokenizer)
    assert [step(policy, [seq], [8])[0] for _ in range(10)] == [8] * 10


def test_k_settles_shorter_when_only_the_first_drafts_hit(tiny_tokenizer):
    policy = AdaptiveDraftPolicy(8, CPU_LIKE, reprobe_interval=1000)
    seq = make_seq(tiny_tokenizer)
    lengths = [step(policy, [seq], [2])[0] for _ in range(30)]
    assert lengths[-1] == 2  # positions 0, 1 always hit, position 2 never: drafting it buys nothing


def test_reprobe_after_zero_and_recovery(tiny_tokenizer):
    policy = AdaptiveDraftPolicy(4, CPU_LIKE, reprobe_interval=5)
    seq = make_seq(tiny_tokenizer)
    for _ in range(15):
        step(policy, [seq], [0])
    lengths = [step(policy, [seq], [0])[0] for _ in range(10)]
    # the 5th step at k = 0 starts a probe: k = 1 in two consecutive steps (the second times steady drafting)
    assert "".join(map(str, lengths)) in "000011" * 4
    recovered = [step(policy, [seq], [4])[0] for _ in range(40)]  # drafts start hitting
    assert recovered[-1] == 4


def test_batch_rows_within_the_knee(tiny_tokenizer):
    knee8 = CostModel(ForwardCosts.from_ratios(0.01, [1.0] * 8 + [4.0] * 24))
    policy = AdaptiveDraftPolicy(5, knee8)
    for batch in (1, 2, 3, 4, 8):
        seqs = [make_seq(tiny_tokenizer, str(i)) for i in range(batch)]
        lengths = policy.draft_lengths(seqs, batch_size=batch)
        assert batch + sum(lengths) <= 8
    assert policy.draft_lengths([make_seq(tiny_tokenizer, "x")], batch_size=8) == [0]


def test_max_verify_tokens_caps_rows(tiny_tokenizer):
    policy = AdaptiveDraftPolicy(5, CostModel(ForwardCosts.linear(0.01, 0.0)), max_verify_tokens=6)
    seqs = [make_seq(tiny_tokenizer, str(i)) for i in range(3)]
    assert sum(policy.draft_lengths(seqs, batch_size=3)) == 3


def test_build_draft_policy_choices():
    assert build_draft_policy("fixed", 4, 32) == BatchDraftPolicy(4, 32)
    assert isinstance(build_draft_policy("adaptive", 4, 32), AdaptiveDraftPolicy)
    assert build_draft_policy("adaptive", 0, 32) is None
    with pytest.raises(ValueError, match="unknown draft policy"):
        build_draft_policy("sometimes", 4, 32)


class SyntheticTimings(AdaptiveDraftPolicy):
    """The adaptive policy with each engine step timed by its synthetic cost model, not by this machine's clock: its
    choices then depend on the tokens alone, on any machine."""

    def observe_step(self, cost):
        base = self.base_cost_model
        super().observe_step(dataclasses.replace(
            cost, target_s=base.target_seconds(cost.rows, cost.draft_lengths, cost.contexts),
            draft_s=base.drafter(cost.draft_lengths)))


def run_adaptive(model, tokenizer, prompts, params, drafter, cost_model, k=4):
    return run(model, tokenizer, prompts, params, drafter, k=k, draft_policy=SyntheticTimings(k, cost_model))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_adaptive_output_identical_to_plain(make_tiny_model, tiny_tokenizer, architecture, method, batch):
    model = make_tiny_model(architecture)
    params = SamplingParams(max_tokens=40)
    prompts = PROMPTS[:batch] if batch > 1 else [PROMPTS[1]]
    plain, _ = run(model, tiny_tokenizer, prompts, params)
    spec, engine = run_adaptive(
        model, tiny_tokenizer, prompts, params, make_drafter(method, make_tiny_model, architecture), CPU_LIKE
    )
    assert [s.output_token_ids for s in spec] == [s.output_token_ids for s in plain]
    assert [s.finish_reason for s in spec] == [s.finish_reason for s in plain]
    assert engine.metrics.drafted_tokens > 0


def test_adaptive_drafts_less_than_fixed_when_drafts_miss(make_tiny_model, tiny_tokenizer):
    model = make_tiny_model("qwen2")
    params = SamplingParams(max_tokens=60)
    _, fixed = run(model, tiny_tokenizer, PROMPTS, params, make_drafter("draft_model", make_tiny_model, "qwen2"), k=4)
    _, adaptive = run_adaptive(
        model, tiny_tokenizer, PROMPTS, params, make_drafter("draft_model", make_tiny_model, "qwen2"), CPU_LIKE
    )
    assert fixed.metrics.acceptance_rate < 0.05  # a random draft model: its drafts (almost) never hit
    assert adaptive.metrics.drafted_tokens < fixed.metrics.drafted_tokens / 4


def test_calibration_scales_the_target_and_measures_the_drafter():
    base = CostModel(ForwardCosts.linear(0.010, 0.05), DrafterCost(per_token_s=0.001, batched=True))
    calibration = CostCalibration(weight=0.5)
    calibration.observe(base, rows=3, draft_lengths=(2, 1), draft_s=0.008, target_s=0.022)
    calibrated = calibration.apply(base)
    assert calibration.target_scale == pytest.approx(2.0)  # the first measured step sets the level: 0.022 / 0.011
    assert calibrated.forward(3) == pytest.approx(0.022)  # measured level, profiled shape
    # from the profile's 0.001 at the measured level 2 and the observed 0.004 (batched: max k = 2 tokens)
    assert calibration.draft_per_token_s == pytest.approx((0.002 + 0.004) / 2)
    assert calibrated.drafter((2, 1)) == pytest.approx(0.006)
    calibration.observe(base, rows=1, draft_lengths=(0,), draft_s=0.0, target_s=0.015)  # no draft: drafter unchanged
    assert calibration.draft_per_token_s == pytest.approx(0.003)
    assert calibration.target_scale == pytest.approx((2.0 + 1.5) / 2)


def test_unmeasured_drafter_keeps_its_proportion_to_the_measured_target():
    """Without a profile T(1) is the unit (1 s) and a draft model's estimate is its weight-byte share of it. A
    first step whose drafter time does not count (the draft model prefilled the prompt) must still bring the
    drafter estimate to the measured level with the target's; left at the unit level it looked 15x dearer than
    the target's real step and the policy never drafted again (Qwen-1.5B / 0.5B: k = 0 after one step)."""
    base = CostModel.fallback(32, DrafterCost(per_token_s=0.35, per_step_s=0.35, batched=True))
    calibration = CostCalibration()
    calibration.observe(base, rows=3, draft_lengths=(2,), draft_s=None, target_s=0.070)
    calibrated = calibration.apply(base)
    assert calibrated.forward(1) == pytest.approx(0.070 / 1.04)  # the fallback's 2 % per extra row
    assert calibrated.drafter.per_token_s == pytest.approx(0.35 * 0.070 / 1.04)
    assert calibrated.drafter.per_token_s / calibrated.forward(1) == pytest.approx(0.35)


def test_policy_without_a_profile_keeps_drafting_a_draft_model_that_hits(tiny_tokenizer):
    # the drafter estimate is a third of T(1) (weight bytes), its real cost the same third of the measured 60 ms
    policy = AdaptiveDraftPolicy(
        4, CostModel.fallback(32, DrafterCost(per_token_s=0.33, per_step_s=0.33, batched=True)), reprobe_interval=1000
    )
    seq = make_seq(tiny_tokenizer)
    lengths = []
    for i in range(12):
        k = step(policy, [seq], [1 if i == 0 else 4])[0]  # first step: one hit, then a miss
        lengths.append(k)
        policy.observe_step(StepCost(1 + k, (k,), draft_s=(0.4 if i == 0 else 0.020 * k), target_s=0.060))
    assert lengths[0] > 0 and all(k > 0 for k in lengths[1:]), lengths


def test_calibration_clips_a_lone_outlier():
    base = CostModel(ForwardCosts.linear(0.010, 0.0), DrafterCost(per_token_s=0.002, batched=True))
    calibration = CostCalibration(weight=0.2, max_jump=3.0)
    calibration.observe(base, rows=2, draft_lengths=(1,), draft_s=0.5, target_s=0.010)  # the draft model's prefill
    assert calibration.target_scale == pytest.approx(1.0)
    assert calibration.draft_per_token_s == pytest.approx(0.8 * 0.002 + 0.2 * 0.006)  # 0.5 s counted as 0.006
    for _ in range(30):  # a lasting change still takes over
        calibration.observe(base, rows=2, draft_lengths=(1,), draft_s=0.030, target_s=0.010)
    assert calibration.draft_per_token_s == pytest.approx(0.030, rel=0.01)


def test_measured_expensive_drafter_turns_speculation_off(tiny_tokenizer):
    policy = AdaptiveDraftPolicy(4, CostModel(ForwardCosts.linear(0.010, 0.0)), reprobe_interval=1000)
    seq = make_seq(tiny_tokenizer)
    lengths = []
    for _ in range(20):
        k = step(policy, [seq], [1])[0]  # the first draft token always hits, the second never
        lengths.append(k)
        policy.observe_step(StepCost(1 + k, (k,), draft_s=0.030 * k, target_s=0.010))  # 3 decode steps per token
    assert lengths[0] > 0 and lengths[-1] == 0


def test_measured_cheap_drafter_keeps_drafting(tiny_tokenizer):
    policy = AdaptiveDraftPolicy(4, CostModel(ForwardCosts.linear(0.010, 0.0)), reprobe_interval=1000)
    seq = make_seq(tiny_tokenizer)
    lengths = []
    for _ in range(20):
        k = step(policy, [seq], [1])[0]
        lengths.append(k)
        policy.observe_step(StepCost(1 + k, (k,), draft_s=0.0002 * k, target_s=0.010))
    assert lengths[-1] >= 1


class RecordingPolicy(BatchDraftPolicy):
    def __init__(self, k):
        super().__init__(k)
        object.__setattr__(self, "costs", [])

    def observe_step(self, cost):
        self.costs.append(cost)


def test_first_observations_replace_the_prior_as_a_running_mean():
    """The prior counts as one observation: the n-th step weighs max(weight, 1 / (n + 1)), so a request's own
    first steps outweigh the prior quickly, and later steps average over about 1 / weight of them."""
    estimate = AcceptanceEstimate(prior=0.7, weight=0.2)
    metrics = SpecDecodeMetrics()
    expected = [0.85, 0.9, 0.925, 0.94]  # weights 1/2, 1/3, 1/4, then 0.2
    for value in expected:
        metrics.record_step(1, 1)
        estimate.update(metrics)
        assert estimate.alpha(0) == pytest.approx(value)


def test_positions_drafted_for_the_first_time_start_from_the_planned_estimate():
    """Deeper positions are planned with the deepest drafted position's estimate; their first observation moves
    that estimate, it does not restart them at the prior (which made an all-accepted deeper draft look worse)."""
    estimate = AcceptanceEstimate(prior=0.7, weight=0.3)
    metrics = SpecDecodeMetrics()
    metrics.record_step(4, 4)
    estimate.update(metrics)
    assert estimate.table(6) == pytest.approx([0.85] * 6)  # 4, 5 not drafted yet: planned as position 3
    metrics.record_step(8, 8)
    estimate.update(metrics)
    assert estimate.table(8) == pytest.approx([0.9] * 4 + [0.925] * 4)  # 4..7 from the planned 0.85, weight 1/2


# Gemma-3-270M's T(1..32) measured on this project's 2-core machine (ms): rows get dearer past ~8
GEMMA_LIKE = CostModel(ForwardCosts(tuple(ms / 1000 for ms in (
    11.23, 11.23, 11.56, 12.09, 12.26, 13.08, 13.97, 14.58, 15.33, 16.68, 17.04, 18.45, 19.62, 20.25, 21.56, 23.22,
    23.36, 25.08, 26.82, 27.14, 29.33, 30.75, 31.47, 33.33, 35.56, 36.32, 37.48, 39.48, 39.66, 41.43, 43.01, 43.4))))


def test_k_climbs_while_every_draft_is_accepted(tiny_tokenizer):
    policy = AdaptiveDraftPolicy(16, GEMMA_LIKE, max_verify_tokens=32)
    seq = make_seq(tiny_tokenizer)
    lengths = [step(policy, [seq], [16])[0] for _ in range(12)]
    assert lengths == sorted(lengths) and lengths[3] >= 13, (
        lengths
    )  # it used to fall back to 10 after each deeper draft


def test_positions_beyond_fully_accepted_drafts_recover_from_early_misses():
    """A position that missed early is not drafted again while its estimate is low; once it has gone stale_after (8)
    fully accepted steps unobserved, each further one pulls its estimate up toward the draft's last position's, by
    stale_weight (0.2) per step, never above it."""
    estimate = AcceptanceEstimate(prior=0.7, weight=0.3)
    metrics = SpecDecodeMetrics()
    for _ in range(3):
        metrics.record_step(4, 2)  # positions 0, 1 accepted, 2 rejected: no step accepted its whole draft
        estimate.update(metrics)
    low = estimate.alpha(2)
    assert low < 0.3 and estimate.alpha(3) == low  # 3 was never reached: planned as the deepest observed, 2
    for _ in range(8):
        metrics.record_step(2, 2)
        estimate.update(metrics)
    assert estimate.alpha(2) == pytest.approx(low)  # not stale yet
    metrics.record_step(2, 2)
    estimate.update(metrics)
    assert estimate.alpha(2) == pytest.approx(low + 0.2 * (estimate.alpha(1) - low))
    for _ in range(20):
        metrics.record_step(2, 2)
        estimate.update(metrics)
    assert 0.8 < estimate.alpha(2) <= estimate.alpha(1)


def test_k_grows_again_after_early_misses_once_the_drafts_hit(tiny_tokenizer):
    policy = AdaptiveDraftPolicy(16, CostModel(ForwardCosts.linear(0.010, 0.10)), max_verify_tokens=32)
    seq = make_seq(tiny_tokenizer)
    early = [step(policy, [seq], [2])[0] for _ in range(3)]  # every draft stops at position 2
    later = [step(policy, [seq], [16])[0] for _ in range(25)]  # then every draft is accepted
    # k = 2 while position 2's early misses are recent, then deeper once they are stale (it stayed at 2 for good)
    assert early[-1] == 2 and later[:8] == [2] * 8 and later[-1] >= 8, (early, later)


def test_population_prior_folds_the_positions_finished_requests_drafted():
    population = PopulationPrior(prior=0.7)
    done = AcceptanceEstimate(0.7, 0.3, alphas=[0.9, 0.8, 0.5], observations=[5, 5, 0])  # position 2 never drafted
    population.fold(done)
    assert population.alphas == pytest.approx([0.9, 0.8])  # the first finished request replaces the prior
    population.fold(AcceptanceEstimate(0.7, 0.3, alphas=[1.0], observations=[3]))
    assert population.alphas == pytest.approx([0.95, 0.8])  # then a running mean (an EMA from the 4th on)
    start = population.start(0.3)
    assert start.table(4) == pytest.approx([0.95, 0.8, 0.8, 0.8]) and start.observations == [0, 0]
    for _ in range(4):
        population.fold(AcceptanceEstimate(0.7, 0.3, alphas=[0.0, 0.0], observations=[9, 9]))
    assert population.start(0.3).table(2) == pytest.approx([0.3, 0.3])  # never below the floor


def test_a_new_request_starts_from_where_finished_requests_ended(tiny_tokenizer):
    policy = AdaptiveDraftPolicy(16, GEMMA_LIKE, max_verify_tokens=32)
    first = make_seq(tiny_tokenizer, "first")
    first_lengths = [step(policy, [first], [16])[0] for _ in range(10)]  # every draft accepted
    second = make_seq(tiny_tokenizer, "second")
    assert step(policy, [second], [16])[0] >= 12 > first_lengths[0], first_lengths  # no warm-up from the prior
    misses = make_seq(tiny_tokenizer, "misses")
    for _ in range(10):
        step(policy, [misses], [0])
    after = step(policy, [make_seq(tiny_tokenizer, "after")], [0])[0]
    assert policy.population.alphas[0] < 0.8 and after > 0  # the misses lowered the start; it still drafts


def test_engine_reports_each_decode_step_cost(make_tiny_model, tiny_tokenizer):
    from specdec.engine.engine import Engine

    model = make_tiny_model("llama")
    policy = RecordingPolicy(3)
    engine = Engine(
        model,
        tiny_tokenizer,
        drafter=make_drafter("ngram", make_tiny_model, "llama"),
        num_speculative_tokens=3,
        draft_policy=policy,
    )
    for prompt in PROMPTS[:2]:
        engine.add_request(list(prompt), SamplingParams(max_tokens=12, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert policy.costs
    for cost in policy.costs:
        assert cost.rows == len(cost.draft_lengths) + sum(cost.draft_lengths)
        assert cost.target_s > 0 and cost.draft_s >= 0
        assert len(cost.contexts) == len(cost.draft_lengths) and all(context >= 4 for context in cost.contexts)


def test_first_drafts_and_reprobes_do_not_count_as_drafter_cost(tiny_tokenizer):
    base = CostModel(ForwardCosts.linear(0.010, 0.0), DrafterCost(per_token_s=0.002, batched=True))
    policy = AdaptiveDraftPolicy(4, base, reprobe_interval=1000)
    seq = make_seq(tiny_tokenizer)
    k = step(policy, [seq], [4])[0]
    policy.observe_step(StepCost(1 + k, (k,), draft_s=5.0, target_s=0.010))  # first draft: prompt prefill
    assert policy.calibration.draft_per_token_s is None
    k = step(policy, [seq], [4])[0]
    policy.observe_step(StepCost(1 + k, (k,), draft_s=0.004 * k, target_s=0.010))  # steady
    assert policy.calibration.draft_per_token_s == pytest.approx(0.8 * 0.002 + 0.2 * 0.004)


def test_costly_drafter_that_always_hits_climbs_to_the_longest_k(tiny_tokenizer):
    """A draft model costing ~0.4 T(1) per token whose drafts all hit: deeper positions, never drafted yet, must
    not stay at the prior (which would make each extra position look barely worth its cost) but take the
    acceptance measured at the deepest drafted one."""
    cost_model = CostModel(ForwardCosts.linear(0.010, 0.015), DrafterCost(per_token_s=0.004, batched=True))
    policy = AdaptiveDraftPolicy(4, cost_model, reprobe_interval=1000)
    seq = make_seq(tiny_tokenizer)
    lengths = [step(policy, [seq], [4])[0] for _ in range(12)]
    assert lengths[-1] == 4, lengths


def test_tree_nodes_are_kept_while_they_pay_for_their_rows():
    """CostModel.tree_nodes: extra tree nodes (acceptance probability = expected tokens they add) best first over the
    batch, kept
    while the step's expected tokens per second grows, never past the knee."""
    flat = CostModel(ForwardCosts.from_ratios(0.01, [1.0] * 8 + [3.0] * 24))  # free rows up to 8, then the knee
    # one sequence, chain of 3 (rows 1 + 3), 2 expected tokens; any acceptance probability > 0 pays while rows stay free
    assert flat.tree_nodes([3], [3], 1, 2.0, [[0.3, 0.2, 0.1, 0.05, 0.01]]) == [4]  # 4 + 4 rows = the knee
    # 5 % more time per row (hand-computed: 2.0 -> 2.3 -> 2.45 tokens over 1.15 -> 1.2 -> 1.25 units of T(1), i.e.
    # 1.739 -> 1.917 -> 1.960 tokens per unit; the third, at 0.08, would make 2.53 / 1.3 = 1.946 < 1.960)
    steep = CostModel(ForwardCosts.linear(0.01, 0.05))
    assert steep.tree_nodes([3], [3], 1, 2.0, [[0.3, 0.15, 0.08]]) == [2]
    assert steep.tree_nodes([3], [3], 1, 2.0, [[0.3, 0.15, 0.1]]) == [3]  # 2.55 / 1.3 = 1.962: just pays
    assert steep.tree_nodes([3], [3], 1, 2.0, [[0.05, 0.04]]) == [0]  # none worth a row
    # two sequences (rows 2 + 5): the best nodes of either go first, 0.3, 0.25, 0.2 (4.75 / 1.45 = 3.276 tokens
    # per unit), then 0.1 would give 4.85 / 1.5 = 3.233
    assert steep.tree_nodes([3, 2], [3, 2], 2, 4.0, [[0.3, 0.2], [0.25, 0.1]]) == [2, 1]
    assert steep.tree_nodes([3, 2], [3, 2], 2, 4.0, [[0.3, 0.06], [0.25, 0.1]]) == [1, 1]  # then 0.1 would not pay
    assert flat.tree_nodes([2], [5], 1, 2.0, [[0.5, 0.5, 0.5]]) == [2]  # 5 rows verified anyway (an unweighed tree)


def test_tree_node_acceptance_probs_are_calibrated_by_what_the_target_accepts(tiny_tokenizer):
    """Acceptance probabilities (draft path probabilities) that the target accepts half as often count half: a node
    at 0.3 that pays at face value no longer pays once the policy has seen the drafter's nodes accepted at half that
    rate."""
    policy = AdaptiveDraftPolicy(3, CostModel(ForwardCosts.linear(0.01, 0.05)))
    seq = make_seq(tiny_tokenizer)
    policy.draft_lengths([seq], batch_size=1)
    assert policy.acceptance_prob_calibration.scale == 1.0
    keep = lambda: policy.tree_nodes([seq], [3], [3], [[0.12]], batch_size=1)  # noqa: E731
    assert keep() == [1]
    for _ in range(40):
        policy.observe_tree_acceptance(4.0, 2)
    assert policy.acceptance_prob_calibration.scale == pytest.approx(0.5, abs=0.02)
    assert keep() == [0]


def test_an_overestimated_drafter_cost_is_measured_again_by_the_probes(tiny_tokenizer):
    """A drafter measured at 20x its cost once (its steps slowed by another process) turns drafting off; a probe
    drafts in two consecutive steps, the second a steady measurement, so the estimate comes back down and the
    always-hitting drafter drafts again (with one-step probes it stayed off: only catch-up steps were timed)."""
    policy = AdaptiveDraftPolicy(4, CostModel(ForwardCosts.linear(0.010, 0.0)), reprobe_interval=4)
    seq = make_seq(tiny_tokenizer)
    lengths = []
    for i in range(120):
        k = step(policy, [seq], [4])[0]  # every draft token hits
        lengths.append(k)
        slow = i < 3  # the first steps: drafting timed at 20 decode steps per token
        policy.observe_step(StepCost(1 + k, (k,), draft_s=(0.2 if slow else 0.001) * k, target_s=0.010))
    assert 0 in lengths[:30]  # switched off by the slow measurements
    assert lengths[-1] == 4 and all(k == 4 for k in lengths[-20:])


def test_no_probes_where_even_perfect_drafts_would_not_pay(tiny_tokenizer):
    """8 requests at k = 0; one surely accepted draft token each would make 16 rows (1.6 decode steps) plus a
    draft forward of half a step: 16 tokens for 2.1 steps' time instead of 8 for 1. So probes could not turn
    drafting on, only make the drafter catch up, and the requests stay at k = 0. Alone, a request gets 2 tokens
    for 1.5 steps, and it probes."""
    costs = CostModel(ForwardCosts.from_ratios(0.01, [1.0] * 8 + [1.6] * 8 + [4.0] * 16),
                      DrafterCost(per_token_s=0.005, batched=True))
    batch = AdaptiveDraftPolicy(4, costs, reprobe_interval=3)
    seqs = [make_seq(tiny_tokenizer, str(i)) for i in range(8)]
    assert all(k == 0 for _ in range(30) for k in step(batch, seqs, [0] * 8))
    alone = AdaptiveDraftPolicy(4, costs, reprobe_interval=3)
    seq = make_seq(tiny_tokenizer)
    assert 1 in [step(alone, [seq], [0])[0] for _ in range(30)]


# ---- a drafter's catch-up (a draft model's prompt prefill) against the request's remaining tokens -----------
CATCHING_UP = CostModel(ForwardCosts.linear(0.010, 0.02),
                        DrafterCost(per_token_s=0.001, per_step_s=0.001, batched=True, catch_up_per_token_s=0.0002))


def seq_with_tokens_left(tokenizer, request_id, max_tokens):
    return new_sequence(request_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens), tokenizer, 256, None, True)


def test_a_catch_up_the_remaining_tokens_cannot_repay_is_not_drafted(tiny_tokenizer):
    """200 catch-up tokens cost 40 ms; a request with 100 tokens left saves ≈ 12 ms per step for ≈ 36 steps, one
    with 3 left only for one step."""
    policy = AdaptiveDraftPolicy(4, CATCHING_UP)
    long, short = seq_with_tokens_left(tiny_tokenizer, "long", 100), seq_with_tokens_left(tiny_tokenizer, "short", 3)
    assert policy.draft_lengths([long], 1, [200])[0] > 0
    assert policy.draft_lengths([short], 1, [0])[0] > 0  # nothing to catch up on: drafts pay at once
    assert policy.draft_lengths([short], 1, [200]) == [0]
    assert policy.draft_lengths([long, short], 2, [200, 200])[1] == 0
    # the fixed policy drafts whatever the catch-up
    assert BatchDraftPolicy(4).draft_lengths([short], 1, [200]) == [4]


def test_probes_catch_up_only_when_the_request_can_repay_it(tiny_tokenizer):
    def probes(max_tokens):
        policy = AdaptiveDraftPolicy(4, CATCHING_UP, reprobe_interval=3)
        seq = seq_with_tokens_left(tiny_tokenizer, "0", max_tokens)
        lengths = []
        for i in range(30):
            k = policy.draft_lengths([seq], 1, [100 + i])[0]  # catch-up grows with every step at k = 0
            if k:
                seq.metrics.record_step(k, 0)  # drafts never hit
            lengths.append(k)
        return lengths

    assert 1 in probes(10_000)[10:]  # a long request probes after k = 0, catching up
    # a short one does not: a surely accepted probe saves 7.8 ms per step for the 2 steps of its 4 tokens, less
    # than the 22 ms of catching up
    assert set(probes(4)[10:]) == {0}


# A draft model at 0.45 of the target's decode step per draft token (Qwen2.5-Coder 0.5B for 1.5B), whose first draft
# prefills a 300-token prompt (150 ms). At the fixed prior (0.7) the best k, 1, saves 2.3 ms per step, 135 ms over
# a request's 100 tokens: not enough; a surely accepted draft token saves 5.3 ms per step, 265 ms.
COSTLY_DRAFTER = CostModel(ForwardCosts.linear(0.010, 0.02),
                           DrafterCost(per_token_s=0.0045, batched=True, catch_up_per_token_s=0.0005))


def test_a_first_draft_is_made_while_no_request_has_measured_acceptance(tiny_tokenizer):
    """Weighed at the fixed prior, the catch-up vetoed every first draft, so a draft model never drafted and its
    acceptance was never measured (Qwen-1.5B with its 0.5B draft model: 0 drafts in 128 tokens on every HumanEval
    prompt). Until some request has measured it, the first draft is weighed as a probe; after that the learned
    estimates decide."""
    policy = AdaptiveDraftPolicy(4, COSTLY_DRAFTER)
    first = seq_with_tokens_left(tiny_tokenizer, "first", 100)
    assert policy.draft_lengths([first], 1, [300]) == [1]
    first.metrics.record_step(1, 0)  # its drafts miss
    for _ in range(3):
        k = policy.draft_lengths([first], 1, [0])[0]
        if k:
            first.metrics.record_step(k, 0)
    later = seq_with_tokens_left(tiny_tokenizer, "later", 100)
    assert policy.draft_lengths([later], 1, [300]) == [0]  # the first request's measured acceptance: not worth it


def test_a_request_whose_catch_up_is_vetoed_is_probed(tiny_tokenizer):
    """A vetoed draft leaves the request at k = 0 as surely as an allocation of 0 does: it is probed every
    reprobe_interval steps (it was never probed: the allocation said k > 0, so its steps at zero were not counted)."""
    policy = AdaptiveDraftPolicy(4, COSTLY_DRAFTER, reprobe_interval=4)
    policy.population.alphas = [0.7] * 4  # some earlier request measured acceptance
    policy.population.requests = [1] * 4
    seq = seq_with_tokens_left(tiny_tokenizer, "0", 100)
    assert policy.cost_model.allocate([policy.estimate(seq).table(4)], 1, 4, 32, [3]) == [1]
    lengths = [policy.draft_lengths([seq], 1, [300])[0] for _ in range(10)]
    assert lengths == [0, 0, 0, 1, 1, 0, 0, 0, 1, 1]  # vetoed at the estimate; two-step probes are kept


def test_a_draft_model_is_priced_at_one_forward_per_draft_token():
    """k draft tokens cost k draft-model forwards: the first also feeds the committed tokens, so there is no
    forward per step besides (counting one made k = 1 cost two forwards, which kept a draft model off). One
    Medusa forward gives every head's token: a cost per step, none per token."""
    from specdec.drafters.base import DrafterCostDescription
    from specdec.engine.draft_length.adaptive import _estimated_drafter_cost

    forward = ForwardCosts.linear(0.040, 0.02)
    per_position = _estimated_drafter_cost(DrafterCostDescription(400, True), forward, 1000)
    assert per_position.per_step_s == 0 and per_position.per_token_s == pytest.approx(0.016)
    assert per_position([3]) == pytest.approx(3 * 0.016)
    per_step = _estimated_drafter_cost(DrafterCostDescription(400, False), forward, 1000)
    assert per_step.per_token_s == 0 and per_step([3]) == pytest.approx(0.016)


def test_catch_up_cost_is_measured_from_the_steps_that_catch_up(tiny_tokenizer):
    base = CostModel(ForwardCosts.linear(0.010, 0.0),
                     DrafterCost(per_token_s=0.002, batched=True, catch_up_per_token_s=0.001))
    calibration = CostCalibration(weight=0.2)
    calibration.observe(base, rows=3, draft_lengths=(2,), draft_s=None, target_s=0.010)  # scale 1
    calibration.observe_catch_up(base, (2,), draft_s=0.004 + 0.1, catch_up_tokens=50)  # 2 ms per catch-up token
    assert calibration.catch_up_per_token_s == pytest.approx(0.8 * 0.001 + 0.2 * 0.002)
    calibration.observe_catch_up(base, (2,), draft_s=5.0, catch_up_tokens=3)  # too few tokens to say anything
    assert calibration.apply(base).drafter.catch_up_per_token_s == pytest.approx(0.0012)
    # the policy feeds it the steps that are not steady drafting
    policy = AdaptiveDraftPolicy(4, base)
    seq = make_seq(tiny_tokenizer)
    k = policy.draft_lengths([seq], 1, [100])[0]
    policy.observe_step(StepCost(1 + k, (k,), draft_s=0.002 * k + 0.5, target_s=0.010, catch_up_tokens=100))
    # 5 ms per token measured, clipped to 3x the profile's estimate in the average
    assert policy.cost_model.drafter.catch_up_per_token_s == pytest.approx(0.8 * 0.001 + 0.2 * 0.003)


# ---- T(n) learned from the steps (ProfileLearner): choices stay sound while the curve is learned --------------
def learning_policy(true_cost, k=16):
    """A policy over a profile measured on a FakeMachine costing true_cost(rows, context) (8 s budget, fake clock)."""
    from specdec.engine.draft_length.measure import profile_costs
    from specdec.engine.draft_length.profile_store import ProfileLearner
    from engine.test_cost_model import FakeMachine

    machine = FakeMachine(true_cost)
    samples = profile_costs(machine, clock=machine.clock).samples
    profile = samples.profile()
    return AdaptiveDraftPolicy(k, CostModel(profile.forward, context=profile.context), learner=ProfileLearner(samples))


def run_steps(policy, tokenizer, true_cost, steps, accepted=lambda step: 16):
    """Steps whose drafts hit up to accepted(step index) tokens, each timed at true_cost(rows, 128); the draft
    lengths, checked against the knee the policy planned with."""
    seq = make_seq(tokenizer)
    seq.max_tokens = 10_000
    lengths = []
    for i in range(steps):
        knee = policy.max_rows
        k = step(policy, [seq], [accepted(i)])[0]
        assert 1 + k <= knee
        lengths.append(k)
        policy.observe_step(StepCost(1 + k, (k,), draft_s=0.0, target_s=true_cost(1 + k, 128), contexts=(128,)))
    return lengths


def test_a_compute_bound_machine_never_drafts_while_its_curve_is_learned(tiny_tokenizer):
    """The scalar kernels (T(n) ≈ n · 130 ms): a draft token costs what it may save, so even drafts that would all
    hit are not drafted, and no probe is either — before or after the steps refine T(1)."""
    from engine.test_cost_model import scalar_like

    policy = learning_policy(scalar_like)
    assert policy.max_rows <= 2
    assert run_steps(policy, tiny_tokenizer, scalar_like, 60) == [0] * 60


def test_a_memory_bound_machine_drafts_long_and_learning_keeps_it(tiny_tokenizer):
    from engine.test_cost_model import avx512_like

    policy = learning_policy(avx512_like)
    lengths = run_steps(policy, tiny_tokenizer, avx512_like, 30)
    assert lengths[-10:] == [16] * 10, lengths
    assert policy.base_cost_model.forward(17) == pytest.approx(avx512_like(17, 128), rel=1e-6)  # measured since


def test_steps_dearer_than_the_profile_shorten_the_drafts(tiny_tokenizer):
    """The profile says rows are nearly free (a quiet moment), the steps find each row costing a decode step (another
    process took the cores' bandwidth, or the profile is stale). Stretches where the drafts miss (k = 0) measure
    T(1); against it, the drafting steps' T(k + 1) / T(1) is learned, and k comes down in the next stretches that
    hit. (The calibration's level alone would keep k: it scales T(1) with T(9).)"""
    from engine.test_cost_model import avx512_like

    policy = learning_policy(avx512_like, k=8)
    compute_bound = lambda rows, context: 0.010 * rows  # noqa: E731
    hits = lambda step: 8 if (step // 30) % 2 == 0 else 0  # noqa: E731  30 steps that hit, 30 that miss, ...
    lengths = run_steps(policy, tiny_tokenizer, compute_bound, 150, hits)
    assert max(lengths[:3]) == 8 and 0 in lengths[30:60]
    assert max(lengths[125:150]) <= 2, lengths  # T(2) <= 2 T(1) in the profile still: one draft token may pay


def test_learning_leaves_the_context_costs_out_of_t(tiny_tokenizer):
    from engine.test_cost_model import avx512_like

    policy = learning_policy(avx512_like)
    before = policy.base_cost_model.forward(5)
    long_step = avx512_like(5, 1128)  # 5 rows after 1128 cached tokens: T(5) + the context's 1000 · 5 µs
    policy.observe_step(StepCost(5, (4,), draft_s=0.0, target_s=long_step, contexts=(1128,)))
    assert policy.base_cost_model.forward(5) == pytest.approx(before, rel=1e-6)
