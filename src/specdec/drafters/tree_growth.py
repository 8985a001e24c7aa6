"""Growing drafts, and draft trees, depth by depth: one forward of the drafter per depth for every request of the
batch, and a request's draft grows either as a chain (its argmax or sampled token at each depth) or, for greedy
requests with num_branches > 1, as EAGLE-2's dynamic draft tree (`GrowingTree`). The draft model and the EAGLE head both
draft
this way (`DraftGrowth`); they differ only in what one forward row reads (a model's KV cache, or the head's
cache plus the predicted target state).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from specdec.drafters.base import Draft
from specdec.drafters.tree import DraftTree, check_tree_args
from specdec.models.batch import ForwardBatch
from specdec.verify.sampling import greedy_tokens


@dataclass
class _GrownNode:
    token_id: int
    parent: int  # node index, -1 = child of the last committed token
    depth: int
    path_prob: float  # draft probability of the path from the root to this node (product over depths)
    on_chain: bool  # on the greedy chain (every token the argmax of its parent's distribution)
    cache_position: int = -1  # where the drafter wrote its key/value when it was expanded


@dataclass(frozen=True)
class TreeRows:
    """The rows a draft feeds at one depth (one drafter forward row each, in the format of ForwardBatch.from_rows):
    the node each row expands and the node whose predicted state it reads (-1: the root, or for a chain's row its
    newest token), then token, RoPE position, cache position, prefix end and tree keys per row."""

    nodes: tuple[int, ...]
    parents: tuple[int, ...]
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    cache_positions: tuple[int, ...]
    prefix_ends: tuple[int, ...]
    tree_keys: tuple[tuple[int, ...], ...]


class GrowingTree:
    """EAGLE-2's dynamic draft tree for one greedy request, grown depth by depth from the drafter's own
    confidence: a node's acceptance probability (the drafter's estimate that the target accepts it) is its path
    probability, the product of the draft probabilities along its path.

    Depth 0 holds the root's children (`add_children(-1, ...)`). At each depth the drafter expands (runs one
    forward row for) the greedy chain's node and the `width - 1` likeliest other nodes of that depth (path
    probability at least `min_prob`); every expanded node adds its argmax child (on the chain when the node is) and its
    best
    other children, `width` in all. The draft (`draft`) is the chain, depths 0 .. max_depth - 1 exactly as a
    chain drafter proposes it, followed by the other nodes with a path probability of at least min_prob, likeliest
    first, up to `max_nodes` nodes in all: a node's parent is at least as likely as the node, so every prefix of that
    order is a tree, and cutting it (the engine's row budget) keeps the best nodes.

    Cache positions (relative to `base`, the position of the depth-0 nodes): the chain's node at depth d sits in
    place at base + d and attends everything before it; another node is written at a scratch position
    base + max_depth + j (j-th expanded) and attends the positions before base + f, f the depth where its path
    leaves the chain, then its path's scratch positions in depth order, itself last: the keys its path would
    have in place, so its row is the chain row of its path (the row-invariant attention makes them bitwise equal).
    """

    def __init__(self, base: int, max_depth: int, width: int, min_prob: float, max_nodes: int,
                 cache_len: int) -> None:
        if max_depth < 1 or width < 2 or max_nodes < max_depth:
            raise ValueError(f"GrowingTree needs max_depth >= 1, width >= 2 and max_nodes >= max_depth, got "
                             f"{max_depth}, {width}, {max_nodes}")
        check_tree_args(width, min_prob)
        self.base, self.max_depth, self.width, self.min_prob = base, max_depth, width, min_prob
        self.max_nodes = max_nodes
        self.cache_len = cache_len  # scratch positions must stay below it
        self.nodes: list[_GrownNode] = []
        self._scratch_used = 0

    def add_children(self, parent: int, chain_token_id: int, chain_prob: float, token_ids: Sequence[int],
                     probs: Sequence[float]) -> None:
        """The expanded node `parent`'s (-1: the root's) children: its argmax chain_token_id (draft probability
        chain_prob) and the best others among token_ids / probs (by decreasing probability; the argmax may be
        among them), width children in all."""
        parent_node = self.nodes[parent] if parent >= 0 else None
        if parent_node is not None and parent_node.depth + 1 >= self.max_depth:
            raise ValueError(f"node {parent} is at the last depth ({self.max_depth - 1}): it has no children")
        depth = 0 if parent_node is None else parent_node.depth + 1
        parent_prob = 1.0 if parent_node is None else parent_node.path_prob
        parent_on_chain = parent_node is None or parent_node.on_chain
        others = [(int(t), float(p)) for t, p in zip(token_ids, probs) if int(t) != chain_token_id]
        for rank, (token_id, prob) in enumerate([(int(chain_token_id), float(chain_prob))] + others[: self.width - 1]):
            on_chain = parent_on_chain and rank == 0
            self.nodes.append(_GrownNode(token_id, parent, depth, parent_prob * prob, on_chain))

    def to_expand(self, depth: int) -> list[int]:
        """The nodes of `depth` to expand: the chain's node, then up to width - 1 others with a path probability of
        at least min_prob (likeliest first), as many as fit in the scratch positions. None at the last depth."""
        if depth + 1 >= self.max_depth:
            return []
        chain = [i for i, node in enumerate(self.nodes) if node.depth == depth and node.on_chain]
        others = sorted((i for i, node in enumerate(self.nodes)
                         if node.depth == depth and not node.on_chain and node.path_prob >= self.min_prob),
                        key=lambda i: -self.nodes[i].path_prob)
        room = self.cache_len - (self.base + self.max_depth + self._scratch_used)
        return chain + others[: max(0, min(self.width - 1, room))]

    def rows(self, nodes: Sequence[int]) -> TreeRows:
        """The forward rows expanding `nodes` (from `to_expand`); assigns their cache positions."""
        cache_positions, prefix_ends, tree_keys = [], [], []
        for i in nodes:
            node = self.nodes[i]
            if node.on_chain:
                node.cache_position = self.base + node.depth
                prefix_ends.append(node.cache_position + 1)
                tree_keys.append(())
            else:
                node.cache_position = self.base + self.max_depth + self._scratch_used
                self._scratch_used += 1
                path = self.path(i)
                fork = next(d for d, j in enumerate(path) if not self.nodes[j].on_chain)
                prefix_ends.append(self.base + fork)
                tree_keys.append(tuple(self.nodes[j].cache_position for j in path[fork:]))
            cache_positions.append(node.cache_position)
        return TreeRows(
            tuple(nodes),
            tuple(self.nodes[i].parent for i in nodes),
            tuple(self.nodes[i].token_id for i in nodes),
            tuple(self.base + self.nodes[i].depth for i in nodes),
            tuple(cache_positions),
            tuple(prefix_ends),
            tuple(tree_keys),
        )

    def path(self, node: int) -> list[int]:
        """Nodes from depth 0 down to `node`."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.nodes[node].parent
        return nodes[::-1]

    def chain(self) -> list[int]:
        """The greedy chain's nodes, by depth."""
        return sorted((i for i, node in enumerate(self.nodes) if node.on_chain), key=lambda i: self.nodes[i].depth)

    def draft(self) -> tuple[tuple[int, ...], DraftTree | None]:
        """(the chain's tokens, the tree to verify or None when no other node reaches min_prob), the tree's
        acceptance probabilities its nodes' path probabilities."""
        chain = self.chain()
        others = sorted(
            (i for i, node in enumerate(self.nodes) if not node.on_chain and node.path_prob >= self.min_prob),
            key=lambda i: (-self.nodes[i].path_prob, self.nodes[i].depth, i),
        )
        order = chain + others[: max(0, self.max_nodes - len(chain))]
        index = {node: position for position, node in enumerate(order)}
        chain_tokens = tuple(self.nodes[i].token_id for i in chain)
        if len(order) == len(chain):
            return chain_tokens, None
        parents = tuple(-1 if self.nodes[i].parent < 0 else index[self.nodes[i].parent] for i in order)
        return chain_tokens, DraftTree(tuple(self.nodes[i].token_id for i in order), parents,
                                       tuple(self.nodes[i].path_prob for i in order))


def chain_row(base: int, token_id: int, depth: int) -> TreeRows:
    """The row feeding a chain's draft token at `depth`: in place at base + depth, attending everything before."""
    position = base + depth
    return TreeRows((-1,), (-1,), (token_id,), (position,), (position,), (position + 1,), ((),))


# (logits [1, vocab], depth) -> (draft token at that depth of the chain, its draft distribution [1, vocab] or None
# for a point mass)
ChainStep = Callable[[torch.Tensor, int], tuple[int, torch.Tensor | None]]


@dataclass
class DraftGrowth:
    """One request's draft while it is drafted: a chain of up to max_tokens tokens, or a GrowingTree.

    The drafter asks `rows(depth)` for the rows to feed at each depth (the chain's newest token, or the tree's
    nodes to expand), runs them, and hands back each row's logits (`add`); `first` takes the logits that the
    request's committed tokens give (depth 0). token_ids (draft vocabulary row -> token id) maps the logits'
    columns to tokens when the drafter drafts over a reduced vocabulary; None: column = token id.
    """

    base: int  # position of the depth-0 draft token
    max_tokens: int
    chain_step: ChainStep
    tree: GrowingTree | None = None
    token_ids: torch.Tensor | None = None  # [draft vocab] int64
    chain: list[int] = field(default_factory=list)
    chain_probs: list[torch.Tensor] = field(default_factory=list)  # each [1, vocab]
    _fed: TreeRows | None = None

    def first(self, logits: torch.Tensor) -> None:
        """logits [1, draft vocab] after the committed tokens: the depth-0 draft(s)."""
        self._add(-1, logits)

    def rows(self, depth: int) -> TreeRows | None:
        """The rows to feed at `depth` (None: this draft is complete). The first row is in place (the chain's)."""
        if self.tree is not None:
            rows = self.tree.rows(self.tree.to_expand(depth))
        elif len(self.chain) < self.max_tokens:
            rows = chain_row(self.base, self.chain[-1], depth)
        else:
            rows = None
        self._fed = rows if rows is not None and rows.token_ids else None
        return self._fed

    def add(self, logits: torch.Tensor) -> None:
        """logits [rows, draft vocab] of the rows just fed."""
        if self._fed is None:
            raise RuntimeError("DraftGrowth.add without rows fed")
        for row, node in enumerate(self._fed.nodes):
            self._add(node, logits[row : row + 1])
        self._fed = None

    def draft(self) -> Draft:
        if self.tree is None:
            return Draft(tuple(self.chain), torch.cat(self.chain_probs) if self.chain_probs else None)
        chain, tree = self.tree.draft()
        return Draft(chain, None, tree)

    def _add(self, node: int, logits: torch.Tensor) -> None:
        """logits [1, draft vocab] of the chain's newest token, or of the tree node `node` (-1: the root)."""
        if self.tree is None:
            token_id, probs = self.chain_step(logits, len(self.chain))
            self.chain.append(token_id)
            if probs is not None:
                self.chain_probs.append(probs)
            return
        draft_probs = torch.softmax(logits[0].float(), dim=-1)  # [draft vocab]
        argmax_column = int(greedy_tokens(logits)[0])
        top_probs, top_columns = draft_probs.topk(min(self.tree.width, draft_probs.shape[0]))
        argmax_id, top_ids = argmax_column, top_columns
        if self.token_ids is not None:  # draft vocabulary columns -> token ids
            argmax_id, top_ids = int(self.token_ids[argmax_column]), self.token_ids[top_columns]
        self.tree.add_children(node, argmax_id, float(draft_probs[argmax_column]), top_ids.tolist(), top_probs.tolist())


def new_growth(base: int, max_tokens: int, greedy: bool, chain_step: ChainStep, num_branches: int,
               min_branch_prob: float, cache_len: int, token_ids: torch.Tensor | None = None) -> DraftGrowth:
    """A chain, or a GrowingTree of width num_branches (greedy requests with num_branches > 1) of at most
    num_branches * max_tokens nodes whose scratch positions stay below cache_len."""
    tree = None
    if greedy and num_branches > 1 and max_tokens > 0:
        tree = GrowingTree(base, max_tokens, num_branches, min_branch_prob, num_branches * max_tokens, cache_len)
    return DraftGrowth(base, max_tokens, chain_step, tree, token_ids)


def depth_batches(growths: Sequence[DraftGrowth], active: Sequence[int], slots: Sequence[int],
                  device: torch.device | str) -> Iterator[tuple[dict[int, TreeRows], ForwardBatch]]:
    """Depth by depth, the rows each unfinished draft of `active` (indices into growths and slots) feeds and one
    ForwardBatch of them all; ends when every draft is complete. The caller runs each batch and hands every
    request's logits rows to its growth (`DraftGrowth.add`) before asking for the next depth."""
    depth = 0
    while True:
        fed = {i: rows for i in active if (rows := growths[i].rows(depth)) is not None}
        if not fed:
            return
        per_seq = [(r.token_ids, r.positions, r.cache_positions, r.prefix_ends, r.tree_keys) for r in fed.values()]
        yield fed, ForwardBatch.from_rows(*zip(*per_seq), [slots[i] for i in fed], device=device)
        depth += 1
