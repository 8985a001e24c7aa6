"""Verifier tests: hand-built greedy cases and chi-square tests of losslessness.

Chi-square thresholds: with the fixed seeds below a correct verifier must give p > 1e-3, and each deliberately
wrong verifier (the target instead of the residual; a bonus token taken as the argmax) must give p < 1e-6 (the
bias it introduces is large at these sample sizes).
"""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specdec.verify import rejection
from specdec.verify.rejection import RejectionUniforms, VerifyResult, residual_probs, verify_greedy, verify_rejection

VOCAB_SIZE = 6
NUM_TRIALS = 20_000
CORRECT_MIN_P_VALUE = 1e-3
WRONG_MAX_P_VALUE = 1e-6


def one_hot_logits(token_ids: list[int], vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    logits = torch.zeros(len(token_ids), vocab_size)  # [n, vocab]
    logits[torch.arange(len(token_ids)), torch.tensor(token_ids)] = 5.0
    return logits


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def draw_uniforms(num_drafted: int, generator: torch.Generator) -> RejectionUniforms:
    """Fresh independent numbers for one verify step of num_drafted draft tokens."""
    accept, recover = torch.rand(2, num_drafted, generator=generator, dtype=torch.float64)  # [k] each
    return RejectionUniforms(accept, recover, float(torch.rand(1, generator=generator, dtype=torch.float64)))


def verify_drawn(draft_token_ids, draft_probs, target_probs, generator: torch.Generator) -> VerifyResult:
    return verify_rejection(draft_token_ids, draft_probs, target_probs, draw_uniforms(len(draft_token_ids), generator))


def random_distributions(num_rows: int, seed: int) -> torch.Tensor:
    """Rows bounded away from 0 so every chi-square cell has a healthy expected count."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.rand(num_rows, VOCAB_SIZE, generator=generator) ** 3 + 0.05  # [n, vocab]
    return weights / weights.sum(dim=-1, keepdim=True)


# ---------------------------------------------------------------- greedy


def test_greedy_accepts_matching_prefix_then_target_token() -> None:
    target_logits = one_hot_logits([3, 1, 4, 2])  # [k+1=4, vocab]
    result = verify_greedy([3, 1, 5], target_logits)
    assert result == VerifyResult(accepted_count=2, num_drafted=3, token_ids=(3, 1, 4))
    assert not result.bonus


def test_greedy_rejects_at_first_position() -> None:
    result = verify_greedy([0, 1], one_hot_logits([2, 1, 1]))
    assert result.accepted_count == 0
    assert result.token_ids == (2,)


def test_greedy_mismatch_stops_acceptance_even_if_later_drafts_match() -> None:
    result = verify_greedy([3, 0, 4], one_hot_logits([3, 1, 4, 2]))
    assert result.token_ids == (3, 1)


def test_greedy_all_accepted_adds_bonus() -> None:
    result = verify_greedy([3, 1], one_hot_logits([3, 1, 5]))
    assert result.token_ids == (3, 1, 5)
    assert result.bonus


def test_greedy_empty_draft_emits_one_target_token() -> None:
    result = verify_greedy([], one_hot_logits([4]))
    assert result == VerifyResult(accepted_count=0, num_drafted=0, token_ids=(4,))
    assert result.bonus


def test_greedy_ties_take_first_index() -> None:
    target_logits = torch.tensor([[0.0, 2.0, 2.0, 1.0]])
    assert verify_greedy([], target_logits).token_ids == (1,)


def test_greedy_wrong_row_count_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"target_logits must be \[k\+1, vocab\] = \[3, vocab\]"):
        verify_greedy([1, 2], one_hot_logits([1, 2]))


# ---------------------------------------------------------------- rejection, hand-built


def test_rejection_identical_distributions_accept_everything() -> None:
    target_probs = random_distributions(4, seed=1)  # [k+1, vocab]
    generator = make_generator(0)
    for _ in range(50):
        result = verify_drawn([0, 5, 2], target_probs[:3], target_probs, generator)
        assert result.accepted_count == 3 and result.bonus


def test_rejection_zero_target_prob_always_rejects() -> None:
    target_probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25] * 4])
    draft_probs = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    generator = make_generator(0)
    for _ in range(50):
        result = verify_drawn([0], draft_probs, target_probs, generator)
        assert result.accepted_count == 0
        assert result.token_ids[0] in (1, 2)


def test_rejection_point_mass_with_target_one_hot_accepts() -> None:
    target_probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    result = verify_drawn([1, 2], None, target_probs, make_generator(0))
    assert result == VerifyResult(accepted_count=2, num_drafted=2, token_ids=(1, 2, 0))


def test_rejection_point_mass_recovered_token_excludes_the_draft() -> None:
    target_probs = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    generator = make_generator(3)
    outcomes = {verify_drawn([0], None, target_probs, generator).token_ids for _ in range(200)}
    assert outcomes == {(0, 0), (1,)}  # accepted 0 then bonus 0, or rejected and recovered 1 (never 0)


def test_rejection_empty_draft_samples_from_target() -> None:
    target_probs = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    result = verify_drawn([], None, target_probs, make_generator(0))
    assert result == VerifyResult(accepted_count=0, num_drafted=0, token_ids=(2,))


def test_residual_probs_formula_and_degenerate_guard() -> None:
    target_probs = torch.tensor([0.5, 0.3, 0.2])
    draft_probs = torch.tensor([0.2, 0.6, 0.2])
    torch.testing.assert_close(residual_probs(target_probs, draft_probs), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(residual_probs(target_probs, target_probs), target_probs)


def test_rejection_shape_errors() -> None:
    target_probs = random_distributions(3, seed=2)
    generator = make_generator(0)
    with pytest.raises(ValueError, match=r"draft_probs must be \[k, vocab\] = \[2, 6\], got shape \(3, 6\)"):
        verify_drawn([1, 2], target_probs, target_probs, generator)
    with pytest.raises(ValueError, match=r"draft token ids \[6\] are outside the vocabulary \[0, 6\)"):
        verify_drawn([1, 6], None, target_probs, generator)


def test_verify_result_validates_length() -> None:
    with pytest.raises(ValueError, match="token_ids has 1 tokens, expected accepted_count \\+ 1 = 2"):
        VerifyResult(accepted_count=1, num_drafted=2, token_ids=(1,))


# ---------------------------------------------------------------- rejection, chi-square


def first_token_p_value(draft_probs: torch.Tensor | None, fixed_draft: list[int] | None, seed: int) -> float:
    """Emitted first tokens over NUM_TRIALS verify steps vs target_probs[0]."""
    target_probs = random_distributions(3, seed=seed)  # [k+1=3, vocab]
    generator = make_generator(seed)
    counts = torch.zeros(VOCAB_SIZE)
    for _ in range(NUM_TRIALS):
        if draft_probs is None:
            draft_token_ids = fixed_draft
        else:
            draft_token_ids = torch.multinomial(draft_probs, 1, generator=generator).squeeze(1).tolist()
        result = verify_drawn(draft_token_ids, draft_probs, target_probs, generator)
        counts[result.token_ids[0]] += 1
    return chisquare(counts.numpy(), (target_probs[0] * NUM_TRIALS).numpy()).pvalue


def test_first_token_matches_target_with_draft_probs() -> None:
    draft_probs = random_distributions(2, seed=11)  # [k=2, vocab]
    assert first_token_p_value(draft_probs, None, seed=5) > CORRECT_MIN_P_VALUE


def test_first_token_matches_target_with_point_mass_draft() -> None:
    assert first_token_p_value(None, [2, 4], seed=6) > CORRECT_MIN_P_VALUE


class TwoTokenModels:
    """Target and draft distributions where position 1 depends on the token at position 0."""

    def __init__(self, seed: int) -> None:
        self.target_first = random_distributions(1, seed=seed)[0]  # [vocab]
        self.target_second = random_distributions(VOCAB_SIZE, seed=seed + 1)  # [vocab (first token), vocab]
        self.draft_first = random_distributions(1, seed=seed + 2)[0]  # [vocab]
        self.draft_second = random_distributions(VOCAB_SIZE, seed=seed + 3)  # [vocab (first token), vocab]
        self.uniform = torch.full((VOCAB_SIZE,), 1.0 / VOCAB_SIZE)  # [vocab], target after two tokens

    def expected_joint(self) -> torch.Tensor:
        return self.target_first[:, None] * self.target_second  # [vocab, vocab]


def emit_two_tokens(models: TwoTokenModels, generator: torch.Generator) -> tuple[int, int]:
    """Speculative decoding until two tokens are emitted: a 2-token draft, then a 1-token draft if needed."""
    first_draft = int(torch.multinomial(models.draft_first, 1, generator=generator))
    second_draft = int(torch.multinomial(models.draft_second[first_draft], 1, generator=generator))
    draft_probs = torch.stack([models.draft_first, models.draft_second[first_draft]])  # [2, vocab]
    target_probs = torch.stack([models.target_first, models.target_second[first_draft], models.uniform])  # [3, vocab]
    result = verify_drawn([first_draft, second_draft], draft_probs, target_probs, generator)
    if len(result.token_ids) >= 2:
        return result.token_ids[0], result.token_ids[1]
    first_token = result.token_ids[0]
    next_draft = int(torch.multinomial(models.draft_second[first_token], 1, generator=generator))
    next_draft_probs = models.draft_second[first_token].unsqueeze(0)  # [1, vocab]
    next_target_probs = torch.stack([models.target_second[first_token], models.uniform])  # [2, vocab]
    next_result = verify_drawn([next_draft], next_draft_probs, next_target_probs, generator)
    return first_token, next_result.token_ids[0]


def joint_two_token_p_value(seed: int) -> float:
    models = TwoTokenModels(seed)
    generator = make_generator(seed)
    counts = torch.zeros(VOCAB_SIZE, VOCAB_SIZE)
    for _ in range(NUM_TRIALS):
        first_token, second_token = emit_two_tokens(models, generator)
        counts[first_token, second_token] += 1
    expected = models.expected_joint() * NUM_TRIALS  # [vocab, vocab]
    return chisquare(counts.flatten().numpy(), expected.flatten().numpy()).pvalue


def test_joint_of_two_tokens_matches_target() -> None:
    assert joint_two_token_p_value(seed=21) > CORRECT_MIN_P_VALUE


def test_joint_of_two_tokens_detects_a_wrong_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    def target_instead_of_residual(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
        return target_probs

    monkeypatch.setattr(rejection, "residual_probs", target_instead_of_residual)
    assert joint_two_token_p_value(seed=21) < WRONG_MAX_P_VALUE


def test_first_token_detects_a_wrong_point_mass_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    def target_instead_of_residual(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
        return target_probs

    monkeypatch.setattr(rejection, "residual_probs", target_instead_of_residual)
    assert first_token_p_value(None, [2, 4], seed=6) < WRONG_MAX_P_VALUE


def test_rejection_uniforms_are_checked() -> None:
    target_probs = random_distributions(3, seed=2)
    with pytest.raises(ValueError, match="uniforms cover 1 draft positions, the draft has 2"):
        verify_rejection([1, 2], None, target_probs, draw_uniforms(1, make_generator(0)))
    with pytest.raises(ValueError, match=r"must both be \[k\]"):
        RejectionUniforms(torch.rand(2, dtype=torch.float64), torch.rand(3, dtype=torch.float64), 0.5)


def test_rejection_is_a_pure_function_of_its_uniforms() -> None:
    target_probs = random_distributions(4, seed=3)
    draft_probs = random_distributions(3, seed=4)
    for seed in range(20):
        uniforms = draw_uniforms(3, make_generator(seed))
        first = verify_rejection([1, 0, 5], draft_probs, target_probs, uniforms)
        assert verify_rejection([1, 0, 5], draft_probs, target_probs, uniforms) == first


# ---------------------------------------------------------------- the bonus token, chi-square


def bonus_p_value(seed: int) -> float:
    """The bonus token's distribution over NUM_TRIALS fully accepted steps vs target_probs[k]: the draft is the
    target's own distribution, so every draft is accepted and the step's last token is always the bonus."""
    target_probs = random_distributions(3, seed=seed)  # [k+1=3, vocab]
    generator = make_generator(seed)
    counts = torch.zeros(VOCAB_SIZE)
    for _ in range(NUM_TRIALS):
        draft_token_ids = torch.multinomial(target_probs[:2], 1, generator=generator).squeeze(1).tolist()
        result = verify_drawn(draft_token_ids, target_probs[:2], target_probs, generator)
        assert result.bonus
        counts[result.token_ids[-1]] += 1
    return chisquare(counts.numpy(), (target_probs[2] * NUM_TRIALS).numpy()).pvalue


def test_bonus_token_matches_target() -> None:
    assert bonus_p_value(seed=31) > CORRECT_MIN_P_VALUE


def test_bonus_token_test_detects_an_argmax_bonus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rejection, "bonus_token", lambda target_probs, uniform: int(target_probs.argmax()))
    assert bonus_p_value(seed=31) < WRONG_MAX_P_VALUE
