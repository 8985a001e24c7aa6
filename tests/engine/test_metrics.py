from __future__ import annotations

import pytest

from specdec.engine.metrics import SpecDecodeMetrics


def test_record_step_counts_per_position() -> None:
    metrics = SpecDecodeMetrics()
    metrics.record_step(num_drafted=3, num_accepted=2)
    metrics.record_step(num_drafted=4, num_accepted=0)
    metrics.record_step(num_drafted=0, num_accepted=0)
    assert (metrics.verify_steps, metrics.drafted_tokens, metrics.accepted_tokens) == (3, 7, 2)
    assert metrics.drafted_per_position == [2, 2, 2, 1]
    assert metrics.accepted_per_position == [1, 1, 0, 0]
    assert metrics.acceptance_rate == pytest.approx(2 / 7)
    assert metrics.mean_accepted_length == pytest.approx(1 + 2 / 3)
    assert metrics.position_acceptance_rates == [0.5, 0.5, 0.0, 0.0]


def test_empty_metrics_rates_are_zero() -> None:
    metrics = SpecDecodeMetrics()
    assert (metrics.acceptance_rate, metrics.mean_accepted_length, metrics.position_acceptance_rates) == (0.0, 0.0, [])


def test_record_step_rejects_more_accepted_than_drafted() -> None:
    with pytest.raises(ValueError, match="need 0 <= num_accepted <= num_drafted, got 3 of 2"):
        SpecDecodeMetrics().record_step(num_drafted=2, num_accepted=3)


def test_merge_and_add() -> None:
    first = SpecDecodeMetrics(draft_time_s=1.0)
    first.record_step(2, 2)
    second = SpecDecodeMetrics(target_time_s=2.0, verify_time_s=0.5)
    second.record_step(4, 1)
    total = first + second
    assert total.drafted_per_position == [2, 2, 1, 1]
    assert total.accepted_per_position == [2, 1, 0, 0]
    assert (total.draft_time_s, total.target_time_s, total.verify_time_s) == (1.0, 2.0, 0.5)
    assert first.drafted_per_position == [1, 1]  # __add__ leaves its operands alone
    first.merge(second)
    assert first == total


def test_to_dict_includes_derived_rates() -> None:
    metrics = SpecDecodeMetrics()
    metrics.record_step(2, 1)
    as_dict = metrics.to_dict()
    assert as_dict["acceptance_rate"] == 0.5
    assert as_dict["mean_accepted_length"] == 2.0
    assert as_dict["position_acceptance_rates"] == [1.0, 0.0]
    assert as_dict["accepted_per_position"] == [1, 0]
