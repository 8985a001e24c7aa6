"""Cost model: expected accepted length, the k that maximises tokens per second on synthetic timings, the
batch-aware row budget (knee of T), profiling within a wall-clock budget and learning T(n) online (synthetic
timings on a fake clock), and the JSON profile cache."""
import os
from pathlib import Path

import pytest

from specdec.engine.draft_length import costs, measure, profile_store
from specdec.engine.draft_length.costs import (
    ContextCosts,
    CostCalibration,
    CostModel,
    CostProfile,
    CostSamples,
    DrafterCost,
    ForwardCosts,
    RowSamples,
    expected_accepted_length,
)
from specdec.engine.draft_length.measure import profile_costs
from specdec.engine.draft_length.profile_store import ProfileKey, ProfileLearner

FLAT = ForwardCosts.linear(0.010, 0.0)  # T(n) = 10 ms for n = 1..32
STEEP = ForwardCosts.linear(0.010, 0.5)  # every extra row costs half a decode step


def test_expected_accepted_length_closed_form_and_per_position():
    assert expected_accepted_length(4, 0.8) == pytest.approx(3.3616)
    assert expected_accepted_length(4, 0.8) == pytest.approx((1 - 0.8**5) / (1 - 0.8))
    assert expected_accepted_length(0, 0.9) == 1.0
    assert expected_accepted_length(3, [0.5, 0.5, 0.0]) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_accepted_length(3, [0.5]) == pytest.approx(1 + 0.5 + 0.25 + 0.125)  # last entry repeats


def test_expected_tokens_per_s_formula():
    model = CostModel(ForwardCosts.linear(0.010, 0.1), DrafterCost(per_token_s=0.001))
    # B = 2, k = 3: rows 8 -> T = 10 ms * 1.7; draft 6 tokens * 1 ms
    expected = 2 * expected_accepted_length(3, 0.6) / (0.017 + 0.006)
    assert model.expected_tokens_per_s(3, 0.6, batch=2) == pytest.approx(expected)


def test_picks_zero_when_drafts_never_hit():
    assert CostModel(FLAT).best_k(0.0, max_k=8) == 0
    assert CostModel(ForwardCosts.linear(0.010, 0.02)).best_k(0.01, max_k=8) == 0


def test_long_k_when_drafts_always_hit_and_t_is_flat():
    assert CostModel(FLAT).best_k(1.0, max_k=12) == 12
    assert CostModel(FLAT).best_k(0.95, max_k=12) == 12


def test_k_shrinks_as_t_rises_steeply():
    gentle = CostModel(ForwardCosts.linear(0.010, 0.05)).best_k(0.8, max_k=16)
    steep = CostModel(STEEP).best_k(0.8, max_k=16)
    assert gentle > steep >= 1
    assert CostModel(ForwardCosts.linear(0.010, 1.0)).best_k(0.8, max_k=16) == 0  # compute-bound: T(n) = n T(1)


def test_draft_cost_shortens_k():
    cheap = CostModel(ForwardCosts.linear(0.010, 0.02)).best_k(0.7, max_k=16)
    costly = CostModel(ForwardCosts.linear(0.010, 0.02), DrafterCost(per_token_s=0.003, batched=True)).best_k(
        0.7, max_k=16
    )
    assert cheap > costly


def test_knee_of_measured_curve():
    assert STEEP.knee(2.0) == 3  # T(3) = 2 T(1)
    assert FLAT.knee() == 32  # never beyond the measured range
    assert ForwardCosts((1.0, 1.1, 1.2, 2.5, 3.0)).knee(2.0) == 3


@pytest.mark.parametrize("batch", [1, 2, 4, 8, 12, 16, 24])
def test_batch_rows_stay_within_the_knee(batch):
    model = CostModel(ForwardCosts.from_ratios(0.01, [1 + 0.01 * n for n in range(16)] + [3.0] * 16))  # knee 16
    assert model.max_rows == 16
    lengths = model.allocate([0.9] * batch, batch, max_k=8)
    assert batch + sum(lengths) <= max(16, batch)
    if batch >= 16:
        assert lengths == [0] * batch


def test_k_shrinks_with_batch():
    model = CostModel(ForwardCosts.linear(0.010, 0.01))
    ks = [model.best_k(0.8, batch=b, max_k=8) for b in (1, 4, 8, 16, 32)]
    assert ks == sorted(ks, reverse=True) and ks[0] == 8 and ks[-1] == 0


def test_allocation_prefers_requests_whose_drafts_hit():
    lengths = CostModel(ForwardCosts.linear(0.010, 0.05)).allocate([0.95, 0.05], batch_size=2, max_k=8)
    assert lengths[0] > 0 and lengths[1] == 0


def test_fallback_matches_batch_policy_row_budget():
    fallback = CostModel.fallback(max_verify_tokens=32)
    assert fallback.max_rows == 32
    assert [fallback.best_k(0.7, b, max_k=5) for b in (1, 4, 8, 32)] == [5, 5, 3, 0]


def test_forward_costs_extrapolate():
    costs = ForwardCosts((1.0, 2.0, 3.0))
    assert costs(5) == pytest.approx(5.0)
    with pytest.raises(ValueError):
        ForwardCosts((1.0, 0.0))


def test_profile_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    key = ProfileKey("tiny@files:abc", "q8", 2, "Some CPU")
    assert profile_store.load_profile(key) is None
    path = profile_store.save_profile(key, CostProfile(ForwardCosts((0.01, 0.011))))
    assert path.parent == tmp_path / "specdec" / "costs" and path.suffix == ".json"
    assert profile_store.load_profile(key) == CostProfile(ForwardCosts((0.01, 0.011)))
    with_context = CostProfile(ForwardCosts((0.01, 0.011)), ContextCosts(128, (1e-6, 2e-6)))
    profile_store.save_profile(key, with_context)
    assert profile_store.load_profile(key) == with_context
    other = ProfileKey("tiny@files:abc", "q8", 4, "Some CPU")  # another thread count: another profile
    assert profile_store.load_profile(other) is None


def test_forward_timings_interleave_the_row_counts(make_tiny_model):
    """Rounds of n = 1..N (not all repeats of one n, then the next): a slow spell of the machine then touches
    every row count alike instead of bending the curve."""
    from specdec.cache.kv_cache import KVCache

    model = make_tiny_model("llama")
    rows_seen = []
    forward = model.forward

    def recording_forward(batch, cache):
        rows_seen.append(len(batch.token_ids))
        return forward(batch, cache)

    model.forward = recording_forward
    seconds = measure.forward_seconds(model, KVCache(model.config, 2, 32, model.device), 1, 8, 3, repeats=2)
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    # prefill, warm-ups, then two rounds in which every n is timed right after one row
    assert rows_seen == [8] + [1, 2, 3] + [1, 1, 1, 2, 1, 3] * 2


def test_context_costs_grow_with_context_and_rows():
    context = ContextCosts(128, (1e-6, 2e-6, 4e-6))
    assert context(1, 100) == 0.0 and context(1, 128) == 0.0  # the profile's T(n) already holds 128 tokens
    assert context(2, 628) == pytest.approx(500 * 2e-6)
    assert context(5, 228) == pytest.approx(100 * 8e-6)  # beyond the measured rows: the last slope (2e-6 per row)
    assert context.scaled(2.0)(3, 228) == pytest.approx(100 * 8e-6)
    with pytest.raises(ValueError):
        ContextCosts(128, (1e-6, -1e-6))


def test_long_contexts_shorten_the_draft():
    """Rows that each attend a long context cost more: the same acceptance buys a shorter draft there (and the
    model without context costs plans the same k at any context)."""
    rows_cost = ForwardCosts.linear(0.010, 0.02)  # 2 % of a decode step per extra row at the base context
    attention = ContextCosts(128, tuple(2e-6 * n for n in range(1, 33)))  # + 2 µs per row and context token
    with_context = CostModel(rows_cost, context=attention)
    short = with_context.allocate([0.8], 1, 16, contexts=[128])[0]
    long = with_context.allocate([0.8], 1, 16, contexts=[2000])[0]
    assert long < short
    assert CostModel(rows_cost).allocate([0.8], 1, 16, contexts=[2000])[0] == short
    assert with_context.step_seconds([4], 1, [2000]) == pytest.approx(rows_cost(5) + 1872 * 2e-6 * 5)


def test_calibration_counts_the_context_of_a_step():
    """A step that costs exactly what the profile says at its context leaves the level at 1."""
    model = CostModel(
        ForwardCosts.linear(0.010, 0.05), context=ContextCosts(128, tuple(1e-6 * n for n in range(1, 33)))
    )
    calibration = CostCalibration()
    calibration.observe(model, 9, (8,), None, model.target_seconds(9, (8,), (1128,)), (1128,))
    assert calibration.target_scale == pytest.approx(1.0)
    scaled = calibration.apply(model)
    assert scaled.context == model.context


def test_allocation_counts_the_tokens_of_the_rest_of_the_batch():
    """One speculating request beside 7 others (not speculating, or about to join): its draft rows slow the whole
    step, so they must pay against the batch's 8 tokens per step. Counting its own tokens only, 1.2 / T(9) beat
    1 / T(8) and the draft model prefilled a prompt for drafts that slowed the batch."""
    model = CostModel(ForwardCosts.linear(0.010, 0.05))
    assert model.allocate([0.2], batch_size=1, max_k=4)[0] > 0  # alone, even weak drafts pay
    assert model.allocate([0.2], batch_size=8, max_k=4) == [0]  # 8.2 / T(9) < 8 / T(8)
    assert model.allocate([0.9], batch_size=8, max_k=4)[0] > 0


# ---- profiling within a budget, and T(n) learned from the engine's steps (synthetic timings, fake clock) ---------
class FakeMachine:
    """time_forward for profile_costs: each forward advances a fake clock by cost(rows, context) seconds."""

    def __init__(self, cost):
        self.cost = cost
        self.now = 0.0
        self.forwards = []  # (rows, context) in call order

    def clock(self):
        return self.now

    def __call__(self, rows, context):
        seconds = self.cost(rows, context)
        self.now += seconds
        self.forwards.append((rows, context))
        return seconds


def scalar_like(rows, context):
    """Compute-bound, as the scalar kernels: ~130 ms per row, plus 40 µs per row and context token."""
    return rows * (0.130 + 40e-6 * context)


def avx512_like(rows, context):
    """Memory-bound: 10 ms for the weights, 0.4 ms per extra row, 1 µs per row and context token."""
    return 0.010 + 0.0004 * (rows - 1) + 1e-6 * rows * context


def test_row_samples_curve_interpolates_and_bounds_the_unmeasured_counts():
    samples = RowSamples({1: 10.0, 2: 11.0, 4: 12.0, 8: 20.0}, {1: 1, 2: 1, 4: 1, 8: 1}, max_rows=16)
    curve = samples.curve()
    assert curve[:8] == pytest.approx((10.0, 11.0, 11.5, 12.0, 14.0, 16.0, 18.0, 20.0))  # linear between
    assert curve[15] == pytest.approx(40.0)  # beyond 8: T(8) · n / 8, rows cost what the measured ones do on average
    # never below what fewer rows were measured to cost; a count below the smallest measured takes its value
    assert RowSamples({2: 10.0, 3: 9.0}, {2: 1, 3: 1}, max_rows=4).curve() == pytest.approx((10.0, 10.0, 10.0, 40 / 3))


def test_profiling_respects_the_budget_on_a_compute_bound_machine():
    machine = FakeMachine(scalar_like)
    run = profile_costs(machine, budget_s=8.0, clock=machine.clock)
    assert run.seconds == machine.now <= 8.0
    timed = run.samples.forward.values
    assert set(timed) == {1, 2, 3, 4}  # T(4) > 3 T(1): no more rows are timed, no step verifies that many
    assert run.samples.forward.counts[2] >= 2  # the budget goes to more rounds of the counts that matter
    assert run.samples.context is not None and 1 in run.samples.context.values
    profile = run.samples.profile()
    for n in range(1, 33):  # never cheaper than the real cost, where measured or not
        assert profile.forward(n) >= scalar_like(n, 128) * (1 - 1e-9), n
    assert profile.forward.knee() == 2  # and the policy sees a compute-bound machine
    assert profile.context(1, 1128) == pytest.approx(1000 * 40e-6, rel=1e-6)
    assert "T(n) at n = 1, 2, 3, 4" in run.summary()


def test_profiling_a_fast_machine_times_every_count_within_the_budget():
    machine = FakeMachine(avx512_like)
    run = profile_costs(machine, budget_s=8.0, clock=machine.clock)
    assert machine.now <= 8.0 and run.rounds == 5
    assert set(run.samples.forward.values) == set(measure.PROFILE_ROW_COUNTS)
    assert set(run.samples.context.values) == set(measure.CONTEXT_PROFILE_ROWS)
    profile = run.samples.profile()
    assert profile.forward(8) == pytest.approx(avx512_like(8, 128), rel=1e-9)
    assert profile.forward(5) >= avx512_like(5, 128) * (1 - 1e-9)  # interpolated between 4 and 6
    assert profile.context(4, 1128) == pytest.approx(1000 * 4e-6, rel=1e-6)


def test_profiling_within_a_small_budget_times_the_smallest_counts_first():
    machine = FakeMachine(avx512_like)
    run = profile_costs(machine, budget_s=0.2, clock=machine.clock)
    assert machine.now <= 0.2
    assert {1, 2, 4} <= set(run.samples.forward.values) and 32 not in run.samples.forward.values


def test_a_forward_longer_than_the_budget_is_all_there_is():
    machine = FakeMachine(lambda rows, context: 20.0 * rows)
    run = profile_costs(machine, budget_s=8.0, clock=machine.clock)
    assert machine.forwards == [(1, 128)]  # the warm-up: nothing else fits
    assert run.samples.one_row_s == 20.0 and run.samples.forward.values == {1: 1.0} and run.samples.context is None
    assert run.samples.profile().forward(4) == pytest.approx(80.0)  # n · T(1): no drafting will look cheap


def test_measure_cost_profile_on_a_tiny_model_needs_no_prefill(make_tiny_model):
    model = make_tiny_model("llama")
    rows_seen = []
    forward = model.forward
    model.forward = lambda batch, cache: (rows_seen.append(len(batch.token_ids)), forward(batch, cache))[1]
    try:
        run = measure.measure_cost_profile(model, budget_s=1.0, repeats=1)
    finally:
        del model.forward
    assert max(rows_seen) <= 32  # the context is random keys and values in the cache, not a prefill
    assert 1 in run.samples.forward.values and run.samples.profile().forward.max_rows == costs.MAX_PROFILE_ROWS


def measured_flat_to_four():
    """A profile that timed only n = 1, 2, 4 (10 ms each, say a slow first round): T(n) beyond is 10 ms · n / 4."""
    return CostSamples(0.010, RowSamples({1: 1.0, 2: 1.0, 4: 1.0}, {1: 3, 2: 3, 4: 3}), one_row_count=3)


def forward_of(learner):
    return learner.profile().forward


def test_online_measurements_move_the_curve_towards_measured_costs():
    learner = ProfileLearner(measured_flat_to_four())
    assert forward_of(learner)(8) == pytest.approx(0.020) and forward_of(learner).knee() == 8
    assert not learner.observe(8, 0.011)  # no one-row step yet: no level to measure 8 rows against
    for _ in range(100):
        learner.observe(1, 0.010)  # one row: T(1)
        learner.observe(8, 0.011)  # 8 rows really cost 11 ms, 1.1 T(1)
    assert learner.samples.forward.values[8] == pytest.approx(1.1, rel=0.01)  # from the bound of 2 T(1)
    assert forward_of(learner)(6) == pytest.approx(0.0105, rel=0.01)  # between the measured 4 and 8
    assert (
        forward_of(learner)(16) == pytest.approx(0.022, rel=0.01) and forward_of(learner).knee() == 14
    )  # 1.1 · 14 / 8
    count = learner.samples.one_row_count
    learner.observe(1, 0.020)  # a lone slow one-row step moves T(1) by the weight of one of its measurements
    assert learner.samples.one_row_s == pytest.approx(0.010 + max(1 / 32, 1 / (count + 1)) * 0.010)


def test_a_slow_spell_moves_the_level_but_not_the_shape():
    """Steps at 8 rows during a slow spell cost twice as much, and so do the one-row steps between them: T(8) / T(1)
    stays. (Against the profile's T(1) instead, a spell would bend the curve — and one in which only T(1) was
    measured left T(2) at 7x T(1), and the policy never drafted again.) Steps far from any one-row step say nothing
    about the shape."""
    learner = ProfileLearner(measured_flat_to_four())
    for _ in range(100):
        learner.observe(1, 2 * 0.010)
        for _ in range(3):
            learner.observe(8, 2 * 0.011)
    assert learner.samples.forward.values[8] == pytest.approx(1.1, rel=0.01)
    assert learner.samples.one_row_s == pytest.approx(0.020, rel=0.01)  # the level, learned
    for _ in range(learner.level_horizon):
        learner.observe(8, 0.011)
    assert not learner.observe(8, 0.011)  # 17 steps after the last one-row step: its level is stale


def test_online_measurements_never_make_the_curve_cheaper_than_measured():
    learner = ProfileLearner(measured_flat_to_four())
    learner.observe(1, 0.010)
    learner.observe(3, 0.001)  # a step that looks 10x cheaper than T(2) measured
    assert forward_of(learner)(3) == pytest.approx(0.010)  # more rows never cost less than fewer measured
    learner.observe(16, 0.001)  # first step at 16 rows: from the bound (4 T(1)) as one observation,
    assert learner.samples.forward.values[16] == pytest.approx((4.0 + 4.0 / 3) / 2)  # the step clipped to a third
    for _ in range(5000):
        learner.observe(1, 0.0001)  # many steps: the EMA follows, but each within max_jump of the estimate
    assert forward_of(learner)(1) == pytest.approx(0.0001, rel=0.01) and forward_of(learner)(3) >= forward_of(learner)(
        2
    )
    learner.observe(1, 0.0001)
    learner.observe(1, 0.0001)
    learner.observe(1, 0.001)  # a lone slow one-row step does not set the level: the median of the last 5 does
    learner.observe(2, 0.0001)
    assert learner.samples.forward.values[2] == pytest.approx(1.0)


def test_online_measurements_skip_steps_that_mostly_measure_the_context():
    learner = ProfileLearner(measured_flat_to_four())
    learner.observe(1, 0.010)
    assert not learner.observe(2, 0.030, context_s=0.020)  # two thirds of it the sequences' long contexts
    assert learner.observe(2, 0.030, context_s=0.012)  # T(2) = 18 ms of it
    assert learner.samples.forward.values[2] == pytest.approx(1.0 + 0.25 * 0.8)


def test_learned_profile_is_saved_back_and_read_by_the_next_process(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    key = ProfileKey("tiny@files:abc", "q8", 2, "Some CPU")
    now = [0.0]
    learner = ProfileLearner(measured_flat_to_four(), key, save_every=4, min_save_interval_s=10.0,
                             clock=lambda: now[0])
    learner.observe(1, 0.011)
    for _ in range(2):
        learner.observe(8, 0.012)
        assert learner.save_if_due() is None
    learner.observe(8, 0.012)
    assert learner.save_if_due() is not None  # the 4th new measurement
    loaded = profile_store.load_profile(key)
    assert loaded.forward == forward_of(learner) and loaded.samples.forward.counts[8] == 4  # the bound + 3 steps
    assert loaded.samples.one_row_count == 4 and loaded.samples.one_row_s == pytest.approx(0.01025)
    for _ in range(4):
        learner.observe(8, 0.012)
    assert learner.save_if_due() is None  # 4 more, but within 10 s of the last save
    now[0] = 11.0
    assert learner.save_if_due() is not None


def test_first_use_profiles_within_the_budget_and_caches(make_tiny_model, tmp_path, monkeypatch, capsys):
    """Without a cached profile a named model is profiled once within the budget (not planned with the flat
    fallback), the line on stderr says what and how long, and the profile is cached under its key with its
    samples; the next policy reads it without measuring and learns from it."""
    from specdec.engine.draft_length.adaptive import _cached_cost_model, build_draft_policy

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = make_tiny_model("llama")
    budgets = []

    def fake_measure(target, budget_s, known=None):
        budgets.append(budget_s)
        machine = FakeMachine(avx512_like)
        return profile_costs(machine, budget_s, clock=machine.clock, known=known)

    monkeypatch.setattr(profile_store, "measure_cost_profile", fake_measure)
    first = _cached_cost_model(model, None, "tiny-llama", "q8", 32)
    assert budgets == [measure.PROFILE_BUDGET_S] and first.forward.max_rows == costs.MAX_PROFILE_ROWS
    assert first.knee_ratio != float("inf") and first.forward(8) == pytest.approx(avx512_like(8, 128))
    line = capsys.readouterr().err
    assert line.startswith("[profiling the forward costs of tiny-llama (at most 8 s") and "T(n) at n = 1, 2" in line
    assert len(list((tmp_path / "specdec" / "costs").glob("tiny-llama-q8-*.json"))) == 1
    policy = build_draft_policy("adaptive", 4, 32, model, None, "tiny-llama")
    assert len(budgets) == 1 and policy.base_cost_model.forward == first.forward
    assert policy.learner is not None and policy.learner.key.model.startswith("tiny-llama@")
    assert _cached_cost_model(model, None, None, "q8", 32).knee_ratio == float("inf")  # no name: the fallback
    assert build_draft_policy("adaptive", 4, 32, model, None, None).learner is None


def test_a_profile_cut_short_by_its_budget_is_continued_at_the_next_start(
    make_tiny_model, tmp_path, monkeypatch, capsys
):
    """A machine where a forward costs about 0.3 s whatever its rows: the first start's 8 s time most counts, some
    once; the next starts time the rest, and those again, within 4 s each (as ratios to T(1): the level of a slower
    start does not matter), until nothing is left to time and a start measures nothing."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    levels = iter([1.0] + [2.0] * 20)  # later starts on a machine twice as slow (another process on the cores)
    budgets = []

    def fake_measure(target, budget_s, known=None):
        level = next(levels)
        machine = FakeMachine(lambda rows, context: level * (0.3 + 0.005 * rows + 1e-6 * rows * context))
        run = profile_costs(machine, budget_s, clock=machine.clock, known=known)
        assert machine.now <= budget_s
        budgets.append(budget_s)
        return run

    monkeypatch.setattr(profile_store, "measure_cost_profile", fake_measure)
    key = ProfileKey.current("tiny-llama", "q8")
    model = make_tiny_model("llama")
    profile = profile_store.load_or_measure(model, key)
    assert measure.untimed_row_counts(profile.samples) and 32 in profile.samples.forward.values  # largest first
    assert "[profiling the forward costs of tiny-llama" in capsys.readouterr().err
    for _ in range(16):
        profile = profile_store.load_or_measure(model, key)
    assert "[continuing the cost profile of tiny-llama" in capsys.readouterr().err
    assert budgets[0] == 8.0 and set(budgets[1:]) == {4.0} and len(budgets) < 16  # then no start measured anything
    assert not measure.untimed_row_counts(profile.samples)
    assert min(profile.samples.forward.counts.values()) >= measure.MIN_PAIRS
    for n in range(1, 33):  # the ratios of every start, at the first start's T(1)
        assert profile.forward(n) == pytest.approx(0.3 + 0.005 * n + 1e-6 * n * 128, rel=1e-9), n
    assert profile.context(8, 1128) == pytest.approx(8e-3, rel=1e-6)  # timed by the first start


def test_starts_that_time_nothing_new_stop_continuing(make_tiny_model, tmp_path, monkeypatch):
    """The profile says a pair fits a continuing start's budget, the machine is too slow for it now: after
    MAX_IDLE_CONTINUATIONS such starts the profile is used as it is."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    key = ProfileKey.current("tiny-llama", "q8")
    profile_store.save_profile(key, CostSamples(0.1, RowSamples({1: 1.0}, {1: 5})).profile())  # 2 missing: 0.1 s each
    starts = []

    def fake_measure(target, budget_s, known=None):
        machine = FakeMachine(lambda rows, context: 3.0)  # 3 s forwards today
        starts.append(profile_costs(machine, budget_s, clock=machine.clock, known=known))
        return starts[-1]

    monkeypatch.setattr(profile_store, "measure_cost_profile", fake_measure)
    for _ in range(5):
        profile = profile_store.load_or_measure(make_tiny_model("llama"), key)
    assert len(starts) == measure.MAX_IDLE_CONTINUATIONS and starts[-1].forward_timed == ()
    assert profile.samples.forward.values == {1: 1.0}


def test_a_profile_nothing_more_fits_in_is_not_continued(make_tiny_model, tmp_path, monkeypatch):
    """T(1) = 6 s (a big model on the scalar kernels): the first start timed the warm-up only; later starts would
    spend their budget timing nothing new, so they use it as it is."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    key = ProfileKey.current("tiny-llama", "q8")
    profile_store.save_profile(key, CostSamples(6.0, RowSamples({1: 1.0}, {1: 1})).profile())
    monkeypatch.setattr(profile_store, "measure_cost_profile", lambda *args, **kwargs: pytest.fail("measured again"))
    assert profile_store.load_or_measure(make_tiny_model("llama"), key).forward(2) == pytest.approx(12.0)


def _foreign_load_readings(machine_busy_s: list[float], own_cpu_s: list[float], clock: list[float]):
    """A ForeignLoad reading the given sequences: one value per read, then the last one again."""
    def reader(values):
        return lambda: values.pop(0) if len(values) > 1 else values[0]

    return profile_store.ForeignLoad(machine_busy_s=reader(machine_busy_s), own_cpu_s=reader(own_cpu_s),
                                     clock=reader(clock))


def test_foreign_load_is_the_machines_cpu_time_less_our_own_over_the_wall_time():
    # 10 s of wall time: the machine used 25 s of CPU, this process 19 s of it -> 0.6 cores of other processes
    load = _foreign_load_readings([100.0, 125.0], [50.0, 69.0], [0.0, 10.0]).start()
    assert load.cores() == pytest.approx(0.6) and load.too_busy()
    quiet = _foreign_load_readings([100.0, 120.2], [50.0, 70.0], [0.0, 10.0]).start()
    assert quiet.cores() == pytest.approx(0.02) and not quiet.too_busy()
    unknown = _foreign_load_readings([None, None], [0.0, 1.0], [0.0, 1.0]).start()  # no /proc/stat
    assert unknown.cores() is None and not unknown.too_busy()


def test_proc_stat_reads_as_seconds_of_cpu_time(monkeypatch):
    monkeypatch.undo()  # the real /proc/stat, which the autouse fixture hides from the other tests
    if not Path("/proc/stat").exists():
        pytest.skip("no /proc/stat on this system")
    first = profile_store._machine_busy_s()
    sum(i * i for i in range(200_000))  # some CPU time of our own
    second = profile_store._machine_busy_s()
    assert isinstance(first, float) and 0 < first <= second
    load = profile_store.ForeignLoad().start()
    assert load.cores() is None or load.cores() >= 0


def test_a_profile_measured_on_a_busy_machine_serves_the_process_and_is_not_saved(make_tiny_model, tmp_path,
                                                                                   monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    busy_cpu = iter(range(0, 10**9, 10**6))  # every read: another 10^6 s of the machine's CPU time
    monkeypatch.setattr(profile_store, "_machine_busy_s", lambda: float(next(busy_cpu)))
    key = ProfileKey("tiny@files:busy", "q8", 2, "Some CPU")
    profile = profile_store.load_or_measure(make_tiny_model("llama"), key, budget_s=0.5)
    assert profile.forward(1) > 0
    assert "cores busy while profiling" in capsys.readouterr().err
    assert profile_store.load_profile(key) is None


def test_learned_samples_are_not_saved_from_a_busy_window(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    key = ProfileKey("tiny@files:abc", "q8", 2, "Some CPU")
    machine_cpu = [0.0]
    learner = ProfileLearner(measured_flat_to_four(), key, save_every=2, min_save_interval_s=0.0,
                             foreign_load=profile_store.ForeignLoad(machine_busy_s=lambda: machine_cpu[0],
                                                                    own_cpu_s=lambda: 0.0).start())
    learner.observe(1, 0.011)
    machine_cpu[0] += 1e6  # another process ran meanwhile
    learner.observe(8, 0.012)
    assert learner.save_if_due() is None and profile_store.load_profile(key) is None
    learner.observe(1, 0.011)
    learner.observe(8, 0.012)
    assert learner.save_if_due() is not None  # a quiet window: saved


def test_own_cpu_time_counts_the_live_processes_we_started(monkeypatch):
    """A tensor-parallel rank is a child process working for us: its CPU time is not other processes' load."""
    import subprocess
    import sys

    if not Path("/proc/self/task").exists():
        pytest.skip("no /proc on this system")
    before = profile_store._own_cpu_s()
    burn = ("import time, sys\nwhile time.process_time() < 0.4: pass\nprint('burnt', flush=True)\n"
            "sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "burnt"  # it used 0.4 s of CPU and is still alive
        assert child.pid in profile_store._descendants(os.getpid())
        assert profile_store._own_cpu_s() - before >= 0.3  # /proc counts whole clock ticks
    finally:
        child.communicate("")


def test_a_profile_is_keyed_by_the_format_the_layers_load_in():
    """auto's layers differ per kernel path (q5 for Q5_0 layers on the avx2 path): the key holds the format as this
    process loads it, so an auto profile measured on q8 layers is not reused for q5 ones."""
    from specdec.kernels import avx_vnni_active, forced_isa, supported_isas

    assert ProfileKey.current("tiny-llama", "q8").weight_format == "q8"
    for isa in supported_isas():
        with forced_isa(isa):
            expected = "q5" if isa == "avx2" and not avx_vnni_active() else "auto"
            assert ProfileKey.current("tiny-llama", "auto").weight_format == expected, isa
