"""Logits to probabilities and token sampling, shared by the target and the draft side.

The same ``logits_to_probs`` must shape both distributions: rejection sampling is only lossless
against the distribution the target would have sampled from without speculation, and exact acceptance
(verify/exact.py) compares a draft with the token plain decoding draws (``sample_token``), which a sampling
drafter predicts best by drawing from its own processed distribution with the same uniform number.
"""
from __future__ import annotations

import torch

from specdec.config import SamplingParams
from specdec.kernels import argmax_rows


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Argmax per row; the first index wins ties. logits [n, vocab] -> token ids [n]."""
    return argmax_rows(logits)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then min-p, then top-k, then top-p, then softmax. logits [n, vocab] -> probs [n, vocab] fp32.

    Greedy params give the one-hot of the argmax, so greedy requests go through the same verifier.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, vocab], got shape {tuple(logits.shape)}")
    logits = logits.float()  # [n, vocab]
    if params.greedy:
        return _one_hot_argmax(logits)
    scaled_logits = logits / params.temperature  # [n, vocab]
    scaled_logits = _apply_min_p(scaled_logits, params.min_p)
    scaled_logits = _apply_top_k(scaled_logits, params.top_k)
    scaled_logits = _apply_top_p(scaled_logits, params.top_p)
    return torch.softmax(scaled_logits, dim=-1)


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    vocab_size = logits.shape[-1]
    argmax_ids = greedy_tokens(logits)  # [n]
    return torch.nn.functional.one_hot(argmax_ids, vocab_size).to(torch.float32)  # [n, vocab]


def _apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Mask the tokens whose probability is below min_p times the row's largest (vLLM); the most likely stays."""
    if min_p <= 0:
        return logits
    probs = torch.softmax(logits, dim=-1)  # [n, vocab]
    threshold = min_p * probs.max(dim=-1, keepdim=True).values  # [n, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Mask everything below the k-th largest logit; ties with the k-th value are kept."""
    vocab_size = logits.shape[-1]
    if top_k == 0 or top_k >= vocab_size:
        return logits
    kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [n, 1]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


# On the CPU the nucleus is looked for among the 1024 most likely tokens first, then among the 16 384 most likely
# for the rows it was wider than that: sorting all of Gemma-3's 262 144 logits cost 24 ms per row (385 ms for 16
# rows, 20 times a batched decode step), selecting the 1024 most likely 2-3 ms, the 16 384 most likely 5-6 ms. With
# Gemma at temperature 1 and top-p 0.95, 2.7 % of the rows needed the second tier and none the full sort.
TOP_P_CANDIDATES = (1024, 16384)


def _apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest prefix of tokens (most likely first) whose probability mass reaches top_p.

    A token is kept when the mass of the tokens sorted before it is still below top_p, so the most
    likely token is always kept. On the CPU only the TOP_P_CANDIDATES most likely tokens are sorted, tier by
    tier, and a row's whole vocabulary only when its nucleus is wider still; the kept set is the same either way.
    """
    if top_p >= 1.0:
        return logits
    probs = torch.softmax(logits, dim=-1)  # [n, vocab]
    vocab_size = probs.shape[-1]
    if logits.is_cuda:  # a full sort (no host sync on the GPU)
        return logits.masked_fill(~_prefix_among(probs, vocab_size, top_p)[0], float("-inf"))
    keep = torch.zeros_like(probs, dtype=torch.bool)  # [n, vocab]
    rows = torch.arange(probs.shape[0], device=probs.device)  # the rows whose prefix is not found yet
    for candidates in [k for k in TOP_P_CANDIDATES if k < vocab_size] + [vocab_size]:
        row_keep, covered = _prefix_among(probs if rows.numel() == probs.shape[0] else probs[rows], candidates, top_p)
        keep[rows[covered]] = row_keep[covered]
        rows = rows[~covered]
        if rows.numel() == 0:
            break
    return logits.masked_fill(~keep, float("-inf"))


def _prefix_among(probs: torch.Tensor, candidates: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p's prefix among each row's `candidates` most likely tokens. probs [n, vocab] -> keep [n, vocab] bool,
    covered [n] bool: the prefix ends among the candidates (every token beyond them has at least their whole mass
    before it), always true when the candidates are the whole vocabulary."""
    if candidates >= probs.shape[-1]:
        top_probs, top_ids = torch.sort(probs, dim=-1, descending=True)  # [n, vocab] each
    else:
        top_probs, top_ids = torch.topk(probs, candidates, dim=-1)  # [n, candidates] each, most likely first
    mass_before = torch.cumsum(top_probs, dim=-1) - top_probs  # [n, candidates]
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, top_ids, mass_before < top_p)  # [n, vocab]
    if candidates >= probs.shape[-1]:
        return keep, torch.ones(probs.shape[0], dtype=torch.bool, device=probs.device)
    return keep, (mass_before[:, -1] + top_probs[:, -1]) >= top_p


def sample_from_uniforms(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row, the inverse of the row's cumulative distribution at its uniform number.
    probs [n, vocab], uniforms [n] in [0, 1) -> ids [n].

    probs: non-negative, not necessarily normalized. The cumulative sums run in fp64 over the vocabulary in id
    order, so the token is a pure function of (probs, uniform): a zero-probability token is never chosen, and a
    row of zeros gives token 0. Uniform numbers spread evenly over [0, 1) give each token its probability.
    (The exponential race argmax(probs / Exp(1)) used before drew vocab-many random numbers per row: 7.5 ms per
    token over Gemma-3's 262 144 entries on this CPU, against 0.5 ms for the cumulative sums.)
    """
    cumulative = torch.cumsum(probs.double(), dim=-1)  # [n, vocab]
    total = cumulative[:, -1:].contiguous()  # [n, 1]
    points = uniforms.to(device=probs.device, dtype=torch.float64).reshape(-1, 1) * total  # [n, 1]
    ids = torch.searchsorted(cumulative, points, right=True)  # [n, 1]: first cumulative above the draw
    # the draw can round up to the total: the last token that raised the sum is then the one
    last_positive = torch.searchsorted(cumulative, total, right=False)  # [n, 1]
    # a row with NaN (logits divided by a temperature so small that they overflow) still gives a token id
    return torch.minimum(ids, last_positive).clamp_(max=probs.shape[-1] - 1).squeeze(1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """sample_from_uniforms with one uniform number per row from a torch generator. probs [n, vocab] -> ids [n]."""
    uniforms = torch.rand(probs.shape[0], generator=generator, device=probs.device, dtype=torch.float64)  # [n]
    return sample_from_uniforms(probs, uniforms)


def sample_one(probs: torch.Tensor, uniform: float) -> int:
    """sample_from_uniforms for one row: probs [1, vocab] or [vocab], one uniform number -> one token id."""
    return int(sample_from_uniforms(probs.reshape(1, -1), torch.tensor([uniform], dtype=torch.float64))[0])


def sample_token(logits: torch.Tensor, params: SamplingParams, uniform: float) -> int:
    """The token plain decoding draws from one position's logits [1, vocab] with its uniform number u_t
    (verify.noise): the argmax for greedy params, else the inverse cumulative distribution of
    logits_to_probs at u_t. Plain decoding and exact speculative verification both call this, on one row
    at a time, so that the same row of logits gives the same token bit for bit.
    """
    if params.greedy:
        return int(greedy_tokens(logits)[0])
    return sample_one(logits_to_probs(logits, params), uniform)
