"""Cost model: expected accepted length, the k that maximises tokens per second on synthetic timings, the
batch-aware row budget (knee of T), and the JSON profile cache."""
import pytest

from specdec.engine import cost_model
from specdec.engine.cost_model import (
    ContextCosts,
    CostCalibration,
    CostModel,
    CostProfile,
    DrafterCost,
    ForwardCosts,
    ProfileKey,
    expected_accepted_length,
)

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
    costly = CostModel(ForwardCosts.linear(0.010, 0.02), DrafterCost(per_token_s=0.003, batched=True)).best_k(0.7, max_k=16)
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


def test_forward_costs_extrapolate_and_monotone():
    costs = ForwardCosts((1.0, 2.0, 3.0))
    assert costs(5) == pytest.approx(5.0)
    assert cost_model.monotone([1.0, 5.0, 2.0, 3.0]) == (1.0, 2.0, 2.0, 3.0)
    with pytest.raises(ValueError):
        ForwardCosts((1.0, 0.0))


def test_profile_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    key = ProfileKey("tiny@files:abc", "q8", 2, "Some CPU")
    assert cost_model.load_profile(key) is None
    path = cost_model.save_profile(key, CostProfile(ForwardCosts((0.01, 0.011))))
    assert path.parent == tmp_path / "specdec" / "costs" and path.suffix == ".json"
    assert cost_model.load_profile(key) == CostProfile(ForwardCosts((0.01, 0.011)))
    with_context = CostProfile(ForwardCosts((0.01, 0.011)), ContextCosts(128, (1e-6, 2e-6)))
    cost_model.save_profile(key, with_context)
    assert cost_model.load_profile(key) == with_context
    other = ProfileKey("tiny@files:abc", "q8", 4, "Some CPU")  # another thread count: another profile
    assert cost_model.load_profile(other) is None


def test_measure_forward_costs_on_tiny_model(make_tiny_model):
    costs = cost_model.measure_forward_costs(make_tiny_model("llama"), max_rows=6, context=8, repeats=1)
    assert costs.max_rows == 6 and all(a <= b for a, b in zip(costs.seconds, costs.seconds[1:]))


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
    seconds = cost_model.forward_seconds(model, KVCache(model.config, 2, 32, model.device), 1, 8, 3, repeats=2)
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    # prefill, warm-ups, then two rounds in which every n is timed right after one row
    assert rows_seen == [8] + [1, 2, 3] + [1, 1, 1, 2, 1, 3] * 2


def test_adaptive_policy_measures_and_caches_a_missing_profile(make_tiny_model, tmp_path, monkeypatch):
    """Without a cached profile a named model is profiled once (not planned with the flat fallback) and the
    profile is cached under its key; the next policy reads it without measuring."""
    from specdec.engine.adaptive import _cached_cost_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = make_tiny_model("llama")
    measured = []
    real_measure = cost_model.measure_forward_costs

    def measure(target, **kwargs):
        measured.append(target)
        return real_measure(target, max_rows=kwargs["max_rows"], context=8, repeats=1)

    monkeypatch.setattr(cost_model, "measure_forward_costs", measure)
    first = _cached_cost_model(model, None, "tiny-llama", "q8", 32)
    assert measured == [model] and first.forward.max_rows == cost_model.MAX_PROFILE_ROWS
    assert first.knee_ratio != float("inf")
    assert len(list((tmp_path / "specdec" / "costs").glob("tiny-llama-q8-*.json"))) == 1
    second = _cached_cost_model(model, None, "tiny-llama", "q8", 32)
    assert len(measured) == 1 and second.forward == first.forward
    assert _cached_cost_model(model, None, None, "q8", 32).knee_ratio == float("inf")  # no name: the fallback


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
    model = CostModel(ForwardCosts.linear(0.010, 0.05), context=ContextCosts(128, tuple(1e-6 * n for n in range(1, 33))))
    calibration = CostCalibration()
    calibration.observe(model, 9, (8,), None, model.target_seconds(9, (8,), (1128,)), (1128,))
    assert calibration.target_scale == pytest.approx(1.0)
    scaled = calibration.apply(model)
    assert scaled.context == model.context


def test_measure_context_costs_on_tiny_model(make_tiny_model):
    model = make_tiny_model("llama")
    forward = cost_model.measure_forward_costs(model, max_rows=10, context=8, repeats=1)
    context = cost_model.measure_context_costs(model, forward, base_context=8, long_context=64, repeats=1)
    assert context.base_context == 8 and len(context.per_token_s) == 8  # rows 1..8 (timed: 1, 2, 4, 8)
    assert all(a <= b for a, b in zip(context.per_token_s, context.per_token_s[1:]))


def test_allocation_counts_the_tokens_of_the_rest_of_the_batch():
    """One speculating request beside 7 others (not speculating, or about to join): its draft rows slow the whole
    step, so they must pay against the batch's 8 tokens per step. Counting its own tokens only, 1.2 / T(9) beat
    1 / T(8) and the draft model prefilled a prompt for drafts that slowed the batch."""
    model = CostModel(ForwardCosts.linear(0.010, 0.05))
    assert model.allocate([0.2], batch_size=1, max_k=4)[0] > 0  # alone, even weak drafts pay
    assert model.allocate([0.2], batch_size=8, max_k=4) == [0]  # 8.2 / T(9) < 8 / T(8)
    assert model.allocate([0.9], batch_size=8, max_k=4)[0] > 0
