"""Greedy verification of a token tree (drafters/tree.py) in one target forward.

Glossary (as in verify/rejection.py, for trees)
  tree              draft nodes, each one token with a parent node (-1 = the last committed token).
  target logits     [nodes + 1, vocab]: row 0 is the target's distribution after the last committed token,
                    row 1 + i its distribution after node i (along node i's path).
  accepted nodes    the path walked from the root: at each step the child whose token equals the target's
                    argmax at the current node; it stops where no child matches.
  recovered token   the target's argmax where the walk stops at a node that has children.
  bonus token       the target's argmax after a leaf (a whole branch accepted).

The emitted tokens are the argmax chain, exactly what plain greedy decoding emits. Sampled requests under exact
acceptance walk trees the same way along the target's seeded draws (verify/exact.py: verify_exact_tree).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.drafters.tree import DraftTree
from specdec.verify.sampling import greedy_tokens


@dataclass(frozen=True)
class TreeVerifyResult:
    """Outcome of one tree verify step for one request."""

    accepted_nodes: tuple[int, ...]  # node indices of the accepted path, in depth order
    num_drafted: int  # the tree's depth (its longest branch): the draft positions this step covered
    token_ids: tuple[int, ...]  # tokens of the accepted nodes + one recovered or bonus token
    bonus: bool  # the path ends at a leaf, so the last token is the bonus token

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.accepted_nodes) + 1:
            raise ValueError(f"token_ids has {len(self.token_ids)} tokens, expected {len(self.accepted_nodes) + 1}")
        if len(self.accepted_nodes) > self.num_drafted:
            raise ValueError(f"{len(self.accepted_nodes)} accepted nodes exceed the tree depth {self.num_drafted}")

    @property
    def accepted_count(self) -> int:
        return len(self.accepted_nodes)

    def logits_rows(self) -> list[int]:
        """Rows of the target logits each emitted token was chosen from: the root, then the accepted nodes."""
        return [0, *(1 + node for node in self.accepted_nodes)]


def verify_greedy_tree(tree: DraftTree, target_logits: torch.Tensor) -> TreeVerifyResult:
    """Walks the tree along the target's argmax. target_logits [nodes + 1, vocab]."""
    if target_logits.dim() != 2 or target_logits.shape[0] != tree.num_nodes + 1:
        raise ValueError(
            f"target_logits must be [nodes + 1, vocab] = [{tree.num_nodes + 1}, vocab], "
            f"got {tuple(target_logits.shape)}"
        )
    target_token_ids = greedy_tokens(target_logits).tolist()  # [nodes + 1]
    path = tree.accepted_path(lambda node, depth: target_token_ids[node + 1])
    return tree_result(tree, path, target_token_ids[(path[-1] if path else -1) + 1])


def tree_result(tree: DraftTree, path: list[int], final_token_id: int) -> TreeVerifyResult:
    """The result of a walk that accepted `path` and ends with the target's token after its last node."""
    node = path[-1] if path else -1
    tokens = (*(tree.token_ids[n] for n in path), final_token_id)
    return TreeVerifyResult(tuple(path), tree.depth, tokens, bonus=node not in set(tree.parents))
