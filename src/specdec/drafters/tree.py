"""Token trees: several draft branches merged by their shared prefixes, verified in one target forward.

Node i holds one draft token; ``parents[i]`` is the index of its parent node, or -1 when the node follows
the request's last committed token directly (a root child). Parents come first (``parents[i] < i``).
The nodes of the first branch are nodes 0, 1, ..., so node d of the first branch sits at depth d: the
first branch is the request's chain draft (``Draft.token_ids``), and the tree's other branches add nodes
after it. A chain is the tree whose nodes are all on the first branch.

The verifier follows, from the root, the child whose token equals the target's own token at that node: its
argmax for greedy requests (verify.tree.verify_greedy_tree), its seeded draw for sampled requests under exact
acceptance (verify.exact.verify_exact_tree). Sampled requests under rejection sampling verify the first branch
as a chain.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DraftTree:
    token_ids: tuple[int, ...]  # [nodes] draft token of each node
    parents: tuple[int, ...]  # [nodes] parent node index, -1 = child of the last committed token
    # [nodes] each node's acceptance probability: the drafter's estimate that the target accepts it (its draft path
    # probability), the nodes after the first branch in decreasing order; None: the drafter gives none (the engine
    # then keeps the tree as its row budget allows, without asking the draft policy which nodes pay)
    acceptance_probs: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.parents):
            raise ValueError(f"DraftTree has {len(self.token_ids)} tokens but {len(self.parents)} parents")
        if self.acceptance_probs is not None and len(self.acceptance_probs) != len(self.token_ids):
            raise ValueError(f"DraftTree has {len(self.token_ids)} tokens but {len(self.acceptance_probs)} "
                             "acceptance probabilities")
        bad = [(i, p) for i, p in enumerate(self.parents) if not -1 <= p < i]
        if bad:
            raise ValueError(f"DraftTree parents must satisfy -1 <= parents[i] < i, got (node, parent) {bad[:5]}")
        children = set()
        for i, (token_id, parent) in enumerate(zip(self.token_ids, self.parents)):
            if (parent, token_id) in children:
                raise ValueError(f"DraftTree node {i} repeats token {token_id} under parent {parent}")
            children.add((parent, token_id))

    @classmethod
    def from_branches(cls, branches: Sequence[Sequence[int]], max_nodes: int | None = None) -> "DraftTree":
        """Merges branches (token sequences) by shared prefixes, in order; the first branch comes first.

        max_nodes: stop adding nodes once the tree has this many (later branches are cut or dropped).
        """
        token_ids: list[int] = []
        parents: list[int] = []
        child_by_token: dict[tuple[int, int], int] = {}
        for branch in branches:
            parent = -1
            for token_id in branch:
                node = child_by_token.get((parent, int(token_id)))
                if node is None:
                    if max_nodes is not None and len(token_ids) >= max_nodes:
                        break
                    node = len(token_ids)
                    token_ids.append(int(token_id))
                    parents.append(parent)
                    child_by_token[(parent, int(token_id))] = node
                parent = node
        return cls(tuple(token_ids), tuple(parents))

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    @property
    def depth(self) -> int:
        """The longest branch's length: the draft positions the tree covers."""
        return max(self.depths(), default=-1) + 1

    def depths(self) -> list[int]:
        """[nodes] depth of each node; a root child has depth 0."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(0 if parent < 0 else depths[parent] + 1)
        return depths

    def first_branch(self) -> tuple[int, ...]:
        """The chain of nodes 0, 1, ... each the child of the previous: the tokens of the first branch."""
        length = 0
        while length < self.num_nodes and self.parents[length] == length - 1:
            length += 1
        return self.token_ids[:length]

    def is_chain(self) -> bool:
        return len(self.first_branch()) == self.num_nodes

    def path(self, node: int) -> list[int]:
        """Nodes from the root child down to `node` (inclusive), in depth order."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def accepted_path(self, next_token: Callable[[int, int], int | None]) -> list[int]:
        """The nodes greedy verification accepts, in depth order: from the root, the child whose token is
        next_token(node, depth), the target's token after `node` (-1: the last committed token) with `depth`
        nodes accepted so far; the walk ends where no child has that token (or next_token gives None)."""
        child_by_token = {
            (parent, token_id): node for node, (parent, token_id) in enumerate(zip(self.parents, self.token_ids))
        }
        path: list[int] = []
        node = -1
        while (token := next_token(node, len(path))) is not None and (
            child := child_by_token.get((node, token))
        ) is not None:
            path.append(child)
            node = child
        return path

    def children(self, node: int) -> list[int]:
        """Child nodes of `node` (-1 = the root), in node order."""
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def truncated(self, max_nodes: int) -> "DraftTree":
        """The first max_nodes nodes (still a tree: parents come first)."""
        probs = None if self.acceptance_probs is None else self.acceptance_probs[:max_nodes]
        return DraftTree(self.token_ids[:max_nodes], self.parents[:max_nodes], probs)


def distinct_branches(branches: Iterable[Sequence[int]], limit: int) -> list[tuple[int, ...]]:
    """Up to `limit` branches, in order, skipping those that repeat a prefix of an earlier one (they would add
    no tree node); `branches` is consumed only as far as needed."""
    kept: list[tuple[int, ...]] = []
    for branch in branches:
        if len(kept) == limit:
            break
        branch = tuple(branch)
        if not any(other[: len(branch)] == branch for other in kept):
            kept.append(branch)
    return kept


def check_tree_args(num_branches: int, min_branch_prob: float | None = None) -> None:
    """A drafter's tree settings: num_branches >= 1 (1 = chains), and min_branch_prob in [0, 1] for the drafters
    that fork where they are unsure."""
    if num_branches < 1:
        raise ValueError(f"num_branches must be >= 1, got {num_branches}")
    if min_branch_prob is not None and not 0.0 <= min_branch_prob <= 1.0:
        raise ValueError(f"min_branch_prob must be in [0, 1], got {min_branch_prob}")

