"""A forward batch: the ragged new tokens of several sequences flattened into rows.

Sequence i contributes ``len(token_ids[i])`` consecutive rows at positions ``start[i], start[i]+1, ...``;
each row attends its own sequence's cache up to and including its own position (causal), which is
how a block of draft tokens is verified in one pass.
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

    @classmethod
    def build(
        cls,
        token_ids: Sequence[Sequence[int]],
        starts: Sequence[int],
        slots: Sequence[int],
        all_logits: bool,
        device: torch.device | str = "cpu",
    ) -> "ForwardBatch":
        """all_logits: logits for every row (verification) or only each sequence's last row (prefill/decode)."""
        counts = tuple(len(ids) for ids in token_ids)
        if any(count == 0 for count in counts):
            raise ValueError("every sequence in a forward batch needs at least one token")
        flat_ids = [tok for ids in token_ids for tok in ids]
        positions = [start + offset for start, count in zip(starts, counts) for offset in range(count)]
        row_slots = [slot for slot, count in zip(slots, counts) for _ in range(count)]
        ends = torch.tensor(counts).cumsum(0)
        logits_rows = torch.arange(len(flat_ids)) if all_logits else ends - 1
        as_long = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
        return cls(as_long(flat_ids), as_long(positions), as_long(row_slots), counts, logits_rows.to(device), all_logits)

    def split_logits(self, logits: torch.Tensor) -> list[torch.Tensor]:
        """logits [logit rows, vocab] -> per-sequence [rows_i or 1, vocab]."""
        return list(logits.split(list(self.row_counts) if self.all_logits else 1))
