"""Penalties, logit biases and min_tokens: the per-position logits processing before temperature (vLLM's semantics).

One function, `process_logits`, turns a block of raw logits [rows, vocab] into processed logits, each row with its
own context: the tokens generated before that row's position. Plain decoding calls it on one row (the committed
output); verification calls it on the whole verify block, where row i of a chain counts the committed output plus
draft tokens 0 .. i-1, and the row of a tree node counts the committed output plus the node's path (row 0: the
committed output only). So every row is processed exactly as plain decoding would process it had the drafts before
it been emitted, and every verifier (greedy chain and tree, exact, rejection) sees the distribution plain decoding
samples from.

The order is vLLM's: logit_bias, then min_tokens (end-of-sequence and stop_token_ids get -inf while the output is
shorter than min_tokens), then repetition_penalty over prompt + output (positive logits divided, negative ones
multiplied), then frequency_penalty * count and presence_penalty * (count > 0) over the output, subtracted. min_p
follows temperature in `logits_to_probs` (verify/sampling.py).

Every operation is elementwise per row, so a row's processed logits are bitwise the same whether it is processed
alone (plain decoding) or in a block (verification): exact acceptance keeps emitting plain seeded sampling's tokens.

Drafters draft from their own distributions without these penalties. That keeps rejection sampling lossless: it
needs only that a draft token is drawn from the draft probabilities the drafter reports, which stays true; the
target side, which is what the output follows, is processed here at every verify position.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from specdec.config import SamplingParams


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt_token_ids: Sequence[int],
                   output_token_ids: Sequence[int], row_paths: Sequence[Sequence[int]],
                   eos_token_ids: Collection[int] = ()) -> torch.Tensor:
    """logits [rows, vocab] -> processed logits [rows, vocab] fp32 (the input itself when nothing applies).

    Row i's generated tokens are output_token_ids + row_paths[i] (row_paths[i]: the draft tokens before the row's
    position). eos_token_ids: banned with stop_token_ids before min_tokens (unless params.ignore_eos).
    """
    if logits.dim() != 2 or logits.shape[0] != len(row_paths):
        raise ValueError(f"process_logits needs logits [rows, vocab] with one path per row, got shape "
                         f"{tuple(logits.shape)} and {len(row_paths)} paths")
    if not params.processes_logits:
        return logits
    rows, vocab_size = logits.shape
    device = logits.device
    logits = logits.float().clone()  # [rows, vocab]
    if params.logit_bias:
        ids = torch.tensor([token_id for token_id, _ in params.logit_bias], dtype=torch.long, device=device)
        biases = torch.tensor([bias for _, bias in params.logit_bias], dtype=torch.float32, device=device)
        logits[:, ids] += biases
    if params.min_tokens:
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        short = [row for row, path in enumerate(row_paths) if len(output_token_ids) + len(path) < params.min_tokens]
        if banned and short:
            banned_ids = torch.tensor(sorted(banned), dtype=torch.long, device=device)
            short_rows = torch.tensor(short, dtype=torch.long, device=device)
            logits[short_rows.unsqueeze(1), banned_ids.unsqueeze(0)] = float("-inf")
    if params.repetition_penalty != 1 or params.presence_penalty or params.frequency_penalty:
        counts = output_counts(output_token_ids, row_paths, vocab_size, device)  # [rows, vocab]
        if params.repetition_penalty != 1:
            seen = counts > 0  # [rows, vocab]
            if len(prompt_token_ids):
                prompt = torch.tensor(list(prompt_token_ids), dtype=torch.long, device=device)
                seen |= torch.bincount(prompt, minlength=vocab_size)[:vocab_size].unsqueeze(0) > 0
            penalty = params.repetition_penalty
            penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, penalized, logits)
        if params.frequency_penalty:
            logits -= params.frequency_penalty * counts
        if params.presence_penalty:
            logits -= params.presence_penalty * (counts > 0).float()
    return logits


def output_counts(output_token_ids: Sequence[int], row_paths: Sequence[Sequence[int]], vocab_size: int,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """How often each token occurs in each row's generated tokens (output + the row's path): [rows, vocab] fp32."""
    rows = len(row_paths)
    base = torch.zeros(vocab_size, dtype=torch.float32, device=device)
    if len(output_token_ids):
        ids = torch.tensor(list(output_token_ids), dtype=torch.long, device=device)
        base.index_add_(0, ids, torch.ones(len(output_token_ids), dtype=torch.float32, device=device))
    counts = base.unsqueeze(0).repeat(rows, 1)  # [rows, vocab]
    flat = [row * vocab_size + token_id for row, path in enumerate(row_paths) for token_id in path]
    if flat:
        counts.view(-1).index_add_(0, torch.tensor(flat, dtype=torch.long, device=device),
                                   torch.ones(len(flat), dtype=torch.float32, device=device))
    return counts


def chain_paths(draft_token_ids: Sequence[int]) -> list[tuple[int, ...]]:
    """The paths of a chain's k + 1 verify rows: row i follows draft tokens 0 .. i-1."""
    return [tuple(draft_token_ids[:i]) for i in range(len(draft_token_ids) + 1)]


def tree_paths(token_ids: Sequence[int], parents: Sequence[int]) -> list[tuple[int, ...]]:
    """The paths of a tree's nodes + 1 verify rows: row 0 follows the committed tokens, row 1 + n node n's path
    (its ancestors' tokens and its own). parents[n] < n (-1: the root)."""
    paths: list[tuple[int, ...]] = [()]
    for node, parent in enumerate(parents):
        paths.append(paths[parent + 1] + (token_ids[node],))
    return paths
