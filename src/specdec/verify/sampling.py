"""Logits to probabilities and token sampling, shared by the target and the draft side.

The same ``logits_to_probs`` must shape both distributions: rejection sampling is only lossless
against the distribution the target would have sampled from without speculation.
"""
from __future__ import annotations

import torch

from specdec.config import SamplingParams
from specdec.kernels import argmax_rows


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Argmax per row; the first index wins ties. logits [n, vocab] -> token ids [n]."""
    return argmax_rows(logits)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p, then softmax. logits [n, vocab] -> probs [n, vocab] fp32.

    Greedy params give the one-hot of the argmax, so greedy requests go through the same verifier.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, vocab], got shape {tuple(logits.shape)}")
    logits = logits.float()  # [n, vocab]
    if params.greedy:
        return _one_hot_argmax(logits)
    scaled_logits = logits / params.temperature  # [n, vocab]
    scaled_logits = _apply_top_k(scaled_logits, params.top_k)
    scaled_logits = _apply_top_p(scaled_logits, params.top_p)
    return torch.softmax(scaled_logits, dim=-1)


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    vocab_size = logits.shape[-1]
    argmax_ids = greedy_tokens(logits)  # [n]
    return torch.nn.functional.one_hot(argmax_ids, vocab_size).to(torch.float32)  # [n, vocab]


def _apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Mask everything below the k-th largest logit; ties with the k-th value are kept."""
    vocab_size = logits.shape[-1]
    if top_k == 0 or top_k >= vocab_size:
        return logits
    kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [n, 1]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest prefix of tokens (most likely first) whose probability mass reaches top_p.

    A token is kept when the mass of the tokens sorted before it is still below top_p, so the most
    likely token is always kept.
    """
    if top_p >= 1.0:
        return logits
    sorted_logits, sorted_ids = torch.sort(logits, dim=-1, descending=True)  # [n, vocab] each
    sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [n, vocab]
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [n, vocab]
    sorted_drop = mass_before >= top_p  # [n, vocab]
    drop = torch.zeros_like(sorted_drop).scatter(-1, sorted_ids, sorted_drop)  # [n, vocab]
    return logits.masked_fill(drop, float("-inf"))


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row via the exponential race argmax(probs / Exp(1)). probs [n, vocab] -> ids [n].

    Exact for any (unnormalized) non-negative probs and needs no host sync; zero-probability tokens are
    never chosen unless the whole row is zero.
    """
    exponential_noise = torch.empty_like(probs).exponential_(generator=generator)  # [n, vocab]
    # Exp(1) can round to 0; 0/0 would be NaN, which argmax would pick.
    exponential_noise.clamp_(min=torch.finfo(exponential_noise.dtype).tiny)
    return torch.argmax(probs / exponential_noise, dim=-1)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A generator on ``device``; seed None draws a non-deterministic seed."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
