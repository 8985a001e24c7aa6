"""Chi-square tests of sampled verification with processed distributions: temperature, top-k and top-p.

The engine shapes the target's and the draft's logits with the same ``logits_to_probs`` (verify/sampling.py). Then
rejection sampling must emit tokens distributed as the processed target distribution, and exact acceptance's first
token, over many seeds, must follow it too. Every test of a correct verifier has a negative control built to be
wrong in one way: the processing applied on one side only, the target's top-k or top-p ignored, or the verifier
handed other draft probabilities than the ones the drafts were drawn from; each control must be rejected.

Thresholds as in test_rejection.py: with the fixed seeds below a correct verifier gives p > 1e-3 and each wrong
one p < 1e-6. Cells whose expected count is below 5 are pooled into one; a token emitted where the processed target
has probability 0 (outside top-k or top-p) gives p = 0.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from scipy.stats import chisquare

from specdec.config import SamplingParams
from specdec.verify import exact
from specdec.verify.exact import verify_exact
from specdec.verify.noise import NoiseStream, RequestNoise
from specdec.verify.rejection import RejectionUniforms, VerifyResult, verify_rejection
from specdec.verify.sampling import logits_to_probs, sample_from_uniforms, sample_token

VOCAB_SIZE = 8
NUM_DRAFTED = 2
NUM_TRIALS = 20_000
NUM_SEEDS = 12_000
CORRECT_MIN_P_VALUE = 1e-3
WRONG_MAX_P_VALUE = 1e-6
MIN_EXPECTED_COUNT = 5.0

PROCESSINGS = {
    "temperature": SamplingParams(temperature=0.5),
    "top_k": SamplingParams(temperature=1.0, top_k=3),
    "top_p": SamplingParams(temperature=1.0, top_p=0.7),
    "all": SamplingParams(temperature=1.3, top_k=5, top_p=0.9),
}
UNPROCESSED = SamplingParams(temperature=1.0)


def random_logits(rows: int, seed: int) -> torch.Tensor:
    """Logits spread enough that temperature, top-k and top-p each change the distribution a lot. [rows, vocab]"""
    return torch.randn(rows, VOCAB_SIZE, generator=torch.Generator().manual_seed(seed))


def assert_processing_matters(params: SamplingParams, logits: torch.Tensor) -> None:
    """The processed distribution at position 0 is not the raw one, and keeps at least two tokens."""
    processed, raw = logits_to_probs(logits[:1], params)[0], logits_to_probs(logits[:1], UNPROCESSED)[0]
    assert int((processed > 0).sum()) >= 2 and float((processed - raw).abs().sum()) > 0.2


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """counts [vocab] against expected_probs [vocab]: 0 when a count falls where the probability is 0, else the
    chi-square p-value with the cells of expected count < MIN_EXPECTED_COUNT pooled into one."""
    counts, expected_probs = counts.double(), expected_probs.double()
    if counts[expected_probs == 0].sum() > 0:
        return 0.0
    expected = expected_probs / expected_probs.sum() * counts.sum()  # [vocab]
    large = expected >= MIN_EXPECTED_COUNT
    observed_cells, expected_cells = counts[large], expected[large]
    if (~large & (expected > 0)).any():
        observed_cells = torch.cat([observed_cells, counts[~large].sum().reshape(1)])
        expected_cells = torch.cat([expected_cells, expected[~large].sum().reshape(1)])
    return float(chisquare(observed_cells.numpy(), expected_cells.numpy()).pvalue)


# ---------------------------------------------------------------- rejection sampling


@dataclasses.dataclass(frozen=True)
class Sides:
    """What a rejection-sampling trial uses: the distribution drafts are drawn from, the draft probabilities the
    verifier is handed (None: point-mass drafts), the target probabilities it is handed."""

    draft_sampling_probs: torch.Tensor | None  # [k, vocab]
    draft_probs: torch.Tensor | None  # [k, vocab]
    target_probs: torch.Tensor  # [k+1, vocab]


def processed_sides(params: SamplingParams, seed: int, draft_params: SamplingParams | None = None,
                    target_params: SamplingParams | None = None, verifier_draft_params: SamplingParams | None = None
                    ) -> Sides:
    """Both sides processed with params (what the engine does), or a side processed otherwise (the controls)."""
    target_logits, draft_logits = random_logits(NUM_DRAFTED + 1, seed), random_logits(NUM_DRAFTED, seed + 1)
    assert_processing_matters(params, target_logits)
    draft_sampling = logits_to_probs(draft_logits, draft_params or params)
    return Sides(draft_sampling, logits_to_probs(draft_logits, verifier_draft_params or draft_params or params),
                 logits_to_probs(target_logits, target_params or params))


def first_token_counts(sides: Sides, seed: int, point_mass_draft: list[int] | None = None) -> torch.Tensor:
    """Emitted first tokens over NUM_TRIALS verify steps of NUM_DRAFTED drafts. [vocab]"""
    generator = torch.Generator().manual_seed(seed)
    if point_mass_draft is None:
        drafts = torch.multinomial(sides.draft_sampling_probs, NUM_TRIALS, replacement=True,
                                   generator=generator).T.tolist()  # [trials][k]
    else:
        drafts = [point_mass_draft] * NUM_TRIALS
    uniforms = torch.rand(NUM_TRIALS, 2 * NUM_DRAFTED + 1, generator=generator, dtype=torch.float64)
    counts = torch.zeros(VOCAB_SIZE)
    for draft, numbers in zip(drafts, uniforms):
        step_uniforms = RejectionUniforms(numbers[:NUM_DRAFTED], numbers[NUM_DRAFTED : 2 * NUM_DRAFTED],
                                          float(numbers[-1]))
        result = verify_rejection(draft, None if point_mass_draft else sides.draft_probs, sides.target_probs,
                                  step_uniforms)
        counts[result.token_ids[0]] += 1
    return counts


@pytest.mark.parametrize("processing", list(PROCESSINGS))
def test_rejection_first_token_follows_the_processed_target(processing):
    params = PROCESSINGS[processing]
    sides = processed_sides(params, seed=40)
    assert chi_square_p_value(first_token_counts(sides, seed=41), sides.target_probs[0]) > CORRECT_MIN_P_VALUE


@pytest.mark.parametrize("processing", ["top_k", "top_p", "all"])
def test_rejection_with_point_mass_drafts_follows_the_processed_target(processing):
    """An ngram-style draft of fixed tokens: the first is the processed target's likeliest token, the second one it
    may exclude."""
    sides = processed_sides(PROCESSINGS[processing], seed=50)
    likeliest = int(sides.target_probs[0].argmax())
    least_likely = int(sides.target_probs[1].argmin())
    counts = first_token_counts(sides, seed=51, point_mass_draft=[likeliest, least_likely])
    assert chi_square_p_value(counts, sides.target_probs[0]) > CORRECT_MIN_P_VALUE


def test_control_temperature_on_the_draft_side_only_is_rejected():
    params = PROCESSINGS["temperature"]
    sides = processed_sides(params, seed=40, target_params=UNPROCESSED)
    expected = processed_sides(params, seed=40).target_probs[0]
    assert chi_square_p_value(first_token_counts(sides, seed=41), expected) < WRONG_MAX_P_VALUE


@pytest.mark.parametrize("processing", ["top_k", "top_p"])
def test_control_the_target_ignoring_top_k_or_top_p_is_rejected(processing):
    params = PROCESSINGS[processing]
    sides = processed_sides(params, seed=40, target_params=UNPROCESSED)
    expected = processed_sides(params, seed=40).target_probs[0]
    assert chi_square_p_value(first_token_counts(sides, seed=41), expected) < WRONG_MAX_P_VALUE


@pytest.mark.parametrize("processing", ["temperature", "top_k", "top_p"])
def test_control_the_verifier_handed_unprocessed_draft_probs_is_rejected(processing):
    """Drafts drawn from the processed draft distribution, the verifier told they came from the raw one: acceptance
    and residual then use the wrong draft probabilities and the output is biased. The bias depends on the logits;
    with seed 42 its chi-square noncentrality at NUM_TRIALS is above 450 for each processing (with seed 40, 16 for
    top-k and top-p: too small a bias to detect)."""
    params = PROCESSINGS[processing]
    sides = processed_sides(params, seed=42, verifier_draft_params=UNPROCESSED)
    assert chi_square_p_value(first_token_counts(sides, seed=43), sides.target_probs[0]) < WRONG_MAX_P_VALUE


# ---------------------------------------------------------------- exact acceptance


def exact_first_token_counts(params: SamplingParams, seed: int, verifier=verify_exact
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Over NUM_SEEDS request seeds: a one-token draft drawn from the processed draft distribution with u_0 (as a
    sampling drafter does under exact acceptance), verified by verify_exact with u_0, u_1. Returns the emitted first
    tokens' counts [vocab] and the processed target distribution at position 0 [vocab]."""
    target_logits, draft_logits = random_logits(2, seed), random_logits(1, seed + 1)  # [2, vocab], [1, vocab]
    assert_processing_matters(params, target_logits)
    uniforms = [RequestNoise(request_seed).uniforms(NoiseStream.TARGET, 0, 2) for request_seed in range(NUM_SEEDS)]
    draft_probs = logits_to_probs(draft_logits, params).expand(NUM_SEEDS, VOCAB_SIZE)  # [seeds, vocab]
    drafts = sample_from_uniforms(draft_probs, torch.tensor([u[0] for u in uniforms], dtype=torch.float64)).tolist()
    counts = torch.zeros(VOCAB_SIZE)
    for draft, numbers in zip(drafts, uniforms):
        counts[verifier([draft], target_logits, params, numbers).token_ids[0]] += 1
    return counts, logits_to_probs(target_logits[:1], params)[0]


@pytest.mark.parametrize("processing", list(PROCESSINGS))
def test_exact_first_token_follows_the_processed_target_over_seeds(processing):
    counts, expected = exact_first_token_counts(PROCESSINGS[processing], seed=60)
    assert chi_square_p_value(counts, expected) > CORRECT_MIN_P_VALUE


@pytest.mark.parametrize("processing", ["temperature", "top_k", "top_p"])
def test_control_an_exact_target_draw_from_unprocessed_logits_is_rejected(processing, monkeypatch):
    """The verifier's target draw made without the request's processing (drafts still processed) is rejected."""
    monkeypatch.setattr(exact, "sample_token", lambda logits, params, u: sample_token(logits, UNPROCESSED, u))
    counts, expected = exact_first_token_counts(PROCESSINGS[processing], seed=60)
    assert chi_square_p_value(counts, expected) < WRONG_MAX_P_VALUE


def test_control_exact_acceptance_trusting_the_draft_is_rejected():
    """A verifier that keeps a draft token whenever the processed target allows it, instead of comparing it with
    the target's draw, emits a mixture of the draft's and the target's distributions."""

    def trusting(draft_token_ids, target_logits, params, uniforms):
        allowed = logits_to_probs(target_logits[:1], params)[0, draft_token_ids[0]] > 0
        first = draft_token_ids[0] if allowed else sample_token(target_logits[:1], params, uniforms[0])
        return VerifyResult(accepted_count=0, num_drafted=len(draft_token_ids), token_ids=(first,))

    counts, expected = exact_first_token_counts(PROCESSINGS["all"], seed=60, verifier=trusting)
    assert chi_square_p_value(counts, expected) < WRONG_MAX_P_VALUE
