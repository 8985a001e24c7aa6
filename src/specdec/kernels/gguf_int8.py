"""GGUF block types whose weights are exactly int8 values with one fp16 scale per block of 32 inputs: Q8_0
(``d * q``, q in -128..127), Q5_0 (``d * (v - 16)``, v in 0..31) and Q4_0 (``d * (v - 8)``, v in 0..15). Their values
and scales are a q8 weight's (int8 per input, fp16 per block of 32, ``ops.QuantizedWeight``) exactly, so q8 loads
them losslessly from the file's bytes instead of requantizing the dequantized weight, and q5 stores Q5_0's in 5 bits.
"""

from __future__ import annotations

import torch

from specdec.kernels.blocks import gguf_blocks

BLOCK = 32  # inputs per block of all three types
BLOCK_BYTES = {"Q8_0": 34, "Q5_0": 22, "Q4_0": 18}  # fp16 d, then the block's quants


def int8_blocks(raw, storage_type: str, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF tensor's bytes (uint8 tensor or ndarray [out, in/32 * block bytes]) of ``storage_type`` -> its int8
    values [out, in] and fp16 block scales [out, in/32]: ``scale * value`` is gguf-py's dequantization bit for bit."""
    block_bytes = BLOCK_BYTES.get(storage_type)
    if block_bytes is None:
        raise ValueError(f"{storage_type} is not an int8 block type; choose one of {', '.join(BLOCK_BYTES)}")
    if in_features <= 0 or in_features % BLOCK:
        raise ValueError(f"a {storage_type} tensor has whole blocks of {BLOCK} inputs, got {in_features}")
    blocks_per_row = in_features // BLOCK
    blocks = gguf_blocks(raw, storage_type, out_features, in_features, BLOCK, block_bytes)  # [blocks, block bytes]
    scale = blocks[:, 0:2].contiguous().view(torch.float16).reshape(out_features, blocks_per_row)
    values = torch.empty(blocks.shape[0], BLOCK, dtype=torch.int8)  # [blocks, 32]
    for start in range(0, blocks.shape[0], _DECODE_BLOCKS):  # bounded temporaries (an embedding table has millions)
        values[start : start + _DECODE_BLOCKS] = _decode(blocks[start : start + _DECODE_BLOCKS], storage_type)
    return values.reshape(out_features, in_features), scale


_DECODE_BLOCKS = 1 << 18  # blocks decoded at a time


def _decode(blocks: torch.Tensor, storage_type: str) -> torch.Tensor:
    """[n, block bytes] uint8 -> the blocks' int8 values [n, 32]."""
    if storage_type == "Q8_0":
        return blocks[:, 2:].contiguous().view(torch.int8)
    if storage_type == "Q5_0":
        fifth = (blocks[:, 2:6].contiguous().view(torch.int32) >> torch.arange(32, dtype=torch.int32)) & 1
        qs = blocks[:, 6:22]
        low = torch.cat([qs & 0x0F, qs >> 4], dim=1)  # values 0-15 in the low nibbles, 16-31 in the high ones
        return ((low.to(torch.int16) | (fifth.to(torch.int16) << 4)) - 16).to(torch.int8)
    qs = blocks[:, 2:18]  # Q4_0
    return (torch.cat([qs & 0x0F, qs >> 4], dim=1).to(torch.int16) - 8).to(torch.int8)
