"""Verification of drafted tokens against the target model: greedy and lossless rejection sampling.

Glossary
  draft tokens      the k tokens x_0..x_{k-1} a drafter proposed for the next positions.
  draft probs       [k, vocab]: the distribution each draft token was sampled from; None means point-mass
                    (one-hot) drafts, as from n-gram / suffix drafters.
  target probs      [k+1, vocab]: the target's distribution at each draft position, plus one past the last.
  accepted tokens   the longest prefix of draft tokens the verifier keeps.
  recovered token   the target's replacement at the first rejected position, sampled from the residual
                    distribution normalize(max(target - draft, 0)).
  bonus token       the extra token sampled from target_probs[k] when all k draft tokens are accepted.

  uniforms          the random numbers a step uses (RejectionUniforms): one acceptance test and one
                    recovered-token draw per draft position, one bonus draw; the engine takes them from the
                    request's counter-based streams (verify/noise.py), so verification is a pure function.

Every verify step therefore emits accepted_count + 1 tokens, and k = 0 degenerates to plain decoding.
Rejection sampling (Leviathan et al. 2023, Chen et al. 2023) makes the emitted tokens distributed
exactly as if sampled from the target alone. Exact acceptance (verify/exact.py) is the other sampled
verifier: it emits plain decoding's own draws.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.verify.sampling import greedy_tokens, sample_one


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of one verify step for one request."""

    accepted_count: int
    num_drafted: int
    token_ids: tuple[int, ...]  # accepted drafts + one recovered or bonus token (len accepted_count + 1)

    def __post_init__(self) -> None:
        if not 0 <= self.accepted_count <= self.num_drafted:
            raise ValueError(f"accepted_count {self.accepted_count} not in [0, num_drafted={self.num_drafted}]")
        if len(self.token_ids) != self.accepted_count + 1:
            raise ValueError(
                f"token_ids has {len(self.token_ids)} tokens, expected accepted_count + 1 = {self.accepted_count + 1}"
            )

    @property
    def bonus(self) -> bool:
        """True when every draft token was accepted, so the last token is the bonus token."""
        return self.accepted_count == self.num_drafted


@dataclass(frozen=True)
class RejectionUniforms:
    """The uniform numbers in [0, 1) one rejection-sampling verify step of k draft tokens uses."""

    accept: torch.Tensor  # [k] fp64: draft i is accepted when accept[i] * draft_prob < target_prob
    recover: torch.Tensor  # [k] fp64: the recovered token's draw when draft i is the first rejected one
    bonus: float  # the bonus token's draw after all k drafts are accepted

    def __post_init__(self) -> None:
        if self.accept.shape != self.recover.shape or self.accept.dim() != 1:
            raise ValueError(f"RejectionUniforms.accept and .recover must both be [k], got shapes "
                             f"{tuple(self.accept.shape)} and {tuple(self.recover.shape)}")


def verify_greedy(draft_token_ids: Sequence[int], target_logits: torch.Tensor) -> VerifyResult:
    """Accept the longest draft prefix equal to the target's argmax, then add the target's own next token.

    target_logits [k+1, vocab].
    """
    num_drafted = len(draft_token_ids)
    _check_target_rows(target_logits, num_drafted, "target_logits")
    target_token_ids = greedy_tokens(target_logits).tolist()  # [k+1]
    accepted_count = 0
    while accepted_count < num_drafted and draft_token_ids[accepted_count] == target_token_ids[accepted_count]:
        accepted_count += 1
    token_ids = (*draft_token_ids[:accepted_count], target_token_ids[accepted_count])
    return VerifyResult(accepted_count=accepted_count, num_drafted=num_drafted, token_ids=tuple(token_ids))


def residual_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """normalize(max(target - draft, 0)) for one position. target_probs, draft_probs [vocab] -> [vocab].

    An all-zero residual only arises when target == draft (then nothing is ever rejected in exact
    arithmetic); if rounding gets there anyway, fall back to the target distribution.
    """
    unnormalized = torch.clamp(target_probs - draft_probs, min=0.0)  # [vocab]
    total = unnormalized.sum()
    return torch.where(total > 0, unnormalized / total.clamp(min=torch.finfo(total.dtype).tiny), target_probs)


def verify_rejection(
    draft_token_ids: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniforms: RejectionUniforms,
) -> VerifyResult:
    """Lossless speculative sampling.

    Draft x_i is accepted with probability min(1, target_probs[i, x_i] / draft_probs[i, x_i]); at the first
    rejection the recovered token is sampled from residual_probs(target_probs[i], draft_probs[i]); if all k
    are accepted the bonus token is sampled from target_probs[k]. Point-mass drafts (draft_probs None) use
    the one-hot of x_i as draft distribution: acceptance probability target_probs[i, x_i], residual = the
    target with x_i removed, renormalized.

    draft_probs [k, vocab] or None; target_probs [k+1, vocab]; uniforms: k acceptance tests, k recovered draws,
    one bonus draw (independent of each other and of the draws that chose the drafts).
    """
    num_drafted = len(draft_token_ids)
    _check_target_rows(target_probs, num_drafted, "target_probs")
    vocab_size = target_probs.shape[1]
    _check_draft(draft_token_ids, draft_probs, vocab_size)
    if uniforms.accept.shape[0] != num_drafted:
        raise ValueError(f"uniforms cover {uniforms.accept.shape[0]} draft positions, the draft has {num_drafted}")
    draft_ids = torch.tensor(list(draft_token_ids), dtype=torch.long, device=target_probs.device)  # [k]
    full_draft_probs = _draft_distribution(draft_ids, draft_probs, vocab_size, target_probs.dtype)  # [k, vocab]
    accepted_count = _count_accepted(draft_ids, full_draft_probs, target_probs, uniforms.accept)
    if accepted_count == num_drafted:
        final_token_id = bonus_token(target_probs[num_drafted], uniforms.bonus)
    else:
        residual = residual_probs(target_probs[accepted_count], full_draft_probs[accepted_count])  # [vocab]
        final_token_id = sample_one(residual, float(uniforms.recover[accepted_count]))
    token_ids = (*draft_token_ids[:accepted_count], final_token_id)
    return VerifyResult(accepted_count=accepted_count, num_drafted=num_drafted, token_ids=tuple(token_ids))


def bonus_token(target_probs: torch.Tensor, uniform: float) -> int:
    """The bonus token: the target's own draw after a fully accepted draft. target_probs [vocab]."""
    return sample_one(target_probs, uniform)


def _draft_distribution(
    draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, vocab_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The draft distribution per position [k, vocab]; point-mass drafts become one-hot rows."""
    if draft_probs is not None:
        return draft_probs.to(dtype)
    return torch.nn.functional.one_hot(draft_ids, vocab_size).to(dtype)


def _count_accepted(
    draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, accept_uniforms: torch.Tensor
) -> int:
    """Length of the accepted prefix: draft i is accepted when u_i * draft < target, u_i = accept_uniforms[i]
    ~ U[0, 1) (compared in fp64)."""
    num_drafted = draft_ids.shape[0]
    if num_drafted == 0:
        return 0
    positions = torch.arange(num_drafted, device=draft_ids.device)  # [k]
    target_at_draft = target_probs[positions, draft_ids].double()  # [k]
    draft_at_draft = draft_probs[positions, draft_ids].double()  # [k]
    uniforms = accept_uniforms.to(device=draft_ids.device, dtype=torch.float64)  # [k]
    accepted = uniforms * draft_at_draft < target_at_draft  # [k]; P(accept) = min(1, target / draft)
    return int(torch.cumprod(accepted.to(torch.int32), dim=0).sum())


def _check_target_rows(target: torch.Tensor, num_drafted: int, name: str) -> None:
    if target.dim() != 2 or target.shape[0] != num_drafted + 1:
        raise ValueError(
            f"{name} must be [k+1, vocab] = [{num_drafted + 1}, vocab] for {num_drafted} draft tokens, "
            f"got shape {tuple(target.shape)}"
        )


def _check_draft(draft_token_ids: Sequence[int], draft_probs: torch.Tensor | None, vocab_size: int) -> None:
    out_of_range = [token_id for token_id in draft_token_ids if not 0 <= token_id < vocab_size]
    if out_of_range:
        raise ValueError(f"draft token ids {out_of_range} are outside the vocabulary [0, {vocab_size})")
    expected_shape = (len(draft_token_ids), vocab_size)
    if draft_probs is not None and tuple(draft_probs.shape) != expected_shape:
        raise ValueError(
            f"draft_probs must be [k, vocab] = {list(expected_shape)}, got shape {tuple(draft_probs.shape)}"
        )
