"""KV cache preallocated per sequence slot and indexed by position.

A sequence owns one slot. Its keys/values for position p live at ``[layer][slot, :, p, :]``; how many
positions are valid is the sequence's own length, kept by the engine. Rolling back after rejected draft
tokens is therefore free: the engine sets a shorter length and the stale entries are overwritten by the
next write at those positions (attention never reads past a query's own position).

Token trees write their nodes at scratch positions after the sequence's last token; after verification
the accepted path is gather-copied into consecutive positions (``compact``).

Entries are fp32 or fp16 (``dtype``; a model's default is ``Transformer.kv_cache_dtype``). A write rounds the
keys/values to the cache's dtype; attention reads them back as exact fp32 values, so every path that reads a
position (plain decoding, a verify block, a tree, another slot's batch) sees the same numbers.
"""
from __future__ import annotations

import torch

from specdec.kernels import kv_write
from specdec.models.config import ModelConfig


KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16}


def kv_cache_dtype(name: str, default: torch.dtype) -> torch.dtype:
    """The cache dtype a `kv_cache_dtype` option names: "auto" (= default, the model's own), "float32", "float16"."""
    if name == "auto":
        return default
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; choose one of auto, {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


class KVCache:
    def __init__(self, config: ModelConfig, num_slots: int, max_len: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"KV cache needs num_slots >= 1 and max_len >= 1, got {num_slots}, {max_len}")
        if dtype not in KV_CACHE_DTYPES.values():
            raise ValueError(f"KV cache dtype must be torch.float32 or torch.float16, got {dtype}")
        self.num_slots = num_slots
        self.max_len = max_len
        self.dtype = dtype
        shape = (num_slots, config.num_kv_heads, max_len, config.head_dim)
        self.keys = [
            torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)
        ]  # each [slots, kv_heads, max_len, head_dim]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self._free_slots = list(range(num_slots - 1, -1, -1))

    def write(
        self, layer: int, slots: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """slots, positions [tokens]; keys, values [tokens, kv_heads, head_dim] fp32 (rounded to the cache dtype)."""
        kv_write(self.keys[layer], self.values[layer], slots, positions, keys, values)

    def compact(self, slot: int, src_positions: list[int], dst_positions: list[int]) -> None:
        """Copies the keys/values at src_positions to dst_positions of one slot, in every layer.

        All sources are read before any destination is written, so the two lists may overlap.
        """
        if len(src_positions) != len(dst_positions):
            raise ValueError(f"compact got {len(src_positions)} source but {len(dst_positions)} destination positions")
        out_of_range = [p for p in [*src_positions, *dst_positions] if not 0 <= p < self.max_len]
        if out_of_range:
            raise ValueError(f"compact positions {out_of_range[:5]} outside [0, {self.max_len})")
        device = self.keys[0].device
        src = torch.tensor(src_positions, dtype=torch.int64, device=device)
        dst = torch.tensor(dst_positions, dtype=torch.int64, device=device)
        for cache in self.keys + self.values:  # each [slots, kv_heads, max_len, head_dim]
            cache[slot, :, dst] = cache[slot, :, src]

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
