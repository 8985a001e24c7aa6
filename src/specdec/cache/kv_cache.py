"""KV cache preallocated per sequence slot and indexed by position.

A sequence owns one slot. Its keys/values for position p live at ``[layer][slot, :, p, :]``; how many
positions are valid is the sequence's own length, kept by the engine. Rolling back after rejected draft
tokens is therefore free: the engine sets a shorter length and the stale entries are overwritten by the
next write at those positions (attention never reads past a query's own position).
"""
from __future__ import annotations

import torch

from specdec.models.config import ModelConfig


class KVCache:
    def __init__(self, config: ModelConfig, num_slots: int, max_len: int, device: torch.device | str = "cpu") -> None:
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"KV cache needs num_slots >= 1 and max_len >= 1, got {num_slots}, {max_len}")
        self.num_slots = num_slots
        self.max_len = max_len
        shape = (num_slots, config.num_kv_heads, max_len, config.head_dim)
        self.keys = [torch.zeros(shape, device=device) for _ in range(config.num_layers)]  # each [slots, kv_heads, max_len, head_dim]
        self.values = [torch.zeros(shape, device=device) for _ in range(config.num_layers)]
        self._free_slots = list(range(num_slots - 1, -1, -1))

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """slots, positions [tokens]; keys, values [tokens, kv_heads, head_dim]."""
        self.keys[layer][slots, :, positions] = keys
        self.values[layer][slots, :, positions] = values

    def allocate(self) -> int:
        if not self._free_slots:
            raise RuntimeError(f"all {self.num_slots} KV cache slots are in use")
        return self._free_slots.pop()

    def free(self, slot: int) -> None:
        if slot in self._free_slots or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not allocated")
        self._free_slots.append(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
