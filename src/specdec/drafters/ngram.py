"""Prompt-lookup (n-gram) drafting: continue the sequence the way it continued last time.

For n from prompt_lookup_max down to prompt_lookup_min, take the last n tokens of prompt + output, find
their most recent earlier occurrence and propose the tokens that followed it. The most recent occurrence
of every n-gram is kept in a dict updated as tokens arrive, so a step costs O(max - min + 1) lookups
instead of a rescan of the sequence.

With num_branches > 1 (token trees: greedy requests, and sampled ones under exact acceptance) the drafter proposes
up to num_branches branches: the chain first, then alternatives that leave it: at each depth d of the chain
(shallowest first), the n-gram ending at sequence + chain[:d] is looked up again and the continuations of its other
occurrences (longest n first, most recent first) whose first token differs from chain[d] become branches chain[:d] +
continuation. Branches that repeat a prefix of an earlier branch add nothing and are skipped. The index then keeps
the last 4 * num_branches end positions of every n-gram.
"""
from __future__ import annotations

from collections.abc import Sequence

from specdec.config import SamplingParams
from specdec.drafters.base import Draft, Drafter, check_propose_args, unknown_request_error, verifies_trees
from specdec.drafters.tree import check_tree_args, distinct_branches
from specdec.verify.noise import RequestNoise

_OCCURRENCES_PER_BRANCH = 4  # end positions kept per n-gram and branch (repeats give the same continuation)


class _NgramIndex:
    """One request's tokens and, per n-gram, the end position (exclusive) of its latest earlier occurrence.

    "Earlier" means not the sequence's current suffix: the n-grams ending at len(token_ids) are only
    indexed when the next token arrives, so a lookup of the current suffix finds a previous occurrence.
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, num_branches: int = 1) -> None:
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.num_branches = num_branches
        self.max_ends = 1 if num_branches == 1 else _OCCURRENCES_PER_BRANCH * num_branches
        self.token_ids: list[int] = []
        self.last_end_by_ngram: dict[tuple[int, ...], int] = {}  # the latest end
        self.earlier_ends_by_ngram: dict[tuple[int, ...], list[int]] = {}  # older ends, oldest first (trees)

    def extend(self, token_ids: Sequence[int]) -> None:
        for token_id in token_ids:
            self._index_current_suffixes()
            self.token_ids.append(int(token_id))

    def _index_current_suffixes(self) -> None:
        end = len(self.token_ids)
        longest = min(self.prompt_lookup_max, end)
        for n in range(self.prompt_lookup_min, longest + 1):
            ngram = tuple(self.token_ids[end - n : end])
            previous_end = self.last_end_by_ngram.get(ngram)
            self.last_end_by_ngram[ngram] = end
            if self.max_ends > 1 and previous_end is not None:
                earlier = self.earlier_ends_by_ngram.setdefault(ngram, [])
                earlier.append(previous_end)
                del earlier[: len(earlier) - (self.max_ends - 1)]

    def propose(self, max_tokens: int) -> tuple[int, ...]:
        """The continuation of the longest suffix n-gram seen before, at most max_tokens long."""
        if max_tokens == 0:
            return ()
        length = len(self.token_ids)
        for n in range(min(self.prompt_lookup_max, length), self.prompt_lookup_min - 1, -1):
            previous_end = self.last_end_by_ngram.get(tuple(self.token_ids[length - n :]))
            if previous_end is not None:
                return tuple(self.token_ids[previous_end : min(previous_end + max_tokens, length)])
        return ()

    def propose_branches(self, max_tokens: int) -> list[tuple[int, ...]]:
        """Up to num_branches distinct continuations: the chain (propose) first, then the alternatives that
        leave it at each depth, shallowest first (see the module docstring)."""
        return distinct_branches(self._branch_candidates(self.propose(max_tokens), max_tokens), self.num_branches)

    def _branch_candidates(self, chain: tuple[int, ...], max_tokens: int):
        """The chain, then at each depth d the continuations that leave it there: chain[:d] + continuation."""
        if chain:
            yield chain
        for depth in range(len(chain)):
            for continuation in self._continuations(chain[:depth], max_tokens - depth):
                if continuation[0] != chain[depth]:
                    yield (*chain[:depth], *continuation)

    def _continuations(self, draft_prefix: tuple[int, ...], max_tokens: int):
        """Continuations of the earlier occurrences of the suffixes of sequence + draft_prefix: longest
        n-gram first, then most recent first."""
        length = len(self.token_ids)
        tail = (*self.token_ids[-self.prompt_lookup_max :], *draft_prefix)
        for n in range(min(self.prompt_lookup_max, len(tail)), self.prompt_lookup_min - 1, -1):
            ngram = tail[len(tail) - n :]
            latest = self.last_end_by_ngram.get(ngram)
            ends = [] if latest is None else [latest, *reversed(self.earlier_ends_by_ngram.get(ngram, []))]
            for end in ends:
                if end < length:
                    yield tuple(self.token_ids[end : min(end + max_tokens, length)])


class NgramDrafter(Drafter):
    """Prompt lookup over prompt + output; point-mass drafts (draft_probs None)."""

    def __init__(self, prompt_lookup_max: int, prompt_lookup_min: int, num_branches: int = 1) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got min={prompt_lookup_min}, "
                f"max={prompt_lookup_max}"
            )
        check_tree_args(num_branches)
        self.prompt_lookup_max = prompt_lookup_max
        self.prompt_lookup_min = prompt_lookup_min
        self.num_branches = num_branches
        self._index_by_request: dict[str, _NgramIndex] = {}

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        noise: RequestNoise | None,
    ) -> None:
        if request_id in self._index_by_request:
            raise ValueError(f"request id {request_id!r} is already tracked by the ngram drafter")
        index = _NgramIndex(self.prompt_lookup_min, self.prompt_lookup_max,
                            self.num_branches if verifies_trees(params, noise) else 1)
        index.extend(prompt_token_ids)
        self._index_by_request[request_id] = index

    def propose(self, request_ids: Sequence[str], max_draft_tokens: Sequence[int]) -> list[Draft]:
        check_propose_args(request_ids, max_draft_tokens)
        return [
            self._propose_one(self._index(request_id), budget)
            for request_id, budget in zip(request_ids, max_draft_tokens)
        ]

    @staticmethod
    def _propose_one(index: _NgramIndex, max_tokens: int) -> Draft:
        if index.num_branches == 1:
            return Draft(token_ids=index.propose(max_tokens), draft_probs=None)
        return Draft.from_branches(index.propose_branches(max_tokens))

    def observe(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._index(request_id).extend(token_ids)

    def remove_request(self, request_id: str) -> None:
        self._index(request_id)
        del self._index_by_request[request_id]

    def _index(self, request_id: str) -> _NgramIndex:
        index = self._index_by_request.get(request_id)
        if index is None:
            raise unknown_request_error(request_id, self._index_by_request.keys())
        return index
