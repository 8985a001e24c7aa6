"""4-bit weights ("q4"): GGUF Q4_K's blocks, repacked for the row-invariant CPU kernels.

The format keeps Q4_K's block structure exactly, so a Q4_K tensor of a GGUF loads losslessly (repacked, never
requantized): per output row, super-blocks of 256 inputs, each with an fp16 scale ``d``, an fp16 min scale
``dmin`` and 8 sub-blocks of 32 inputs; sub-block ``b`` has a 6-bit scale ``sc_b`` and a 6-bit min ``m_b``, and
every input a 4-bit quant ``q`` in 0..15::

    weight = (d * sc_b) * q - dmin * m_b        (both products exact in fp32)

A Q4_K tensor's ``in_features`` is a multiple of 256 (Q4_K's rule; :class:`Q4ShapeError` otherwise). A weight
quantized at load (:func:`quantize_q4`) may have any width: it is stored padded with zero columns to the next
multiple of 256 (:func:`padded_width`), and the kernel quantizes the activations as if zero beyond
``in_features`` (no copy of them is padded). A padded column adds exactly nothing (its activation quantizes to
0, and a sub-block of zero activations contributes 0 to the min term), so the result is the unpadded weight's;
the padding costs bytes only (896 -> 1024: 5.3 bits a weight instead of 4.6).

Storage, 148 bytes per row and super-block (4.625 bits per weight; Q4_K's 144 bytes pack the 6-bit scales and
mins into 12 bytes, we keep one byte each so that the kernel reads them without unpacking bits):

* ``quants`` uint8 ``[out, in/2]``: two quants per byte in the kernel's order (``csrc/q4_scalar.h``): a row is
  walked in units of 16 sub-blocks (the last unit 8 where in/256 is odd); in a unit, 64-byte chunk ``j``, byte
  ``4 l + i`` holds in its low nibble value ``4 s j + 4 (l % s) + i`` of sub-block ``l // s`` (``s = 16 / nb``
  lanes per sub-block) and in its high nibble the value ``nb / 4`` chunks further, so that each nibble plane is
  an activation vector of the q8 "vnni" layout. Rows are stored in tiles of 4 (memory order
  ``[out/4][in/128 chunks][4 rows][64 B]``), the last ``out % 4`` rows plainly: ``quants[i]`` is not row ``i``.
* ``scales`` uint8 ``[out, in/256 * 20]``, natural row order: per unit, its ``nb`` scales ``sc``, its ``nb`` mins
  ``m`` (one byte each), its ``nb/8`` fp16 ``d`` and its ``nb/8`` fp16 ``dmin``.

Activations are quantized as q8_linear's (int8 per block of 32, fp32 scale amax/127). The kernel's reduction
order per output element (the same on the scalar, avx2 and avx512 paths, whatever the rows of the call or the
threads) is spelled out in ``csrc/q4_scalar.h``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from specdec.kernels import ops
from specdec.kernels.blocks import block_linear, dense_linear, gguf_blocks, tile_rows, untile_rows

__all__ = [
    "Q4ShapeError",
    "Q4Weight",
    "q4_from_q4k_blocks",
    "q4_linear",
    "padded_width",
    "q4_supports",
    "quantize_q4",
]

SUPER_BLOCK = 256  # inputs per super-block (Q4_K's QK_K)
SUB_BLOCK = 32  # inputs per sub-block (one scale and one min)
SUB_BLOCKS = SUPER_BLOCK // SUB_BLOCK
Q4K_BLOCK_BYTES = 144  # one GGUF Q4_K super-block: fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 of quants
SCALE_BYTES = 20  # ours per row and super-block: 8 scales, 8 mins, fp16 d, fp16 dmin
QUANT_MAX = 15
SCALE_MAX = 63  # 6-bit scales and mins


class Q4ShapeError(ValueError):
    """in_features is not a multiple of 256: the layer cannot be q4 (keep it at q8)."""


def q4_supports(in_features: int) -> bool:
    """Whether a Q4_K tensor with ``in_features`` inputs loads losslessly as q4 (a multiple of 256, Q4_K's rule;
    any other width is quantized at load, padded: :func:`padded_width`)."""
    return in_features > 0 and in_features % SUPER_BLOCK == 0


def padded_width(in_features: int) -> int:
    """The stored width of a q4 weight with ``in_features`` inputs: the next multiple of 256."""
    if in_features <= 0:
        raise ValueError(f"in_features must be positive, got {in_features}")
    return -(-in_features // SUPER_BLOCK) * SUPER_BLOCK


def _check_in_features(in_features: int) -> None:
    if not q4_supports(in_features):
        raise Q4ShapeError(f"q4 needs in_features to be a multiple of {SUPER_BLOCK} (Q4_K super-blocks), got "
                           f"{in_features}; keep this layer at q8")


class Q4Blocks(NamedTuple):
    """A q4 weight in natural order (what the packed tensors hold, unpacked)."""

    quants: torch.Tensor  # [out, in] uint8, 0..15
    sub_scales: torch.Tensor  # [out, in/32] uint8, 6-bit sc
    sub_mins: torch.Tensor  # [out, in/32] uint8, 6-bit m
    d: torch.Tensor  # [out, in/256] fp16
    dmin: torch.Tensor  # [out, in/256] fp16


# --------------------------------------------------------------------------- the kernel's order


def _units(in_features: int) -> list[tuple[int, int]]:
    """(first sub-block, sub-blocks) of each unit of a row: units of 16, then one of 8 where in/256 is odd."""
    super_blocks = in_features // SUPER_BLOCK
    units = [(16 * u, 16) for u in range(super_blocks // 2)]
    if super_blocks % 2:
        units.append((16 * (super_blocks // 2), 8))
    return units


@functools.cache
def _nibble_columns(in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every byte of a packed row [in/2]: the natural column of its low nibble and of its high nibble."""
    low = torch.empty(in_features // 2, dtype=torch.long)
    high = torch.empty(in_features // 2, dtype=torch.long)
    for first, blocks in _units(in_features):
        lanes_per_block = 16 // blocks
        chunks = blocks // 4
        j = torch.arange(chunks).view(-1, 1, 1)
        lane = torch.arange(16).view(1, 16, 1)
        i = torch.arange(4).view(1, 1, 4)
        block_start = (first + lane // lanes_per_block) * SUB_BLOCK
        within = (lane % lanes_per_block) * 4 + i
        span = slice(first * SUB_BLOCK // 2, (first + blocks) * SUB_BLOCK // 2)
        low[span] = (block_start + j * 4 * lanes_per_block + within).reshape(-1)
        high[span] = (block_start + (j + chunks) * 4 * lanes_per_block + within).reshape(-1)
    return low, high


def _pack_nibbles(quants: torch.Tensor) -> torch.Tensor:
    """[out, in] quants 0..15 -> [out, in/2] bytes in kernel order: byte p holds column _nibble_columns(in)[0][p] in
    its low nibble and [1][p] in its high one. A unit of nb sub-blocks, natural [nb][2 halves][nb/4 chunks][16/nb
    lanes][4], is packed [halves][chunks][nb][lanes][4] (one transpose instead of two column gathers)."""
    out, in_features = quants.shape
    packed = torch.empty(out, in_features // 2, dtype=torch.uint8)
    for first, blocks in _units(in_features):
        unit = quants[:, first * SUB_BLOCK : (first + blocks) * SUB_BLOCK]
        halves = unit.reshape(out, blocks, 2, blocks // 4, 16 // blocks, 4).permute(2, 0, 3, 1, 4, 5)
        span = slice(first * SUB_BLOCK // 2, (first + blocks) * SUB_BLOCK // 2)
        packed[:, span] = (halves[0] | (halves[1] << 4)).reshape(out, blocks * SUB_BLOCK // 2)
    return packed


def _pack_scales(blocks: Q4Blocks) -> torch.Tensor:
    """Per row: for each unit of 16 sub-blocks its 16 sc, 16 m, 2 fp16 d, 2 fp16 dmin (40 bytes), then the
    last unit of 8 (20 bytes) where in/256 is odd -> [out, in/256 * 20] uint8."""
    out, super_blocks = blocks.d.shape
    pairs = super_blocks // 2
    d_bytes = blocks.d.contiguous().view(torch.uint8)  # [out, 2 * super_blocks], little endian
    dmin_bytes = blocks.dmin.contiguous().view(torch.uint8)
    pieces = (blocks.sub_scales, blocks.sub_mins, d_bytes, dmin_bytes)
    per_pair = (16, 16, 4, 4)
    parts = [torch.cat([piece[:, : pairs * width].reshape(out, pairs, width) for piece, width in zip(pieces, per_pair)],
                       dim=2).reshape(out, pairs * 40)]
    if super_blocks % 2:
        parts.append(torch.cat([piece[:, pairs * width :] for piece, width in zip(pieces, per_pair)], dim=1))
    return torch.cat(parts, dim=1).contiguous()


def _unpack_scales(scales: torch.Tensor, super_blocks: int):
    """Inverse of _pack_scales: (sub_scales, sub_mins [out, 8 S] uint8, d, dmin [out, S] fp16)."""
    out = scales.shape[0]
    pairs = super_blocks // 2
    full = scales[:, : pairs * 40].reshape(out, pairs, 40)
    columns = [[full[:, :, 0:16]], [full[:, :, 16:32]], [full[:, :, 32:36]], [full[:, :, 36:40]]]
    if super_blocks % 2:
        tail = scales[:, pairs * 40 :].reshape(out, 1, 20)
        for column, (start, end) in zip(columns, ((0, 8), (8, 16), (16, 18), (18, 20))):
            column.append(tail[:, :, start:end])
    sub_scales, sub_mins, d_bytes, dmin_bytes = (torch.cat([p.reshape(out, -1) for p in column], dim=1).contiguous()
                                                 for column in columns)
    return sub_scales, sub_mins, d_bytes.view(torch.float16), dmin_bytes.view(torch.float16)


# --------------------------------------------------------------------------- the weight


@dataclass(frozen=True, eq=False)
class Q4Weight:
    """A 4-bit weight in the kernel's layout (see the module docstring)."""

    quants: torch.Tensor  # [out, padded/2] uint8, two quants a byte, kernel order, rows in tiles of 4
    scales: torch.Tensor  # [out, padded/256 * 20] uint8: per unit sc, m, fp16 d, fp16 dmin
    in_features: int  # the layer's inputs; the stored width is padded_width(in_features)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def out_features(self) -> int:
        return self.quants.shape[0]

    @property
    def padded_in_features(self) -> int:
        """The stored width: in_features padded with zero columns to a multiple of 256."""
        return self.quants.shape[1] * 2

    @property
    def nbytes(self) -> int:
        """Bytes a forward streams: the quants and the scales."""
        return self.quants.numel() + self.scales.numel()

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / (self.out_features * self.in_features)

    def clone(self) -> "Q4Weight":
        """A copy in new memory (benchmarks cycle through copies so that every call reads its weight from DRAM)."""
        return Q4Weight(self.quants.clone(), self.scales.clone(), self.in_features)

    @classmethod
    def from_blocks(cls, blocks: Q4Blocks, in_features: int | None = None) -> "Q4Weight":
        """Pack a natural-order weight (quants 0..15, 6-bit sc and m, fp16 d and dmin) of a multiple of 256
        columns; ``in_features`` (default: all of them) is the layer's width when the last columns are padding."""
        out, padded = blocks.quants.shape
        _check_in_features(padded)
        in_features = padded if in_features is None else in_features
        if padded_width(in_features) != padded:
            raise ValueError(f"{padded} stored columns do not pad a width of {in_features} (expected "
                             f"{padded_width(in_features)})")
        super_blocks = padded // SUPER_BLOCK
        expected = {"sub_scales": (out, super_blocks * SUB_BLOCKS), "sub_mins": (out, super_blocks * SUB_BLOCKS),
                    "d": (out, super_blocks), "dmin": (out, super_blocks)}
        for name, shape in expected.items():
            if tuple(getattr(blocks, name).shape) != shape:
                raise ValueError(f"{name} must be {list(shape)}, got {list(getattr(blocks, name).shape)}")
        if bool((blocks.quants > QUANT_MAX).any()):
            raise ValueError(f"quants must lie in 0..{QUANT_MAX}")
        if bool((blocks.sub_scales > SCALE_MAX).any()) or bool((blocks.sub_mins > SCALE_MAX).any()):
            raise ValueError(f"sub-block scales and mins must lie in 0..{SCALE_MAX}")
        return cls(tile_rows(_pack_nibbles(blocks.quants.to(torch.uint8))).contiguous(), _pack_scales(blocks),
                   in_features)

    def blocks(self) -> Q4Blocks:
        """The weight in natural order, padding included (exactly what :meth:`from_blocks` packed)."""
        packed = untile_rows(self.quants)
        padded = self.padded_in_features
        low, high = _nibble_columns(padded)
        quants = torch.empty(self.out_features, padded, dtype=torch.uint8)
        quants[:, low] = packed & 0x0F
        quants[:, high] = packed >> 4
        return Q4Blocks(quants, *_unpack_scales(self.scales, padded // SUPER_BLOCK))

    def dequantize(self) -> torch.Tensor:
        """[out, in] fp32 (padding dropped): (d * sc) * q - dmin * m, bitwise as gguf-py's Q4_K
        dequantization."""
        blocks = self.blocks()
        out = self.out_features
        sub_scale = blocks.d.to(torch.float32).repeat_interleave(SUB_BLOCKS, dim=1) * blocks.sub_scales.to(
            torch.float32
        )
        sub_min = blocks.dmin.to(torch.float32).repeat_interleave(SUB_BLOCKS, dim=1) * blocks.sub_mins.to(torch.float32)
        quants = blocks.quants.to(torch.float32).view(out, -1, SUB_BLOCK)  # [out, padded/32, 32]
        dense = (sub_scale[:, :, None] * quants - sub_min[:, :, None]).view(out, self.padded_in_features)
        return dense[:, : self.in_features].contiguous()

    def rows(self, row_ids) -> "Q4Weight":
        """The weight of output rows ``row_ids`` only; a q4_linear with it gives bit for bit those columns of the
        full weight's (each output element is computed alone)."""
        ids = torch.as_tensor(row_ids, dtype=torch.long).reshape(-1)
        blocks = self.blocks()
        return Q4Weight.from_blocks(Q4Blocks(*(part.index_select(0, ids) for part in blocks)), self.in_features)


# --------------------------------------------------------------------------- sources


def q4_from_q4k_blocks(raw, out_features: int, in_features: int) -> Q4Weight:
    """A GGUF Q4_K tensor's bytes (uint8 tensor or ndarray [out, in/256 * 144]) -> Q4Weight, losslessly: its
    dequantization equals gguf-py's of the same bytes bit for bit."""
    _check_in_features(in_features)
    super_blocks = in_features // SUPER_BLOCK
    blocks = gguf_blocks(raw, "Q4_K", out_features, in_features, SUPER_BLOCK, Q4K_BLOCK_BYTES)
    d = blocks[:, 0:2].contiguous().view(torch.float16).reshape(out_features, super_blocks)
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).reshape(out_features, super_blocks)
    # the 12 scale bytes: 6-bit scales of sub-blocks 0-3 (with 2 high bits of 4-7's), mins likewise, then the low
    # 4 bits of sub-blocks 4-7's scales and mins (ggml's get_scale_min_k4)
    packed_scales = blocks[:, 4:16]
    low_scales, low_mins, high_parts = packed_scales[:, 0:4], packed_scales[:, 4:8], packed_scales[:, 8:12]
    sub_scales = torch.cat([low_scales & 0x3F, (high_parts & 0x0F) | ((low_scales >> 2) & 0x30)], dim=1)
    sub_mins = torch.cat([low_mins & 0x3F, (high_parts >> 4) | ((low_mins >> 2) & 0x30)], dim=1)
    # 128 quant bytes: per 32-byte run c, the low nibbles are sub-block 2c, the high nibbles sub-block 2c + 1
    runs = blocks[:, 16:].reshape(-1, 4, 1, 32)
    quants = torch.cat([runs & 0x0F, runs >> 4], dim=2).reshape(out_features, in_features)
    return Q4Weight.from_blocks(Q4Blocks(quants, sub_scales.reshape(out_features, -1).contiguous(),
                                         sub_mins.reshape(out_features, -1).contiguous(), d, dmin))


def _fit_sub_blocks(x: torch.Tensor, search_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, 32] fp32 -> (scale [B], offset [B] >= 0) with x ~ scale * q - offset, q in 0..15.

    llama.cpp's make_qkx2_quants (rmin -1, rdelta 0.1): the weighted least-squares fit of scale and min for the
    quants of the min/max grid and of ``search_steps`` + 1 stretched grids, keeping the best; importance weights
    rms(x) + |x| (quantize_row_q4_K_ref). ``search_steps`` 0: the plain min/max grid. The compiled kernels run the
    same arithmetic per sub-block (csrc/q4_quantize.h, several times faster: this is a load-time cost), agreeing
    to rounding; this is the fallback where they are not built."""
    ext = ops._load()
    if ext is not None:
        fit = ext.q4_fit_sub_blocks(x, search_steps)  # [B, 2]
        return fit[:, 0], fit[:, 1]
    return _fit_sub_blocks_torch(x, search_steps)


def _fit_sub_blocks_torch(x: torch.Tensor, search_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """_fit_sub_blocks in torch operations over all sub-blocks at once."""
    importance = x.pow(2).mean(dim=1, keepdim=True).sqrt() + x.abs()  # [B, 32]
    low = x.amin(dim=1).clamp(max=0.0)  # [B]
    high = x.amax(dim=1)
    flat = high == low
    span = torch.where(flat, torch.ones_like(high), high - low)
    best_scale = span / QUANT_MAX
    best_min = low
    if search_steps <= 0:
        return torch.where(flat, torch.zeros_like(best_scale), best_scale), -low
    shifted = x - low[:, None]  # [B, 32], >= 0
    sum_w = importance.sum(dim=1)
    sum_x = (importance * x).sum(dim=1)
    sum_xx = (importance * x * x).sum(dim=1)

    def fit_sums(inverse_scale: torch.Tensor):
        """The grid's quants and their weighted sums: sum w l, sum w l^2, sum w x l."""
        levels = torch.round(shifted * inverse_scale[:, None]).clamp_(0, QUANT_MAX)
        weighted_levels = importance * levels
        return weighted_levels.sum(dim=1), (weighted_levels * levels).sum(dim=1), (weighted_levels * x).sum(dim=1)

    def weighted_error(scale, minimum, sum_l, sum_l2, sum_xl):
        """sum w (scale l + minimum - x)^2, expanded into the sums (no pass over the values)."""
        return (scale * scale * sum_l2 + 2 * scale * minimum * sum_l - 2 * scale * sum_xl + minimum * minimum * sum_w
                - 2 * minimum * sum_x + sum_xx)

    best_error = weighted_error(best_scale, best_min, *fit_sums(QUANT_MAX / span))
    for step in range(search_steps + 1):
        sum_l, sum_l2, sum_xl = fit_sums((-1.0 + 0.1 * step + QUANT_MAX) / span)
        det = sum_w * sum_l2 - sum_l * sum_l
        safe_det = torch.where(det > 0, det, torch.ones_like(det))
        scale = (sum_w * sum_xl - sum_x * sum_l) / safe_det
        minimum = (sum_l2 * sum_x - sum_l * sum_xl) / safe_det
        positive_min = minimum > 0
        scale = torch.where(positive_min, sum_xl / torch.where(sum_l2 > 0, sum_l2, torch.ones_like(sum_l2)), scale)
        minimum = torch.where(positive_min, torch.zeros_like(minimum), minimum)
        error = weighted_error(scale, minimum, sum_l, sum_l2, sum_xl)
        better = (det > 0) & (error < best_error)
        best_error = torch.where(better, error, best_error)
        best_scale = torch.where(better, scale, best_scale)
        best_min = torch.where(better, minimum, best_min)
    best_scale = torch.where(flat, torch.zeros_like(best_scale), best_scale)
    best_min = torch.where(flat, low, best_min)
    return best_scale, -best_min


def _quantize_super_blocks(rows: torch.Tensor, search_steps: int) -> Q4Blocks:
    """rows [r, in] fp32 -> natural-order q4 blocks (llama.cpp's quantize_row_q4_K_ref after the fit)."""
    out, in_features = rows.shape
    sub = rows.reshape(-1, SUB_BLOCK)  # [r * in/32, 32]
    scale, offset = _fit_sub_blocks(sub, search_steps)
    scale = scale.clamp(min=0.0).view(-1, SUB_BLOCKS)  # [r * in/256, 8]
    offset = offset.view(-1, SUB_BLOCKS)
    max_scale = scale.amax(dim=1)
    max_offset = offset.amax(dim=1)
    inverse_scale = torch.where(max_scale > 0, SCALE_MAX / torch.where(max_scale > 0, max_scale, 1.0), 0.0)
    inverse_offset = torch.where(max_offset > 0, SCALE_MAX / torch.where(max_offset > 0, max_offset, 1.0), 0.0)
    sub_scales = torch.round(inverse_scale[:, None] * scale).clamp_(0, SCALE_MAX)
    sub_mins = torch.round(inverse_offset[:, None] * offset).clamp_(0, SCALE_MAX)
    d = (max_scale / SCALE_MAX).to(torch.float16)
    dmin = (max_offset / SCALE_MAX).to(torch.float16)
    if not (bool(torch.isfinite(d).all()) and bool(torch.isfinite(dmin).all())):
        raise ValueError("weight too large for fp16 super-block scales (|w| > ~9.8e5) or not finite")
    sub_scale = d.to(torch.float32)[:, None] * sub_scales  # [r * in/256, 8], exact
    sub_min = dmin.to(torch.float32)[:, None] * sub_mins
    safe_scale = torch.where(sub_scale > 0, sub_scale, torch.ones_like(sub_scale))
    quants = torch.round((sub.view(-1, SUB_BLOCKS, SUB_BLOCK) + sub_min[:, :, None]) / safe_scale[:, :, None])
    quants = torch.where(sub_scale[:, :, None] > 0, quants.clamp_(0, QUANT_MAX), torch.zeros_like(quants))
    return Q4Blocks(quants.to(torch.uint8).view(out, in_features),
                    sub_scales.to(torch.uint8).view(out, -1), sub_mins.to(torch.uint8).view(out, -1),
                    d.view(out, -1), dmin.view(out, -1))


def quantize_q4(weight: torch.Tensor, search_steps: int = 20) -> Q4Weight:
    """weight [out, in] (any float dtype, any width: padded with zero columns to padded_width(in)) -> Q4Weight,
    quantized once (at load, for fp16 / bf16 safetensors and other non-Q4_K sources) as llama.cpp's reference
    Q4_K quantizer does: per sub-block a weighted least-squares search for scale and min (``search_steps``
    stretched grids; 0: plain min/max), then 6-bit scales and mins relative to the super-block's largest, fp16 d
    and dmin, and the quants rounded against those quantized scales."""
    if weight.dim() != 2:
        raise ValueError("weight must be [out_features, in_features]")
    out, in_features = weight.shape
    padded = padded_width(in_features)
    weight = weight.detach().to(device="cpu", dtype=torch.float32)
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("weight is not finite")
    weight = F.pad(weight, (0, padded - in_features))  # [out, padded], zero columns: zero quants, scales, mins
    rows_per_step = max(1, (1 << 20) // padded)  # bound the [rows, in] temporaries of the search
    parts = [_quantize_super_blocks(weight[r0 : r0 + rows_per_step], search_steps)
             for r0 in range(0, out, rows_per_step)]
    return Q4Weight.from_blocks(Q4Blocks(*(torch.cat(column, dim=0) for column in zip(*parts))), in_features)


# --------------------------------------------------------------------------- the linear


def q4_linear(x: torch.Tensor, weight: Q4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> [..., out] fp32. Bitwise row invariant on the CPU kernels; the torch fallback (CUDA, no
    extension) is close but not row invariant, and does not quantize the activations."""
    return block_linear("q4_linear", x, weight, bias, lambda ext, rows: ext.q4_linear(
        rows, weight.quants, weight.scales, bias, weight.in_features))


def q4_linear_torch(x: torch.Tensor, weight: Q4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The fallback: F.linear on the dequantized weight (cached per dtype and device)."""
    return dense_linear(x, weight, bias)
