"""Exact acceptance: sampled speculation that emits, token for token, what plain seeded sampling emits.

Glossary (as in verify/rejection.py)
  target draw       the token plain decoding draws at a position: `sample_token(target_logits[i], params, u_t)`,
                    u_t the request's uniform number for that output index (verify/noise.py).
  accepted tokens   the longest draft prefix whose every token equals the target draw at its position.
  recovered token   the target draw at the first position whose draft differs.
  bonus token       the target draw one past a fully accepted draft.

Every emitted token is therefore the target draw at its position, and the target draws are plain decoding's:
row invariance makes each row of target logits bitwise the row plain decoding computes, the draw runs the same
code on that single row, and u_t depends only on the seed and t. So the output is plain seeded sampling's
output, whatever the batch, the draft length, the drafter or the tree, and its distribution is the target's.
Drafts decide only how many positions one forward checks. A point-mass draft (ngram, suffix) is accepted
with probability target_probs[x], as under rejection sampling; a sampled draft is accepted when the drafter's
draw with the same u_t lands on the same token, at most 1 - TV(target, draft) of the time.

Rows are drawn one at a time and only as far as the walk goes: rows after the first mismatch are never
processed (temperature, top-k, top-p, cumulative sums).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.config import SamplingParams
from specdec.drafters.tree import DraftTree
from specdec.verify.rejection import VerifyResult
from specdec.verify.sampling import sample_token
from specdec.verify.tree import TreeVerifyResult, tree_result


def verify_exact(draft_token_ids: Sequence[int], target_logits: torch.Tensor, params: SamplingParams,
                 uniforms: Sequence[float]) -> VerifyResult:
    """Accepts drafts while they equal the target draws, then adds the target draw at the next position.

    target_logits [k+1, vocab]; uniforms: k + 1 numbers, u_t of the output indices the rows stand for.
    """
    num_drafted = len(draft_token_ids)
    if target_logits.dim() != 2 or target_logits.shape[0] != num_drafted + 1 or len(uniforms) != num_drafted + 1:
        raise ValueError(f"verify_exact needs target_logits [k+1, vocab] and k+1 uniforms for {num_drafted} draft "
                         f"tokens, got shape {tuple(target_logits.shape)} and {len(uniforms)} uniforms")
    accepted_count = 0
    while True:
        drawn = sample_token(target_logits[accepted_count : accepted_count + 1], params, uniforms[accepted_count])
        if accepted_count == num_drafted or draft_token_ids[accepted_count] != drawn:
            break
        accepted_count += 1
    token_ids = (*draft_token_ids[:accepted_count], drawn)
    return VerifyResult(accepted_count=accepted_count, num_drafted=num_drafted, token_ids=tuple(token_ids))


def verify_exact_tree(tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
                      uniforms: Sequence[float]) -> TreeVerifyResult:
    """Walks the tree along the target draws: at depth d the draw from the current node's row with u of depth d.

    target_logits [nodes + 1, vocab] (row 0: after the last committed token, row 1 + i: after node i);
    uniforms: depth + 1 numbers, u_t of the output indices of depths 0 .. depth (the last for a bonus token).
    """
    depth = tree.depth
    if target_logits.dim() != 2 or target_logits.shape[0] != tree.num_nodes + 1 or len(uniforms) != depth + 1:
        raise ValueError(f"verify_exact_tree needs target_logits [nodes + 1, vocab] = [{tree.num_nodes + 1}, vocab] "
                         f"and {depth + 1} uniforms, got shape {tuple(target_logits.shape)} and {len(uniforms)}")
    drawn: dict[int, int] = {}  # node (-1: the root) -> the target draw after it

    def target_draw(node: int, accepted: int) -> int:
        if node not in drawn:
            drawn[node] = sample_token(target_logits[node + 1 : node + 2], params, uniforms[accepted])
        return drawn[node]

    path = tree.accepted_path(target_draw)
    return tree_result(tree, path, target_draw(path[-1] if path else -1, len(path)))
