"""The counter-based random numbers of sampled requests (verify/noise.py): pure functions of (seed, stream,
output index), uniform and independent (chi-square, with a negative control)."""
import pytest
import torch
from scipy.stats import chisquare

from specdec.verify.noise import NoiseStream, RequestNoise, counter_uniform, random_seed, splitmix64, stream_key

NUM_NUMBERS = 20_000


def test_splitmix64_matches_the_reference_sequence():
    # SplitMix64 seeded with 0 (Steele et al. 2014; Vigna's splitmix64.c): its first two outputs
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4


def test_a_number_depends_only_on_seed_stream_and_index():
    noise = RequestNoise(1234)
    assert noise.target(7) == RequestNoise(1234).target(7) == counter_uniform(stream_key(1234, NoiseStream.TARGET), 7)
    assert noise.uniforms(NoiseStream.ACCEPT, 3, 4) == [noise.uniform(NoiseStream.ACCEPT, i) for i in range(3, 7)]
    numbers = {noise.uniform(stream, index) for stream in NoiseStream for index in range(100)}
    numbers |= {RequestNoise(seed).target(0) for seed in range(100)}
    assert len(numbers) == 4 * 100 + 100  # every (seed, stream, index) its own number
    assert all(0.0 <= u < 1.0 for u in numbers)
    assert RequestNoise(-1).target(0) == RequestNoise(2**64 - 1).target(0)  # seeds are taken modulo 2**64


def test_a_drafter_draws_with_the_target_numbers_only_under_exact_acceptance():
    exact, rejection = RequestNoise(5, "exact"), RequestNoise(5, "rejection")
    assert exact.draft(3) == exact.target(3) == rejection.target(3)
    assert rejection.draft(3) == rejection.uniform(NoiseStream.DRAFT, 3) != rejection.target(3)
    with pytest.raises(ValueError, match="acceptance must be one of 'exact', 'rejection', got 'greedy'"):
        RequestNoise(5, "greedy")


def test_unseeded_requests_get_different_random_seeds():
    seeds = {random_seed() for _ in range(8)}
    assert len(seeds) == 8 and all(0 <= seed < 2**63 for seed in seeds)


def pairs_p_value(first: list[float], second: list[float], bins: int = 10) -> float:
    """Chi-square of the joint histogram of (first[i], second[i]) against independent uniforms."""
    cells = torch.tensor([int(a * bins) * bins + int(b * bins) for a, b in zip(first, second)])
    counts = torch.bincount(cells, minlength=bins * bins).double()
    return chisquare(counts.numpy(), [len(first) / bins**2] * bins**2).pvalue


def test_numbers_are_uniform_and_independent_across_indices_streams_and_seeds():
    noise = RequestNoise(2024)
    targets = noise.uniforms(NoiseStream.TARGET, 0, NUM_NUMBERS + 1)
    assert pairs_p_value(targets[:-1], targets[1:]) > 1e-3  # neighbouring output indices
    assert pairs_p_value(targets[:-1], noise.uniforms(NoiseStream.ACCEPT, 0, NUM_NUMBERS)) > 1e-3  # same index
    next_seed = [RequestNoise(seed + 1).target(0) for seed in range(NUM_NUMBERS)]
    assert pairs_p_value([RequestNoise(seed).target(0) for seed in range(NUM_NUMBERS)], next_seed) > 1e-3


def test_the_independence_test_detects_correlated_numbers():
    targets = RequestNoise(2024).uniforms(NoiseStream.TARGET, 0, NUM_NUMBERS)
    shifted = [(u + 0.05 * v) % 1.0 for u, v in zip(targets, targets[1:] + targets[:1])]  # weakly tied to u
    assert pairs_p_value(targets, shifted) < 1e-6
