"""A forward batch: the ragged new tokens of several sequences flattened into rows.

Sequence i contributes ``len(token_ids[i])`` consecutive rows at positions ``start[i], start[i]+1, ...``;
each row attends its own sequence's cache up to and including its own position (causal), which is
how a block of draft tokens is verified in one pass.

A sequence may instead contribute a token tree (``parents``): row j > 0 is a tree node whose parent is
row ``parents[j]``. Its K/V is written at the unique scratch cache position ``start + j`` while its RoPE
position is ``start + depth(j)``, and it attends the contiguous cache positions below ``prefix_end`` (the
committed prefix and the leading rows of its path that sit in place, i.e. at ``start + depth``) followed
by the cache positions of the rest of its path (``tree_keys``), in depth order. A row of a chain (or of
a tree's first branch) therefore attends exactly what it attends in a plain chain.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class ForwardBatch:
    token_ids: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows] int64
    slots: torch.Tensor  # [rows] int64, KV-cache slot of the row's sequence
    row_counts: tuple[int, ...]  # rows per sequence
    logits_rows: torch.Tensor  # [logit rows] int64, rows whose logits are computed
    all_logits: bool  # logits for every row (verification) or only each sequence's last row
    cache_positions: torch.Tensor  # [rows] int64, where the row's keys/values are written
    prefix_ends: torch.Tensor  # [rows] int32, the row attends the contiguous cache positions < prefix_end ...
    tree_keys: torch.Tensor | None  # ... then [rows, E] int32 cache positions (-1 pads); None: no tree rows

    @classmethod
    def build(
        cls,
        token_ids: Sequence[Sequence[int]],
        starts: Sequence[int],
        slots: Sequence[int],
        all_logits: bool,
        device: torch.device | str = "cpu",
        parents: Sequence[Sequence[int] | None] | None = None,
        last_logits: Sequence[bool] | None = None,
    ) -> "ForwardBatch":
        """all_logits: logits for every row (verification) or only each sequence's last row (prefill/decode).

        parents: per sequence None (a chain) or the parent row of each row (-1 for row 0, then
        0 <= parents[j] < j): a token tree rooted at the sequence's first row.
        last_logits: without all_logits, per sequence whether its last row's logits are wanted (default: all);
        a prefill chunk that does not end its prompt wants none.
        """
        parents = parents if parents is not None else [None] * len(token_ids)
        rows = [_rows(start, len(ids), seq_parents) for start, ids, seq_parents in zip(starts, token_ids, parents)]
        positions, cache_positions, prefix_ends, tree_keys = zip(*rows) if rows else ((), (), (), ())
        return cls.from_rows(token_ids, positions, cache_positions, prefix_ends, tree_keys, slots, device, all_logits,
                             last_logits)

    @classmethod
    def from_rows(
        cls,
        token_ids: Sequence[Sequence[int]],
        positions: Sequence[Sequence[int]],
        cache_positions: Sequence[Sequence[int]],
        prefix_ends: Sequence[Sequence[int]],
        tree_keys: Sequence[Sequence[Sequence[int]]],
        slots: Sequence[int],
        device: torch.device | str = "cpu",
        all_logits: bool = True,
        last_logits: Sequence[bool] | None = None,
    ) -> "ForwardBatch":
        """Rows given explicitly, per sequence: for a drafter growing a tree over several forwards, whose rows'
        ancestors were written by earlier forwards (and, through `build`, for chains and whole trees)."""
        counts = tuple(len(ids) for ids in token_ids)
        if any(count == 0 for count in counts):
            raise ValueError("every sequence in a forward batch needs at least one token")
        if last_logits is not None and (all_logits or len(last_logits) != len(counts)):
            raise ValueError(f"last_logits needs all_logits=False and one flag per sequence ({len(counts)}), "
                             f"got all_logits={all_logits} and {len(last_logits)} flags")
        flat = lambda values: [value for seq_values in values for value in seq_values]  # noqa: E731
        as_long = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
        row_slots = [slot for slot, count in zip(slots, counts) for _ in range(count)]
        if all_logits:
            logits_rows = torch.arange(sum(counts))
        else:
            wanted = [True] * len(counts) if last_logits is None else list(last_logits)
            ends = torch.tensor(counts).cumsum(0) - 1
            logits_rows = ends[torch.tensor(wanted, dtype=torch.bool)]
        return cls(as_long(flat(token_ids)), as_long(flat(positions)), as_long(row_slots), counts,
                   logits_rows.to(device), all_logits, as_long(flat(cache_positions)),
                   torch.tensor(flat(prefix_ends), dtype=torch.int32, device=device),
                   _tree_keys([list(keys) for keys in flat(tree_keys)], device))

    def split_logits(self, logits: torch.Tensor) -> list[torch.Tensor]:
        """logits [logit rows, vocab] -> per-sequence [rows_i or 1, vocab] (per wanted sequence with last_logits)."""
        return list(logits.split(list(self.row_counts) if self.all_logits else 1))


def _rows(
    start: int, count: int, parents: Sequence[int] | None
) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """One sequence's rows: RoPE positions, cache positions, prefix ends and tree keys (see ForwardBatch)."""
    cache_positions = [start + offset for offset in range(count)]
    if parents is None:
        return cache_positions, cache_positions, [p + 1 for p in cache_positions], [[] for _ in range(count)]
    if len(parents) != count or list(parents[:1]) != [-1] or any(not 0 <= p < j for j, p in enumerate(parents) if j):
        raise ValueError(f"tree parents must be [-1, then 0 <= parents[j] < j] for {count} rows, got {list(parents)}")
    paths: list[list[int]] = []
    for j, parent in enumerate(parents):
        paths.append([*paths[parent], j] if j else [0])
    positions, prefix_ends, tree_keys = [], [], []
    for path in paths:
        in_place = 0
        while in_place < len(path) and path[in_place] == in_place:
            in_place += 1
        positions.append(start + len(path) - 1)
        prefix_ends.append(start + in_place)
        tree_keys.append([start + row for row in path[in_place:]])
    return positions, cache_positions, prefix_ends, tree_keys


def _tree_keys(keys_per_row: list[list[int]], device: torch.device | str) -> torch.Tensor | None:
    """Rows' tree keys padded with -1 into [rows, E] int32; None when no row has any."""
    width = max((len(keys) for keys in keys_per_row), default=0)
    if width == 0:
        return None
    padded = [keys + [-1] * (width - len(keys)) for keys in keys_per_row]
    return torch.tensor(padded, dtype=torch.int32, device=device)
