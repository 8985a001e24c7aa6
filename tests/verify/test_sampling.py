from __future__ import annotations

import math

import torch
from scipy.stats import chisquare

from specdec.config import SamplingParams
from specdec.verify.sampling import (TOP_P_CANDIDATES, greedy_tokens, logits_to_probs, sample, sample_from_uniforms,
                                     sample_token)


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()  # [1, vocab]


def test_temperature_scales_logits() -> None:
    logits = torch.tensor([[0.0, math.log(4.0)]])
    probs = logits_to_probs(logits, SamplingParams(temperature=2.0))
    torch.testing.assert_close(probs, torch.tensor([[1 / 3, 2 / 3]]))


def test_top_k_keeps_k_most_likely() -> None:
    logits = logits_from_probs([0.1, 0.4, 0.2, 0.3])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7]]))


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    logits = logits_from_probs([0.15, 0.5, 0.05, 0.3])
    exactly_two = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.75))
    torch.testing.assert_close(exactly_two, torch.tensor([[0.0, 0.625, 0.0, 0.375]]))
    three = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.81))
    torch.testing.assert_close(three, torch.tensor([[0.15, 0.5, 0.0, 0.3]]) / 0.95)


def test_top_p_over_a_large_vocabulary_keeps_the_prefix_a_whole_sort_gives() -> None:
    """Beyond the candidate tiers' sizes only the most likely tokens are sorted, tier by tier, unless a row's
    nucleus is wider than the last tier."""
    first, last = TOP_P_CANDIDATES[0], TOP_P_CANDIDATES[-1]
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 2 * last, generator=generator)
    logits[:2] *= 12.0  # peaked rows: their nucleus lies among the first tier's candidates
    logits[2:4] *= 2.0  # the second tier's
    logits[4:] *= 0.1  # nearly flat rows: wider than every tier
    probs = torch.softmax(logits, dim=-1)
    top_p = 0.9
    mass = [torch.topk(probs, k, dim=-1).values.sum(-1) for k in (first, last)]
    assert bool((mass[0][:2] >= top_p).all() and (mass[0][2:] < top_p).all())
    assert bool((mass[1][2:4] >= top_p).all() and (mass[1][4:] < top_p).all())
    sorted_probs, sorted_ids = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    expected = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, sorted_ids, mass_before < top_p)
    kept = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p)) > 0
    assert torch.equal(kept, expected)
    sizes = kept.sum(-1).tolist()
    assert max(sizes[:2]) < first < min(sizes[2:4]) and max(sizes[2:4]) < last < min(sizes[4:])


def test_top_p_always_keeps_the_most_likely_token() -> None:
    probs = logits_to_probs(logits_from_probs([0.2, 0.7, 0.1]), SamplingParams(temperature=1.0, top_p=0.01))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0]]))


def test_top_p_applies_after_top_k_and_temperature() -> None:
    # temperature 1: top-k 3 renormalizes [0.4, 0.3, 0.2] to [4/9, 3/9, 2/9]; top-p 0.7 then keeps 2 tokens.
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.7))
    torch.testing.assert_close(probs, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))


def test_greedy_params_give_one_hot_of_argmax_first_on_ties() -> None:
    logits = torch.tensor([[0.1, 3.0, 3.0], [5.0, 1.0, 2.0]])
    probs = logits_to_probs(logits, SamplingParams())
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    assert greedy_tokens(logits).tolist() == [1, 0]


def test_seeded_generator_is_reproducible() -> None:
    probs = torch.full((64, 10), 0.1)  # [n, vocab]
    first = sample(probs, make_generator(1234))
    second = sample(probs, make_generator(1234))
    other_seed = sample(probs, make_generator(4321))
    assert torch.equal(first, second)
    assert not torch.equal(first, other_seed)


def test_sample_follows_probs_and_never_picks_zero_probability() -> None:
    target_probs = torch.tensor([0.5, 0.0, 0.2, 0.3])
    num_samples = 20_000
    token_ids = sample(target_probs.expand(num_samples, -1), make_generator(7))  # [n]
    counts = torch.bincount(token_ids, minlength=4).double()
    assert counts[1] == 0
    kept = [0, 2, 3]
    assert chisquare(counts[kept].numpy(), (target_probs[kept] * num_samples).numpy()).pvalue > 1e-3


def test_sample_takes_unnormalized_rows_and_a_row_of_zeros_gives_token_0() -> None:
    weights = torch.tensor([0.0, 2.0, 0.0, 6.0, 0.0, 0.0])  # zeros first, between and last
    num_samples = 20_000
    token_ids = sample(weights.expand(num_samples, -1), make_generator(11))  # [n]
    counts = torch.bincount(token_ids, minlength=6).double()
    assert counts[[0, 2, 4, 5]].sum() == 0
    assert chisquare(counts[[1, 3]].numpy(), [num_samples / 4, 3 * num_samples / 4]).pvalue > 1e-3
    assert sample(torch.zeros(3, 6), make_generator(0)).tolist() == [0, 0, 0]
    nan_rows = torch.tensor([[float("nan")] * 6, [1.0, float("nan"), 1.0, 0.0, 0.0, 0.0]])
    assert all(0 <= token < 6 for token in sample(nan_rows, make_generator(0)).tolist())


def test_the_draw_is_the_inverse_cumulative_distribution_at_the_uniform() -> None:
    probs = torch.tensor([[0.25, 0.0, 0.5, 0.25]])  # cumulative 0.25, 0.25, 0.75, 1.0
    uniforms = [0.0, 0.2499, 0.25, 0.7499, 0.75, 0.999999]
    drawn = [int(sample_from_uniforms(probs, torch.tensor([u], dtype=torch.float64))[0]) for u in uniforms]
    assert drawn == [0, 0, 2, 2, 3, 3]  # token 1 (probability 0) is never drawn


def test_sample_token_is_a_pure_function_of_logits_params_and_uniform() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.5, 3.0, -1.0]])
    params = SamplingParams(temperature=0.7, top_k=3, top_p=0.9)
    probs = logits_to_probs(logits, params)  # [1, vocab]
    for u in torch.linspace(0, 0.999, 50, dtype=torch.float64).tolist():
        expected = int(sample_from_uniforms(probs, torch.tensor([u], dtype=torch.float64))[0])
        assert sample_token(logits, params, u) == expected == sample_token(logits.clone(), params, u)
    assert {sample_token(logits, params, u) for u in (0.0, 0.5, 0.99)} <= {1, 3}  # top-p keeps two of top-k's three
    assert all(sample_token(logits, SamplingParams(), u) == 3 for u in (0.0, 0.5, 0.99))  # greedy: the argmax
