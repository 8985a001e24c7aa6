"""Suffix drafting (after SuffixDecoding, Oliaro et al. 2024): frequency-weighted continuations.

Each request keeps a depth-limited suffix trie over its own tokens (prompt + output): the node for a
string s counts its occurrences, so child count / parent continued count is the empirical probability
that s continues with the child's token ("continued" = occurrences of s followed by some token, i.e.
the parent count minus the occurrence at the very end of the sequence; it equals the sum of the children
counts). Appending one token touches one node per suffix length, O(max_depth).

A second trie of the same kind, shared by all requests, holds the outputs of the last ``cache_requests``
finished requests, each with the last max_depth // 4 tokens of its prompt so that a repeated prompt's end
leads into its earlier output (as SuffixDecoding's global tree of previous outputs; the prompt itself is in the
request's own trie). The oldest finished request is evicted first, its counts subtracted.

Propose, per request, with budget B:
  1. match: the longest suffix of the context, of length <= max(1, max_depth - B) so the draft has room
     in the depth-limited trie, that occurs with a continuation;
  2. follow: from the matched node repeatedly take the most frequent child (ties: smaller token id),
     multiplying the running probability by child count / node continued count; stop before the running
     probability falls below min_token_prob, or when B tokens are drafted, or when the trie ends.
  The own trie and the cache trie each give a candidate; its score is the sum of the running
  probabilities (the expected number of accepted tokens under the empirical model). The own candidate is
  preferred; the cache candidate is used only when its score is strictly higher.

With num_branches > 1 (token trees: greedy requests, and sampled ones under exact acceptance), the chosen
candidate's other continuations become branches: every child of a node on the candidate's path that is not the
path's own token, ranked by its running probability (ties: shallower, then smaller token id), the best num_branches
- 1 of those at or above min_token_prob, each then followed greedily like the candidate; then, when the candidate
comes from the request's own trie, the greedy continuations of its suffixes shorter than the matched one (longest
first).

Memory: up to max_depth trie nodes per non-repeating token, in the own and in the cache trie, kept in flat
lists (`_Trie`) rather than as one Python object per node, which the garbage collector would walk.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from specdec.config import SamplingParams
from specdec.drafters.base import Draft, Drafter, check_propose_args, unknown_request_error, verifies_trees
from specdec.drafters.tree import check_tree_args, distinct_branches
from specdec.verify.noise import RequestNoise


_EDGE_STRIDE = 1 << 32  # edge key = parent node * stride + token id (token ids < 2**32)
_NO_NODE = -1


class _Trie:
    """Trie nodes as integer ids in flat lists, the edges in one dict of ints: no garbage-collected object per node.

    A request's trie holds up to max_depth nodes per prompt token (≈ 50 000 for an 830-token sequence), the
    cache's many times that. As objects (one with a children dict per node) the garbage collector walked them
    all at every collection: building the trie of an 830-token sequence cost 87-174 ms, 26 ms of it the work
    itself; here 25-30 ms.
    Node 0 is the root (the empty string). Per node: `count` (occurrences of its string), `continued`
    (occurrences followed by a token = the sum of its children's counts), its token, and its children as a
    linked list (`first_child`, `next_sibling`). Nodes freed by the cache's eviction are reused.
    """

    __slots__ = ("edges", "count", "continued", "token", "first_child", "next_sibling", "free")

    def __init__(self) -> None:
        self.edges: dict[int, int] = {}
        self.count: list[int] = [0]
        self.continued: list[int] = [0]
        self.token: list[int] = [_NO_NODE]
        self.first_child: list[int] = [_NO_NODE]
        self.next_sibling: list[int] = [_NO_NODE]
        self.free: list[int] = []

    def child(self, node: int, token_id: int) -> int:
        return self.edges.get(node * _EDGE_STRIDE + token_id, _NO_NODE)

    def add_child(self, node: int, token_id: int) -> int:
        if self.free:
            child = self.free.pop()
            self.count[child] = self.continued[child] = 0
            self.token[child], self.first_child[child] = token_id, _NO_NODE
            self.next_sibling[child] = self.first_child[node]
        else:
            child = len(self.count)
            self.count.append(0)
            self.continued.append(0)
            self.token.append(token_id)
            self.first_child.append(_NO_NODE)
            self.next_sibling.append(self.first_child[node])
        self.first_child[node] = child
        self.edges[node * _EDGE_STRIDE + token_id] = child
        return child

    def children(self, node: int) -> list[int]:
        result, child = [], self.first_child[node]
        while child != _NO_NODE:
            result.append(child)
            child = self.next_sibling[child]
        return result

    def most_frequent_child(self, node: int) -> int:
        """The child with the highest count (ties: the smaller token id); _NO_NODE for a leaf."""
        best, best_count, best_token = _NO_NODE, 0, 0
        count, token, child = self.count, self.token, self.first_child[node]
        while child != _NO_NODE:
            child_count = count[child]
            if child_count > best_count or (child_count == best_count and token[child] < best_token):
                best, best_count, best_token = child, child_count, token[child]
            child = self.next_sibling[child]
        return best

    def remove_child(self, node: int, child: int) -> None:
        """Unlinks a child whose count reached 0 and frees its subtree (whose counts are 0 as well)."""
        previous, current = _NO_NODE, self.first_child[node]
        while current != child:
            previous, current = current, self.next_sibling[current]
        if previous == _NO_NODE:
            self.first_child[node] = self.next_sibling[child]
        else:
            self.next_sibling[previous] = self.next_sibling[child]
        stack = [(node, child)]
        while stack:
            parent, freed = stack.pop()
            del self.edges[parent * _EDGE_STRIDE + self.token[freed]]
            stack.extend((freed, grandchild) for grandchild in self.children(freed))
            self.free.append(freed)

    def extend_suffixes(self, suffix_nodes: list[int], token_id: int, max_depth: int) -> list[int]:
        """Append one token: count it after every suffix (root = empty suffix) shorter than max_depth.

        suffix_nodes[d - 1] is the node of the sequence's suffix of length d; returns the list after the token.
        """
        edges, count, continued = self.edges, self.count, self.continued
        extended_nodes = []
        for parent in (0, *suffix_nodes[: max_depth - 1]):
            child = edges.get(parent * _EDGE_STRIDE + token_id)
            if child is None:
                child = self.add_child(parent, token_id)
            count[child] += 1
            continued[parent] += 1
            extended_nodes.append(child)
        return extended_nodes

    def follow(self, node: int, max_tokens: int, min_token_prob: float, running_prob: float = 1.0) -> _Candidate:
        """Greedily follow the most frequent continuation while the running probability stays confident."""
        start = node
        token_ids: list[int] = []
        score = 0.0
        while len(token_ids) < max_tokens:
            child = self.most_frequent_child(node)
            if child == _NO_NODE:
                break
            running_prob *= self.count[child] / self.continued[node]
            if running_prob < min_token_prob:
                break
            token_ids.append(self.token[child])
            score += running_prob
            node = child
        return _Candidate(token_ids=tuple(token_ids), score=score, start=start)

    def other_branches(self, candidate: _Candidate, max_tokens: int, min_token_prob: float,
                       count: int) -> list[tuple[int, ...]]:
        """Up to `count` alternatives to the candidate: its path's other children, best running probability first."""
        options = []  # (running probability, depth, token id, child node)
        node, running_prob = candidate.start, 1.0
        for depth, path_token_id in enumerate(candidate.token_ids):
            for child in self.children(node):
                prob = running_prob * self.count[child] / self.continued[node]
                if self.token[child] != path_token_id and prob >= min_token_prob:
                    options.append((prob, depth, self.token[child], child))
            path_child = self.child(node, path_token_id)
            running_prob *= self.count[path_child] / self.continued[node]
            node = path_child
        options.sort(key=lambda option: (-option[0], option[1], option[2]))
        branches = []
        for prob, depth, token_id, child in options[:count]:
            rest = self.follow(child, max_tokens - depth - 1, min_token_prob, prob)
            branches.append((*candidate.token_ids[:depth], token_id, *rest.token_ids))
        return branches


@dataclass(frozen=True)
class _Candidate:
    token_ids: tuple[int, ...]
    score: float  # sum of the running probabilities = expected accepted tokens under the empirical model
    start: int = _NO_NODE  # the matched node the tokens continue


_EMPTY_CANDIDATE = _Candidate(token_ids=(), score=0.0)


def _max_match_length(max_depth: int, max_tokens: int) -> int:
    return max(1, max_depth - max_tokens)


class _RequestTrie:
    """One request's tokens and suffix trie, with the nodes of its current suffixes."""

    def __init__(self, max_depth: int, prompt_token_ids: Sequence[int]) -> None:
        self.max_depth = max_depth
        self.trie = _Trie()
        self.token_ids: list[int] = []
        self.suffix_nodes: list[int] = []  # [d - 1] = node of the suffix of length d
        self.extend(prompt_token_ids)
        self.prompt_length = len(self.token_ids)

    def extend(self, token_ids: Sequence[int]) -> None:
        for token_id in token_ids:
            token_id = int(token_id)
            self.suffix_nodes = self.trie.extend_suffixes(self.suffix_nodes, token_id, self.max_depth)
            self.token_ids.append(token_id)

    def propose(self, max_tokens: int, min_token_prob: float) -> _Candidate:
        """Follow the longest (capped) suffix of the sequence that occurred earlier with a continuation."""
        max_length = min(_max_match_length(self.max_depth, max_tokens), len(self.suffix_nodes))
        for length in range(max_length, 0, -1):
            node = self.suffix_nodes[length - 1]
            if self.trie.continued[node] > 0:
                return self.trie.follow(node, max_tokens, min_token_prob)
        return _EMPTY_CANDIDATE

    def shorter_matches(self, matched: int, max_tokens: int, min_token_prob: float) -> list[tuple[int, ...]]:
        """Continuations of the suffixes shorter than the matched one (longest first), each followed greedily."""
        max_length = min(_max_match_length(self.max_depth, max_tokens), len(self.suffix_nodes))
        nodes = [self.suffix_nodes[length - 1] for length in range(max_length, 0, -1)]
        shorter = nodes[nodes.index(matched) + 1 :] if matched in nodes else []
        candidates = (self.trie.follow(node, max_tokens, min_token_prob)
                      for node in shorter if self.trie.continued[node] > 0)
        return [candidate.token_ids for candidate in candidates if candidate.token_ids]


class _SequenceCache:
    """A suffix trie over the token sequences of the most recently finished requests."""

    def __init__(self, max_depth: int, capacity: int) -> None:
        self.max_depth = max_depth
        self.capacity = capacity
        self.trie = _Trie()
        self._token_ids_by_request: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._token_ids_by_request)

    def add(self, request_id: str, token_ids: tuple[int, ...]) -> None:
        if self.capacity == 0:
            return
        if request_id in self._token_ids_by_request:
            self._remove_sequence(self._token_ids_by_request.pop(request_id))
        suffix_nodes: list[int] = []
        for token_id in token_ids:
            suffix_nodes = self.trie.extend_suffixes(suffix_nodes, token_id, self.max_depth)
        self._token_ids_by_request[request_id] = token_ids
        while len(self._token_ids_by_request) > self.capacity:
            _, evicted_token_ids = self._token_ids_by_request.popitem(last=False)
            self._remove_sequence(evicted_token_ids)

    def _remove_sequence(self, token_ids: tuple[int, ...]) -> None:
        """Undo ``add``: subtract every (start, length <= max_depth) occurrence; drop nodes that reach 0."""
        trie = self.trie
        for start in range(len(token_ids)):
            node = 0
            for token_id in token_ids[start : start + self.max_depth]:
                child = trie.child(node, token_id)
                trie.count[child] -= 1
                trie.continued[node] -= 1
                if trie.count[child] == 0:
                    trie.remove_child(node, child)  # its whole subtree has count 0 as well
                    break
                node = child

    def propose(self, context: Sequence[int], max_tokens: int, min_token_prob: float) -> _Candidate:
        node = self._longest_match(context, _max_match_length(self.max_depth, max_tokens))
        return _EMPTY_CANDIDATE if node == _NO_NODE else self.trie.follow(node, max_tokens, min_token_prob)

    def _longest_match(self, context: Sequence[int], max_length: int) -> int:
        """Binary search: if a suffix of the context occurs with a continuation, so do all shorter ones."""
        shortest_missing = min(max_length, len(context)) + 1
        longest_found, longest_node = 0, _NO_NODE
        while shortest_missing - longest_found > 1:
            length = (longest_found + shortest_missing) // 2
            node = self._walk(context[len(context) - length :])
            if node != _NO_NODE and self.trie.continued[node] > 0:
                longest_found, longest_node = length, node
            else:
                shortest_missing = length
        return longest_node

    def _walk(self, token_ids: Sequence[int]) -> int:
        node = 0
        for token_id in token_ids:
            node = self.trie.child(node, token_id)
            if node == _NO_NODE:
                return _NO_NODE
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
        check_tree_args(num_branches)
        self.num_branches = num_branches
        self._tree_request_ids: set[str] = set()  # requests whose trees the engine verifies
        self.max_depth = max_depth
        self.min_token_prob = min_token_prob
        # a finished request's output goes to the cache with this many of its prompt's last tokens, so that the
        # same prompt's end (a repeated request) leads into the cached output
        self.cached_prompt_tail = max(1, max_depth // 4)
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
        noise: RequestNoise | None,
    ) -> None:
        if request_id in self._trie_by_request:
            raise ValueError(f"request id {request_id!r} is already tracked by the suffix drafter")
        self._trie_by_request[request_id] = _RequestTrie(self.max_depth, prompt_token_ids)
        if verifies_trees(params, noise):
            self._tree_request_ids.add(request_id)

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
        if self.num_branches == 1 or request_id not in self._tree_request_ids or not best.token_ids:
            return Draft(token_ids=best.token_ids, draft_probs=None)
        source = trie.trie if best is own_candidate else self._cache.trie
        others = source.other_branches(best, max_tokens, self.min_token_prob, self.num_branches - 1)
        if best is own_candidate:
            others += trie.shorter_matches(best.start, max_tokens, self.min_token_prob)
        return Draft.from_branches(distinct_branches([best.token_ids, *others], self.num_branches))

    def observe(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._trie(request_id).extend(token_ids)

    def remove_request(self, request_id: str) -> None:
        trie = self._trie(request_id)
        del self._trie_by_request[request_id]
        self._tree_request_ids.discard(request_id)
        self._cache.add(request_id, tuple(trie.token_ids[max(0, trie.prompt_length - self.cached_prompt_tail):]))

    def _trie(self, request_id: str) -> _RequestTrie:
        trie = self._trie_by_request.get(request_id)
        if trie is None:
            raise unknown_request_error(request_id, self._trie_by_request.keys())
        return trie
