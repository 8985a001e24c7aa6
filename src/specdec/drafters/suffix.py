"""Suffix drafting (after SuffixDecoding, Oliaro et al. 2024): frequency-weighted continuations.

Each request keeps a depth-limited suffix trie over its own tokens (prompt + output): the node for a
string s counts its occurrences, so child count / parent continued count is the empirical probability
that s continues with the child's token ("continued" = occurrences of s followed by some token, i.e.
the parent count minus the occurrence at the very end of the sequence; it equals the sum of the children
counts). Appending one token touches one node per suffix length, O(max_depth).

A second trie of the same kind, shared by all requests, holds the token sequences of the last
``cache_requests`` finished requests (the oldest finished request is evicted first, its counts subtracted).

Propose, per request, with budget B:
  1. match: the longest suffix of the context, of length <= max(1, max_depth - B) so the draft has room
     in the depth-limited trie, that occurs with a continuation;
  2. follow: from the matched node repeatedly take the most frequent child (ties: smaller token id),
     multiplying the running probability by child count / node continued count; stop before the running
     probability falls below min_token_prob, or when B tokens are drafted, or when the trie ends.
  The own trie and the cache trie each give a candidate; its score is the sum of the running
  probabilities (the expected number of accepted tokens under the empirical model). The own candidate is
  preferred; the cache candidate is used only when its score is strictly higher.

With num_branches > 1 (greedy token trees), the chosen candidate's other continuations become branches:
every child of a node on the candidate's path that is not the path's own token, ranked by its running
probability (ties: shallower, then smaller token id), the best num_branches - 1 of those at or above
min_token_prob, each then followed greedily like the candidate; then, when the candidate comes from the
request's own trie, the greedy continuations of its suffixes shorter than the matched one (longest first).

Memory: up to max_depth trie nodes per non-repeating token, in the own and in the cache trie.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.config import SamplingParams
from specdec.drafters.base import Draft, Drafter, check_propose_args, unknown_request_error
from specdec.drafters.tree import distinct_branches


class _TrieNode:
    __slots__ = ("children", "count", "continued_count")

    def __init__(self) -> None:
        self.children: dict[int, _TrieNode] = {}
        self.count = 0  # occurrences of this node's string
        self.continued_count = 0  # occurrences followed by a token = sum of the children counts


@dataclass(frozen=True)
class _Candidate:
    token_ids: tuple[int, ...]
    score: float  # sum of the running probabilities = expected accepted tokens under the empirical model
    start: _TrieNode | None = None  # the matched node the tokens continue


_EMPTY_CANDIDATE = _Candidate(token_ids=(), score=0.0)


def _extend_suffixes(root: _TrieNode, suffix_nodes: list[_TrieNode], token_id: int, max_depth: int) -> list[_TrieNode]:
    """Append one token: count it after every suffix (root = empty suffix) shorter than max_depth.

    suffix_nodes[d - 1] is the node of the sequence's suffix of length d; returns the list after the token.
    """
    extended_nodes = []
    for parent in [root, *suffix_nodes[: max_depth - 1]]:
        child = parent.children.get(token_id)
        if child is None:
            child = parent.children[token_id] = _TrieNode()
        child.count += 1
        parent.continued_count += 1
        extended_nodes.append(child)
    return extended_nodes


def _follow(node: _TrieNode, max_tokens: int, min_token_prob: float, running_prob: float = 1.0) -> _Candidate:
    """Greedily follow the most frequent continuation while the running probability stays confident."""
    start = node
    token_ids: list[int] = []
    score = 0.0
    while len(token_ids) < max_tokens and node.children:
        token_id, child = max(node.children.items(), key=lambda item: (item[1].count, -item[0]))
        running_prob *= child.count / node.continued_count
        if running_prob < min_token_prob:
            break
        token_ids.append(token_id)
        score += running_prob
        node = child
    return _Candidate(token_ids=tuple(token_ids), score=score, start=start)


def _other_branches(candidate: _Candidate, max_tokens: int, min_token_prob: float, count: int) -> list[tuple[int, ...]]:
    """Up to `count` alternatives to the candidate: its path's other children, best running probability first."""
    options = []  # (running probability, depth, token id, child node)
    node, running_prob = candidate.start, 1.0
    for depth, path_token_id in enumerate(candidate.token_ids):
        for token_id, child in node.children.items():
            prob = running_prob * child.count / node.continued_count
            if token_id != path_token_id and prob >= min_token_prob:
                options.append((prob, depth, token_id, child))
        path_child = node.children[path_token_id]
        running_prob *= path_child.count / node.continued_count
        node = path_child
    options.sort(key=lambda option: (-option[0], option[1], option[2]))
    branches = []
    for prob, depth, token_id, child in options[:count]:
        rest = _follow(child, max_tokens - depth - 1, min_token_prob, prob)
        branches.append((*candidate.token_ids[:depth], token_id, *rest.token_ids))
    return branches


def _max_match_length(max_depth: int, max_tokens: int) -> int:
    return max(1, max_depth - max_tokens)


class _RequestTrie:
    """One request's tokens and suffix trie, with the nodes of its current suffixes."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _TrieNode()
        self.token_ids: list[int] = []
        self.suffix_nodes: list[_TrieNode] = []  # [d - 1] = node of the suffix of length d

    def extend(self, token_ids: Sequence[int]) -> None:
        for token_id in token_ids:
            token_id = int(token_id)
            self.suffix_nodes = _extend_suffixes(self.root, self.suffix_nodes, token_id, self.max_depth)
            self.token_ids.append(token_id)

    def propose(self, max_tokens: int, min_token_prob: float) -> _Candidate:
        """Follow the longest (capped) suffix of the sequence that occurred earlier with a continuation."""
        max_length = min(_max_match_length(self.max_depth, max_tokens), len(self.suffix_nodes))
        for length in range(max_length, 0, -1):
            node = self.suffix_nodes[length - 1]
            if node.continued_count > 0:
                return _follow(node, max_tokens, min_token_prob)
        return _EMPTY_CANDIDATE

    def shorter_matches(self, matched: _TrieNode, max_tokens: int, min_token_prob: float) -> list[tuple[int, ...]]:
        """Continuations of the suffixes shorter than the matched one (longest first), each followed greedily."""
        max_length = min(_max_match_length(self.max_depth, max_tokens), len(self.suffix_nodes))
        lengths = range(max_length, 0, -1)
        nodes = [self.suffix_nodes[length - 1] for length in lengths]
        shorter = nodes[nodes.index(matched) + 1 :] if matched in nodes else []
        candidates = (_follow(node, max_tokens, min_token_prob) for node in shorter if node.continued_count > 0)
        return [candidate.token_ids for candidate in candidates if candidate.token_ids]


class _SequenceCache:
    """A suffix trie over the token sequences of the most recently finished requests."""

    def __init__(self, max_depth: int, capacity: int) -> None:
        self.max_depth = max_depth
        self.capacity = capacity
        self.root = _TrieNode()
        self._token_ids_by_request: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._token_ids_by_request)

    def add(self, request_id: str, token_ids: tuple[int, ...]) -> None:
        if self.capacity == 0:
            return
        if request_id in self._token_ids_by_request:
            self._remove_sequence(self._token_ids_by_request.pop(request_id))
        suffix_nodes: list[_TrieNode] = []
        for token_id in token_ids:
            suffix_nodes = _extend_suffixes(self.root, suffix_nodes, token_id, self.max_depth)
        self._token_ids_by_request[request_id] = token_ids
        while len(self._token_ids_by_request) > self.capacity:
            _, evicted_token_ids = self._token_ids_by_request.popitem(last=False)
            self._remove_sequence(evicted_token_ids)

    def _remove_sequence(self, token_ids: tuple[int, ...]) -> None:
        """Undo ``add``: subtract every (start, length <= max_depth) occurrence; drop nodes that reach 0."""
        for start in range(len(token_ids)):
            node = self.root
            for token_id in token_ids[start : start + self.max_depth]:
                child = node.children[token_id]
                child.count -= 1
                node.continued_count -= 1
                if child.count == 0:
                    del node.children[token_id]  # its whole subtree has count 0 as well
                    break
                node = child

    def propose(self, context: Sequence[int], max_tokens: int, min_token_prob: float) -> _Candidate:
        node = self._longest_match(context, _max_match_length(self.max_depth, max_tokens))
        return _EMPTY_CANDIDATE if node is None else _follow(node, max_tokens, min_token_prob)

    def _longest_match(self, context: Sequence[int], max_length: int) -> _TrieNode | None:
        """Binary search: if a suffix of the context occurs with a continuation, so do all shorter ones."""
        shortest_missing = min(max_length, len(context)) + 1
        longest_found, longest_node = 0, None
        while shortest_missing - longest_found > 1:
            length = (longest_found + shortest_missing) // 2
            node = self._walk(context[len(context) - length :])
            if node is not None and node.continued_count > 0:
                longest_found, longest_node = length, node
            else:
                shortest_missing = length
        return longest_node

    def _walk(self, token_ids: Sequence[int]) -> _TrieNode | None:
        node = self.root
        for token_id in token_ids:
            node = node.children.get(token_id)
            if node is None:
                return None
        return node


class SuffixDrafter(Drafter):
    """Suffix-trie drafting over the request itself and a cache of finished requests; point-mass drafts."""

    def __init__(self, max_depth: int, min_token_prob: float, cache_requests: int, num_branches: int = 1) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        if not 0 <= min_token_prob <= 1:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob}")
        if cache_requests < 0:
            raise ValueError(f"cache_requests must be >= 0, got {cache_requests}")
        if num_branches < 1:
            raise ValueError(f"num_branches must be >= 1, got {num_branches}")
        self.num_branches = num_branches
        self._greedy_request_ids: set[str] = set()
        self.max_depth = max_depth
        self.min_token_prob = min_token_prob
        self._trie_by_request: dict[str, _RequestTrie] = {}
        self._cache = _SequenceCache(max_depth, cache_requests)

    @property
    def num_cached_requests(self) -> int:
        return len(self._cache)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> None:
        if request_id in self._trie_by_request:
            raise ValueError(f"request id {request_id!r} is already tracked by the suffix drafter")
        trie = _RequestTrie(self.max_depth)
        trie.extend(prompt_token_ids)
        self._trie_by_request[request_id] = trie
        if params.greedy:
            self._greedy_request_ids.add(request_id)

    def propose(self, request_ids: Sequence[str], max_draft_tokens: Sequence[int]) -> list[Draft]:
        check_propose_args(request_ids, max_draft_tokens)
        return [self._propose_one(request_id, budget) for request_id, budget in zip(request_ids, max_draft_tokens)]

    def _propose_one(self, request_id: str, max_tokens: int) -> Draft:
        trie = self._trie(request_id)
        if max_tokens == 0:
            return Draft(token_ids=(), draft_probs=None)
        own_candidate = trie.propose(max_tokens, self.min_token_prob)
        cache_candidate = self._cache.propose(trie.token_ids, max_tokens, self.min_token_prob)
        best = cache_candidate if cache_candidate.score > own_candidate.score else own_candidate
        if self.num_branches == 1 or request_id not in self._greedy_request_ids or not best.token_ids:
            return Draft(token_ids=best.token_ids, draft_probs=None)
        others = _other_branches(best, max_tokens, self.min_token_prob, self.num_branches - 1)
        if best is own_candidate:
            others += trie.shorter_matches(best.start, max_tokens, self.min_token_prob)
        return Draft.from_branches(distinct_branches([best.token_ids, *others], self.num_branches))

    def observe(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._trie(request_id).extend(token_ids)

    def remove_request(self, request_id: str) -> None:
        trie = self._trie(request_id)
        del self._trie_by_request[request_id]
        self._greedy_request_ids.discard(request_id)
        self._cache.add(request_id, tuple(trie.token_ids))

    def _trie(self, request_id: str) -> _RequestTrie:
        trie = self._trie_by_request.get(request_id)
        if trie is None:
            raise unknown_request_error(request_id, self._trie_by_request.keys())
        return trie
