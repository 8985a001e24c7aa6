"""6-bit weights ("q6"): GGUF Q6_K's blocks, repacked for the row-invariant CPU kernels.

The format keeps Q6_K's block structure exactly, so a Q6_K tensor of a GGUF loads losslessly (repacked, never
requantized): per output row, super-blocks of 256 inputs, each with an fp16 scale ``d`` and 16 sub-blocks of 16
inputs; sub-block ``l`` has a signed 8-bit scale ``sc_l``, and every input a 6-bit quant ``q`` in 0..63::

    weight = (d * sc_l) * (q - 32)

``in_features`` is a multiple of 256 (Q6_K's rule; :class:`Q6ShapeError` otherwise). Q4_K_M files store their
output layer and half of their ``ffn_down`` and ``attn_v`` layers as Q6_K: held as q6 they stream 6.56 bits a
weight instead of q8's 8.5, and their weights are the file's exactly (q8 requantizes them).

Storage, 210 bytes per row and super-block, as Q6_K's (6.5625 bits per weight):

* ``quants`` uint8 ``[out, in * 3/4]``: per super-block (a kernel unit) 3 chunks of 64 bytes in the kernel's
  order (``csrc/q6_scalar.h``): vector ``j`` (< 4) of a unit, byte ``4 l + i``, is input ``16 l + 4 j + i`` of
  the super-block (lane ``l`` = sub-block ``l``); chunk ``c`` < 2 holds the low 4 bits of vector ``c`` in its low
  nibbles and of vector ``c + 2`` in its high nibbles, chunk 2 the high 2 bits of vector ``p`` in bits
  ``2 p .. 2 p + 1``. Rows are stored in tiles of 4 (memory order ``[out/4][in*3/256 chunks][4 rows][64 B]``),
  the last ``out % 4`` rows plainly: ``quants[i]`` is not row ``i``.
* ``scales`` uint8 ``[out, in/256 * 18]``, natural row order: per super-block its 16 int8 ``sc`` and its fp16
  ``d``.

Activations are quantized as q8_linear's (int8 per block of 32, fp32 scale amax/127). The kernel's reduction
order per output element (the same on the scalar, avx2 and avx512 paths, whatever the rows of the call or the
threads) is spelled out in ``csrc/q6_scalar.h``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from specdec.kernels.blocks import block_linear, dense_linear, gguf_blocks, tile_rows, untile_rows

__all__ = ["Q6ShapeError", "Q6Blocks", "Q6Weight", "q6_from_q6k_blocks", "q6_linear", "q6_supports"]

SUPER_BLOCK = 256  # inputs per super-block (Q6_K's QK_K) and kernel unit
SUB_BLOCK = 16  # inputs per sub-block (one scale)
SUB_BLOCKS = SUPER_BLOCK // SUB_BLOCK
UNIT_BYTES = 192  # quant bytes per row and super-block: 3 chunks of 64
SCALE_BYTES = 18  # scale bytes per row and super-block: 16 int8 sc, fp16 d
Q6K_BLOCK_BYTES = 210  # one GGUF Q6_K super-block: ql[128], qh[64], int8 scales[16], fp16 d
QUANT_MAX = 63


class Q6ShapeError(ValueError):
    """in_features is not a multiple of 256: the layer cannot be q6."""


def q6_supports(in_features: int) -> bool:
    """Whether a Q6_K tensor with ``in_features`` inputs loads as q6 (a multiple of 256, Q6_K's rule)."""
    return in_features > 0 and in_features % SUPER_BLOCK == 0


def _check_in_features(in_features: int) -> None:
    if not q6_supports(in_features):
        raise Q6ShapeError(f"q6 needs in_features to be a multiple of {SUPER_BLOCK} (Q6_K super-blocks), got "
                           f"{in_features}")


class Q6Blocks(NamedTuple):
    """A q6 weight in natural order (what the packed tensors hold, unpacked)."""

    quants: torch.Tensor  # [out, in] uint8, 0..63
    sub_scales: torch.Tensor  # [out, in/16] int8
    d: torch.Tensor  # [out, in/256] fp16


def _pack_quants(quants: torch.Tensor) -> torch.Tensor:
    """[out, in] uint8 0..63 -> the rows' packed bytes [out, in * 3/4] (natural row order, not yet tiled)."""
    out, in_features = quants.shape
    # vector j of a unit, byte 4 l + i: input 16 l + 4 j + i -> [out, units, 4 vectors, 64 bytes]
    vectors = quants.view(out, -1, 16, 4, 4).transpose(2, 3).reshape(out, -1, 4, 64)
    nibbles = (vectors[:, :, 0:2] & 0x0F) | ((vectors[:, :, 2:4] & 0x0F) << 4)  # [out, units, 2, 64]
    pairs = vectors >> 4  # [out, units, 4, 64], 0..3
    high_bits = pairs[:, :, 0] | (pairs[:, :, 1] << 2) | (pairs[:, :, 2] << 4) | (pairs[:, :, 3] << 6)
    return torch.cat([nibbles, high_bits.unsqueeze(2)], dim=2).reshape(out, -1)


def _unpack_quants(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of _pack_quants: [out, in * 3/4] -> [out, in] uint8 0..63."""
    out = packed.shape[0]
    units = packed.view(out, -1, 3, 64)
    nibbles, high_bits = units[:, :, 0:2], units[:, :, 2:3]
    low = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=2)  # [out, units, 4 vectors, 64]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    vectors = low | (((high_bits >> shifts) & 0x03) << 4)
    return vectors.view(out, -1, 4, 16, 4).transpose(2, 3).reshape(out, -1)


@dataclass(frozen=True, eq=False)
class Q6Weight:
    """A 6-bit weight in the kernel's layout (see the module docstring)."""

    quants: torch.Tensor  # [out, in * 3/4] uint8, kernel order, rows in tiles of 4
    scales: torch.Tensor  # [out, in/256 * 18] uint8: per super-block 16 int8 sc, fp16 d
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def out_features(self) -> int:
        return self.quants.shape[0]

    @property
    def in_features(self) -> int:
        return self.quants.shape[1] * SUPER_BLOCK // UNIT_BYTES

    @property
    def nbytes(self) -> int:
        """Bytes a forward streams: the quants and the scales."""
        return self.quants.numel() + self.scales.numel()

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / (self.out_features * self.in_features)

    def clone(self) -> "Q6Weight":
        """A copy in new memory (benchmarks cycle through copies so that every call reads its weight from DRAM)."""
        return Q6Weight(self.quants.clone(), self.scales.clone())

    @classmethod
    def from_blocks(cls, blocks: Q6Blocks) -> "Q6Weight":
        """Pack a natural-order weight (quants 0..63, int8 sub-block scales, fp16 d) of a multiple of 256
        columns."""
        out, in_features = blocks.quants.shape
        _check_in_features(in_features)
        super_blocks = in_features // SUPER_BLOCK
        expected = {"sub_scales": ((out, super_blocks * SUB_BLOCKS), torch.int8),
                    "d": ((out, super_blocks), torch.float16)}
        for name, (shape, dtype) in expected.items():
            part = getattr(blocks, name)
            if tuple(part.shape) != shape or part.dtype != dtype:
                raise ValueError(f"{name} must be {dtype} {list(shape)}, got {part.dtype} {list(part.shape)}")
        quants = blocks.quants.to(torch.uint8)
        if bool((quants > QUANT_MAX).any()):
            raise ValueError(f"quants must lie in 0..{QUANT_MAX}")
        scales = torch.cat([blocks.sub_scales.contiguous().view(torch.uint8).view(out, super_blocks, SUB_BLOCKS),
                            blocks.d.contiguous().view(torch.uint8).view(out, super_blocks, 2)], dim=2)
        return cls(tile_rows(_pack_quants(quants)).contiguous(), scales.reshape(out, -1).contiguous())

    def blocks(self) -> Q6Blocks:
        """The weight in natural order (exactly what :meth:`from_blocks` packed)."""
        out = self.out_features
        scales = self.scales.view(out, -1, SCALE_BYTES)
        return Q6Blocks(_unpack_quants(untile_rows(self.quants)),
                        scales[:, :, :SUB_BLOCKS].contiguous().view(torch.int8).reshape(out, -1),
                        scales[:, :, SUB_BLOCKS:].contiguous().view(torch.float16).reshape(out, -1))

    def dequantize(self) -> torch.Tensor:
        """[out, in] fp32: (d * sc) * (q - 32), bitwise as gguf-py's Q6_K dequantization."""
        blocks = self.blocks()
        out = self.out_features
        sub_scale = blocks.d.to(torch.float32).repeat_interleave(SUB_BLOCKS, dim=1) * blocks.sub_scales.to(
            torch.float32)  # [out, in/16]
        values = blocks.quants.to(torch.float32).view(out, -1, SUB_BLOCK) - 32.0
        return (sub_scale[:, :, None] * values).view(out, self.in_features)

    def rows(self, row_ids) -> "Q6Weight":
        """The weight of output rows ``row_ids`` only; a q6_linear with it gives bit for bit those columns of the
        full weight's (each output element is computed alone)."""
        ids = torch.as_tensor(row_ids, dtype=torch.long).reshape(-1)
        return Q6Weight.from_blocks(Q6Blocks(*(part.index_select(0, ids) for part in self.blocks())))


def q6_from_q6k_blocks(raw, out_features: int, in_features: int) -> Q6Weight:
    """A GGUF Q6_K tensor's bytes (uint8 tensor or ndarray [out, in/256 * 210]) -> Q6Weight, losslessly: its
    dequantization equals gguf-py's of the same bytes bit for bit."""
    _check_in_features(in_features)
    super_blocks = in_features // SUPER_BLOCK
    blocks = gguf_blocks(raw, "Q6_K", out_features, in_features, SUPER_BLOCK, Q6K_BLOCK_BYTES)
    count = blocks.shape[0]
    # per 128-value half: 64 bytes of ql (values 0-63 in their low nibbles, 64-127 in their high nibbles) and 32
    # of qh (bit pair g of byte i: value 32 g + i)
    ql = blocks[:, :128].reshape(count, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    low = (ql & 0x0F).reshape(count, 2, 4, 32)
    qh = blocks[:, 128:192].reshape(count, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    quants = low | ((qh & 0x03) << 4)  # [count, 2, 4, 32]
    sub_scales = blocks[:, 192:208].contiguous().view(torch.int8).reshape(out_features, -1)
    d = blocks[:, 208:210].contiguous().view(torch.float16).reshape(out_features, super_blocks)
    return Q6Weight.from_blocks(Q6Blocks(quants.reshape(out_features, in_features), sub_scales, d))


def q6_linear(x: torch.Tensor, weight: Q6Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> [..., out] fp32. Bitwise row invariant on the CPU kernels; the torch fallback (CUDA, no
    extension) is close but not row invariant, and does not quantize the activations."""
    return block_linear("q6_linear", x, weight, bias, lambda ext, rows: ext.q6_linear(
        rows, weight.quants, weight.scales, bias))


def q6_linear_torch(x: torch.Tensor, weight: Q6Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The fallback: F.linear on the dequantized weight (cached per dtype and device)."""
    return dense_linear(x, weight, bias)
