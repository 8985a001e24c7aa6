"""Reusable prompt prefixes: copies of KV-cache entries of earlier requests, keyed by their tokens.

Requests to one server usually share a prefix (the chat template's system turn, a few-shot preamble, a
document asked about twice). A model whose KV at positions 0 .. L-1 depends only on tokens 0 .. L-1 (every
causal transformer here; row invariance makes the values bitwise those of a fresh prefill) can copy them
from an earlier request instead of recomputing them. The draft model uses this for its own cache (its
prompt prefill is paid at a request's first draft, and on short answers that prefill is most of what
speculation costs), and the target engine for its own (`prefix_cache_tokens`: a shared system turn, the next
turn of a chat), both through `PrefixCache`.

Entries are the committed tokens of a request at the time they were saved and, per layer, the keys and
values of those positions ([kv_heads, length, head_dim] each). The store holds at most `max_tokens` tokens in
all; the least recently used entries are dropped first.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

from specdec.cache.kv_cache import KVCache


@dataclass(frozen=True)
class PrefixEntry:
    token_ids: tuple[int, ...]
    keys: list[torch.Tensor]  # per layer [kv_heads, len(token_ids), head_dim]
    values: list[torch.Tensor]


class PrefixStore:
    def __init__(self, max_tokens: int, min_match: int = 16) -> None:
        if max_tokens < 0 or min_match < 1:
            raise ValueError(f"PrefixStore needs max_tokens >= 0 and min_match >= 1, got {max_tokens}, {min_match}")
        self.max_tokens = max_tokens
        self.min_match = min_match
        self._entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()  # least recently used first
        self._num_tokens = 0
        self.version = 0  # changes whenever an entry is added or dropped (what a match can find changes)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def longest_match(self, token_ids: Sequence[int]) -> tuple[PrefixEntry | None, int]:
        """The entry sharing the longest prefix with token_ids and that length (None, 0 below min_match)."""
        best, best_length = None, 0
        for entry in self._entries.values():
            length = common_prefix_length(entry.token_ids, token_ids)
            if length > best_length:
                best, best_length = entry, length
        if best is None or best_length < self.min_match:
            return None, 0
        self._entries.move_to_end(best.token_ids)
        return best, best_length

    def load(self, cache: KVCache, slot: int, entry: PrefixEntry, length: int) -> None:
        """Writes the entry's first `length` positions into positions 0 .. length-1 of `slot`."""
        for layer, (keys, values) in enumerate(zip(entry.keys, entry.values)):
            cache.keys[layer][slot, :, :length] = keys[:, :length]
            cache.values[layer][slot, :, :length] = values[:, :length]

    def save(self, cache: KVCache, slot: int, token_ids: Sequence[int]) -> None:
        """Keeps positions 0 .. len(token_ids)-1 of `slot` (which hold token_ids), replacing entries it extends."""
        key = tuple(token_ids)
        if len(key) < self.min_match or len(key) > self.max_tokens:
            return
        for other in self._entries:
            if len(other) >= len(key) and other[: len(key)] == key:  # already covered by a longer entry
                self._entries.move_to_end(other)
                return
        for other in [k for k in self._entries if len(k) <= len(key) and key[: len(k)] == k]:
            self._drop(other)  # a prefix of this one (or the same): the new entry covers it
        length = len(key)
        entry = PrefixEntry(key, [k[slot, :, :length].clone() for k in cache.keys],
                            [v[slot, :, :length].clone() for v in cache.values])
        self._entries[key] = entry
        self._num_tokens += length
        self.version += 1
        while self._num_tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[int, ...]) -> None:
        del self._entries[key]
        self._num_tokens -= len(key)
        self.version += 1


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


class PrefixCache:
    """A model's prefix cache (the target engine's, the draft model's): a PrefixStore plus the rules and counters
    of reusing it.

    A new sequence copies the longest stored prefix of its tokens into its slot, but never its last token, whose
    logits are needed next. Counters are in tokens, as vLLM's prefix_cache_queries / _hits.
    """

    def __init__(self, max_tokens: int, min_match: int = 16) -> None:
        self.store = PrefixStore(max_tokens, min_match)
        self.queried_tokens = 0  # prompt tokens of the requests that looked the store up
        self.hit_tokens = 0  # of those, the tokens copied instead of prefilled

    def reuse(self, cache: KVCache, slot: int, token_ids: Sequence[int]) -> int:
        """Copies the longest stored prefix of token_ids (at most all but the last token) into positions 0.. of
        `slot`; returns how many positions it filled (0: nothing long enough was stored)."""
        self.queried_tokens += len(token_ids)
        entry, length = self.store.longest_match(token_ids[:-1])
        if entry is None:
            return 0
        self.store.load(cache, slot, entry, length)
        self.hit_tokens += length
        return length

    def match_length(self, token_ids: Sequence[int]) -> int:
        """How many positions `reuse` would fill for token_ids now (counted as a use of the entry, not as a query)."""
        return self.store.longest_match(token_ids[:-1])[1]

    def keep(self, cache: KVCache, slot: int, token_ids: Sequence[int]) -> None:
        """Stores positions 0 .. len(token_ids)-1 of `slot`, which hold token_ids."""
        self.store.save(cache, slot, token_ids)
