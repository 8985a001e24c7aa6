"""5-bit weights ("q5"): GGUF Q5_0's blocks, kept losslessly in 5.5 bits a weight, run bitwise as the int8 linear.

A Q5_0 block holds 32 weights ``d * (v - 16)``, ``v`` in 0..31, with one fp16 scale ``d``: its int8 values
``q = v - 16`` (-16..15) and its scale are exactly an int8 weight of q8 (``ops.QuantizedWeight``, "vnni" layout) with
its fp16 block scales. q8 holds such a layer in 8.5 bits a weight; q5 stores the same bytes of the vnni layout in 5
bits each (the layout is spelled out in ``csrc/q5_scalar.h``):

* ``quants`` uint8 ``[out, Kp/64 * 40]`` (``Kp``: ``in_features`` padded to a multiple of 64): every 64-byte chunk of
  the vnni layout (bytes ``u = q + 128`` in the kernel's unit order) as 32 bytes of low nibbles (byte ``i``: chunk
  bytes ``i`` and ``i + 32``) and 8 bytes of fifth bits (bit ``k`` of byte ``j``: chunk byte ``8 k + j``); rows in
  tiles of 4, each tile its nibbles ``[Kp/64 chunks][4 rows][32 B]`` then its fifth bits ``[Kp/64 chunks][4 rows]
  [8 B]``; the last ``out % 4`` rows plainly (nibbles, then fifth bits): ``quants[i]`` is not row ``i``.
* ``scale`` fp16 ``[out, Kp/32]``, natural row order, one per block of 32 inputs (0 for padding blocks).

The kernel runs the int8 linear's own walk over q5's tiles: avx512 and scalar unpack each tile of 4 rows into the
vnni layout in L1 first, avx2 decodes each weight vector in registers and multiplies the unsigned 5-bit values, each
lane started so that it ends at q8's int32. So a q5 linear's output is bitwise q8_linear's on the same weights, on
every kernel path; a forward streams 5.5 bits a weight of such a layer instead of 8.5. Qwen2.5 and Gemma 3 Q4_K_M
files store their layers of widths that are no multiple of 256 (the attention and gate/up projections of
Gemma-3-270M and Qwen2.5-Coder-0.5B) as Q5_0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.kernels import ops
from specdec.kernels.blocks import ROW_TILE, block_linear, dense_linear
from specdec.kernels.gguf_int8 import int8_blocks

__all__ = ["Q5Weight", "q5_from_q5_0_blocks", "q5_linear", "q5_supports"]

BLOCK = 32  # inputs per block (one fp16 scale), Q5_0's QK5_0
CHUNK = 64  # inputs per chunk of the vnni layout
CHUNK_BYTES = 40  # bytes of a q5 chunk: 32 of low nibbles, 8 of fifth bits
Q_MIN, Q_MAX = -16, 15  # the int8 values a q5 weight holds
_BIT_WEIGHTS = (1 << torch.arange(8, dtype=torch.int32)).view(1, 1, 8, 1)  # bit k of a fifth-bit byte


def q5_supports(in_features: int) -> bool:
    """Whether a Q5_0 tensor with ``in_features`` inputs loads as q5 (whole blocks of 32, Q5_0's rule)."""
    return in_features > 0 and in_features % BLOCK == 0


def _padded(in_features: int) -> int:
    return -(-in_features // CHUNK) * CHUNK


def _encode_rows(unit_order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v = q + 16 (0..31) [out, Kp] in the vnni layout's unit order -> per row its nibbles [out, Kp/64, 32] and
    fifth bits [out, Kp/64, 8]."""
    out, kp = unit_order.shape
    chunks = unit_order.view(out, kp // CHUNK, CHUNK)
    nibbles = (chunks[:, :, :32] & 0x0F) | ((chunks[:, :, 32:] & 0x0F) << 4)
    fifth = (chunks >> 4).to(torch.int32).view(out, kp // CHUNK, 8, 8)  # [.., k, j]: chunk byte 8 k + j
    return nibbles, (fifth * _BIT_WEIGHTS).sum(dim=2).to(torch.uint8)  # byte j: bit k


def _decode_rows(nibbles: torch.Tensor, fifth_bits: torch.Tensor) -> torch.Tensor:
    """Inverse of _encode_rows: -> v [out, Kp] uint8 in unit order."""
    out, chunks = nibbles.shape[:2]
    low = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=2)  # [out, chunks, 64]
    fifth = (fifth_bits.to(torch.int32).unsqueeze(2) >> torch.arange(8, dtype=torch.int32).view(1, 1, 8, 1)) & 1
    return (low | (fifth.reshape(out, chunks, 64).to(torch.uint8) << 4)).reshape(out, -1)


def _tile(nibbles: torch.Tensor, fifth_bits: torch.Tensor) -> torch.Tensor:
    """Per-row nibbles [out, C, 32] and fifth bits [out, C, 8] -> quants [out, C * 40]: tiles of 4 rows (the tile's
    nibbles chunk-interleaved, then its fifth bits), the last out % 4 rows plain."""
    out, chunks = nibbles.shape[:2]
    full = out // ROW_TILE * ROW_TILE
    tiles = full // ROW_TILE

    def interleaved(part: torch.Tensor, width: int) -> torch.Tensor:  # [full, C, width] -> [tiles, C * 4 * width]
        tiled_part = part[:full].view(tiles, ROW_TILE, chunks, width).transpose(1, 2)
        return tiled_part.reshape(tiles, ROW_TILE * chunks * width)

    tiled = torch.cat([interleaved(nibbles, 32), interleaved(fifth_bits, 8)], dim=1).reshape(full, chunks * CHUNK_BYTES)
    plain = torch.cat([nibbles[full:].reshape(out - full, chunks * 32),
                       fifth_bits[full:].reshape(out - full, chunks * 8)], dim=1)
    return torch.cat([tiled, plain])


def _untile(quants: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of _tile: quants [out, C * 40] -> nibbles [out, C, 32], fifth bits [out, C, 8]."""
    out, width = quants.shape
    chunks = width // CHUNK_BYTES
    full = out // ROW_TILE * ROW_TILE
    tiles = quants[:full].reshape(full // ROW_TILE, ROW_TILE * width)
    split = ROW_TILE * chunks * 32

    def rows_of(part: torch.Tensor, width: int) -> torch.Tensor:  # [tiles, C * 4 * width] -> [full, C, width]
        return part.reshape(full // ROW_TILE, chunks, ROW_TILE, width).transpose(1, 2).reshape(full, chunks, width)

    nibbles, fifth_bits = rows_of(tiles[:, :split], 32), rows_of(tiles[:, split:], 8)
    plain = quants[full:]
    return (torch.cat([nibbles, plain[:, : chunks * 32].reshape(out - full, chunks, 32)]),
            torch.cat([fifth_bits, plain[:, chunks * 32 :].reshape(out - full, chunks, 8)]))


@dataclass(frozen=True, eq=False)
class Q5Weight:
    """A 5-bit weight in the kernel's layout (see the module docstring)."""

    quants: torch.Tensor  # [out, Kp/64 * 40] uint8, rows in tiles of 4
    scale: torch.Tensor  # [out, Kp/32] fp16
    in_features: int
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def out_features(self) -> int:
        return self.quants.shape[0]

    @property
    def in_padded(self) -> int:
        return self.quants.shape[1] // CHUNK_BYTES * CHUNK

    @property
    def nbytes(self) -> int:
        """Bytes a forward streams: the quants and the scales."""
        return self.quants.numel() + self.scale.numel() * self.scale.element_size()

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / (self.out_features * self.in_features)

    def clone(self) -> "Q5Weight":
        """A copy in new memory (benchmarks cycle through copies so that every call reads its weight from DRAM)."""
        return Q5Weight(self.quants.clone(), self.scale.clone(), self.in_features)

    @classmethod
    def from_int8(cls, q: torch.Tensor, scale: torch.Tensor) -> "Q5Weight":
        """Pack natural-order int8 ``q`` [out, in] (values in -16..15) and fp16 block scales ``scale``
        [out, ceil(in/32)] (or [out, Kp/32])."""
        out, in_features = q.shape
        kp = _padded(in_features)
        blocks = -(-in_features // BLOCK)
        if scale.dim() != 2 or scale.shape[0] != out or scale.shape[1] not in (blocks, kp // BLOCK):
            raise ValueError(f"scale must be [{out}, {blocks}] (one per row and block of {BLOCK}), "
                             f"got {tuple(scale.shape)}")
        if q.numel() and (int(q.min()) < Q_MIN or int(q.max()) > Q_MAX):
            raise ValueError(f"q5 holds int8 values in {Q_MIN}..{Q_MAX}, got {int(q.min())}..{int(q.max())}")
        padded_scale = torch.zeros(out, kp // BLOCK, dtype=torch.float16)
        padded_scale[:, :blocks] = scale[:, :blocks].to(torch.float16)
        values = torch.full((out, kp), -Q_MIN, dtype=torch.uint8)  # v = q + 16; padding q = 0
        values[:, :in_features] = (q.to(torch.int16) - Q_MIN).to(torch.uint8)
        unit_order = ops._interleave_blocks(values)
        return cls(_tile(*_encode_rows(unit_order)).contiguous(), padded_scale.contiguous(), in_features)

    def int8(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Natural-order int8 values [out (or len(rows)), in_features], -16..15."""
        nibbles, fifth_bits = _untile(self.quants)
        if rows is not None:
            ids = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
            nibbles, fifth_bits = nibbles.index_select(0, ids), fifth_bits.index_select(0, ids)
        unit_order = _decode_rows(nibbles, fifth_bits)
        natural = unit_order.index_select(1, ops._unpack_index(self.in_padded))[:, : self.in_features]
        return (natural.to(torch.int16) + Q_MIN).to(torch.int8)

    def dequantize(self) -> torch.Tensor:
        """[out, in] fp32: d * (v - 16), bitwise as gguf-py's Q5_0 dequantization."""
        scales = self.scale.to(torch.float32).repeat_interleave(BLOCK, dim=1)[:, : self.in_features]
        return self.int8().to(torch.float32) * scales

    def rows(self, row_ids) -> "Q5Weight":
        """The weight of output rows ``row_ids`` only; a q5_linear with it gives bit for bit those columns of the
        full weight's (each output element is computed alone)."""
        ids = torch.as_tensor(row_ids, dtype=torch.long).reshape(-1)
        return Q5Weight.from_int8(self.int8(ids), self.scale.index_select(0, ids))

    def as_q8(self) -> ops.QuantizedWeight:
        """The same weights as a q8 weight ("vnni" layout): q8_linear with it gives q5_linear's bits."""
        return ops.QuantizedWeight.from_int8(self.int8(), self.scale, layout="vnni")


def q5_from_q5_0_blocks(raw, out_features: int, in_features: int) -> Q5Weight:
    """A GGUF Q5_0 tensor's bytes (uint8 tensor or ndarray [out, in/32 * 22]) -> Q5Weight, losslessly: its
    dequantization equals gguf-py's of the same bytes bit for bit."""
    return Q5Weight.from_int8(*int8_blocks(raw, "Q5_0", out_features, in_features))


def q5_linear(x: torch.Tensor, weight: Q5Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> [..., out] fp32, bitwise q8_linear on ``weight.as_q8()`` and row invariant on the CPU kernels;
    the torch fallback (CUDA, no extension) is close but not row invariant, and does not quantize the activations."""
    return block_linear("q5_linear", x, weight, bias, lambda ext, rows: ext.q5_linear(
        rows, weight.quants, weight.scale, bias, weight.in_features))


def q5_linear_torch(x: torch.Tensor, weight: Q5Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The fallback: F.linear on the dequantized weight (cached per dtype and device)."""
    return dense_linear(x, weight, bias)
