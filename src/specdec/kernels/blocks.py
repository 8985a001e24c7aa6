"""What the block-quantized weight formats (q4: kernels/q4.py, q6: kernels/q6.py) share: their rows stored in tiles
of 4, the call of their CPU kernel with the torch fallback beside it, and the fallback's cached dense weight; and what
every import of a GGUF tensor's blocks (q4, q6, gguf_int8) does first: its bytes checked and cut into blocks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from specdec.kernels import ops

ROW_TILE = 4  # weight rows per tile of a block format's quants
CHUNK = 64  # bytes of a chunk (one 512-bit vector)


def gguf_blocks(raw, storage_type: str, out_features: int, in_features: int, block_values: int,
                block_bytes: int) -> torch.Tensor:
    """A GGUF tensor's bytes (uint8 tensor or ndarray [out, in/block_values * block_bytes]) of ``storage_type`` ->
    its blocks [out * in/block_values, block_bytes] uint8, in file order; refuses a byte count that is not the
    tensor's."""
    if isinstance(raw, np.ndarray):
        raw = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8))
    expected = out_features * (in_features // block_values) * block_bytes
    if raw.numel() != expected:
        raise ValueError(f"a {storage_type} tensor [{out_features}, {in_features}] has {expected} bytes, "
                         f"got {raw.numel()}")
    return raw.contiguous().view(torch.uint8).reshape(-1, block_bytes)


def tile_rows(rows: torch.Tensor) -> torch.Tensor:
    """Per-row bytes [out, C] (C a multiple of 64) -> tiles of 4 rows, chunk-interleaved; the last out % 4 plain."""
    out, width = rows.shape
    full = out // ROW_TILE * ROW_TILE
    tiled = torch.empty_like(rows)
    tiled[:full] = (
        rows[:full].view(full // ROW_TILE, ROW_TILE, width // CHUNK, CHUNK).transpose(1, 2).reshape(full, width)
    )
    tiled[full:] = rows[full:]
    return tiled


def untile_rows(tiled: torch.Tensor) -> torch.Tensor:
    """Inverse of tile_rows."""
    out, width = tiled.shape
    full = out // ROW_TILE * ROW_TILE
    rows = torch.empty_like(tiled)
    rows[:full] = (
        tiled[:full].view(full // ROW_TILE, width // CHUNK, ROW_TILE, CHUNK).transpose(1, 2).reshape(full, width)
    )
    rows[full:] = tiled[full:]
    return rows


class BlockWeight(Protocol):
    """A weight of a block format: its layer's widths, its dequantization and a cache for the fallback."""

    in_features: int
    _cache: dict

    def dequantize(self) -> torch.Tensor: ...


def dense_linear(x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch fallback of a block format's linear: F.linear on the dequantized weight, fp32 out."""
    dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    dense = ops.dense_weight(weight, dtype, x.device)
    y = F.linear(x.to(dtype), dense, None if bias is None else bias.to(device=x.device, dtype=dtype))
    return y.to(torch.float32)


def block_linear(name: str, x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None,
                 kernel: Callable[[object, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [..., in] -> [..., out] fp32: ``kernel(extension, rows [M, in])`` on the CPU where the kernels are built
    (bitwise row invariant), else dense_linear (close, not row invariant, activations not quantized)."""
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"{name}: x has {x.shape[-1]} features, weight expects {weight.in_features}")
    if x.is_cpu:
        ext = ops._load()
        if ext is not None:
            rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            y = kernel(ext, rows)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])
    return dense_linear(x, weight, bias)
