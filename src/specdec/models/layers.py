"""Building blocks of the transformer: rotary tables and linear-weight formats (the row-wise norm, RoPE and
gated activation are kernels: `specdec.kernels`).

Every function here computes each row (token) independently with a reduction order that does not
depend on how many rows are in the call; that is what keeps a token's logits bitwise identical whether
it is decoded alone, verified in a block of draft tokens, or batched with other sequences.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specdec.kernels import QuantizedWeight, avx_vnni_active, embedding, kernel_isa, q8_linear, quantize_weight
from specdec.kernels.gguf_int8 import BLOCK_BYTES as INT8_BLOCK_BYTES, int8_blocks
from specdec.kernels.q4 import Q4Weight, q4_from_q4k_blocks, q4_linear, q4_supports, quantize_q4
from specdec.kernels.q5 import Q5Weight, q5_from_q5_0_blocks, q5_linear, q5_supports
from specdec.kernels.q6 import Q6Weight, q6_from_q6k_blocks, q6_linear, q6_supports

# auto: q4 where the file stores a layer as Q4_K, q6 where it stores it as Q6_K (both lossless: the file's blocks,
#       repacked; 4.6 and 6.6 bits a weight), q8 elsewhere (the default; see docs/kernels.md, "Weight formats"):
#       with the file's own int8 values and scales where it stores Q8_0 / Q5_0 / Q4_0 (lossless), else requantized;
#       on the avx2 path without AVX-VNNI auto is q5 (resolved_weight_format).
# q4:   as auto, and also quantizes to 4 bits at load what the file stores as fp32 / fp16 / bf16 / Q4_0 / Q4_1 /
#       Q5_0 (the type llama.cpp's Q4_K_M files use instead of Q4_K where a width is no multiple of 256), any width
#       (padded).
# q4-all: q4 for every linear layer, the output layer and the file's 6- and 8-bit layers included (a tied output
#       layer gets a q4 copy beside the q8 embedding table): the fewest bytes a token, for draft models, whose
#       weights choose the proposals, never the output.
# q5:   as auto, and q5 where the file stores a layer as Q5_0 (lossless, 5.5 bits a weight: the type Q4_K_M files use
#       where a width is no multiple of 256) instead of auto's q8 of the same values: auto's output bit for bit, in a
#       third fewer bytes for those layers; faster at every row count on the avx2 path (auto's choice there), at 1-2
#       rows on avx512 but slower there from 8 rows (verify blocks) (docs/kernels.md, "The q5 weight format").
# q8:   every layer int8.   fp32: the reference (torch's matmul, not row invariant).
WEIGHT_FORMATS = ("auto", "q4", "q4-all", "q5", "q8", "fp32")
Q4_LOSSLESS_STORAGE = frozenset({"Q4_K"})
Q5_LOSSLESS_STORAGE = frozenset({"Q5_0"})
Q6_LOSSLESS_STORAGE = frozenset({"Q6_K"})
INT8_STORAGE = frozenset(INT8_BLOCK_BYTES)  # Q8_0, Q5_0, Q4_0: int8 values and fp16 block scales, q8's exactly
# the types whose raw bytes a checkpoint keeps
BLOCK_STORAGE = Q4_LOSSLESS_STORAGE | Q5_LOSSLESS_STORAGE | Q6_LOSSLESS_STORAGE | INT8_STORAGE
LOSSLESS_STORAGE = {"q4": "Q4_K", "q5": "Q5_0", "q6": "Q6_K"}  # the storage each block format loads losslessly
Q4_QUANTIZED_STORAGE = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0"})


def check_weight_format(weight_format: str) -> None:
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weight_format!r}; choose one of {', '.join(WEIGHT_FORMATS)}")


def resolved_weight_format(weight_format: str, isa: str | None = None, avx_vnni: bool | None = None) -> str:
    """The format a model's layers load in for ``weight_format`` on kernel path ``isa`` (default: this process's,
    and whether it runs the avx2 path's AVX-VNNI variant): "auto" is "q5" on the avx2 path without AVX-VNNI, where
    q5 runs faster than q8 of the same values at every row count and gives the same bits, so the output does not
    depend on the choice (docs/kernels.md, "The q5 weight format"); every other format is itself."""
    check_weight_format(weight_format)
    if weight_format != "auto":
        return weight_format
    isa = kernel_isa() if isa is None else isa
    avx_vnni = avx_vnni_active() if avx_vnni is None else avx_vnni
    return "q5" if isa == "avx2" and not avx_vnni else "auto"


@dataclass(frozen=True)
class TensorStorage:
    """How a checkpoint stored its tensors: the storage type per canonical name ("Q4_K", "Q6_K", "F16", "BF16",
    ...; absent = fp32) and the raw bytes of its Q4_K, Q6_K, Q8_0, Q5_0 and Q4_0 tensors ([out, in/256 * 144 or 210],
    [out, in/32 * 34, 22 or 18] uint8), which q4, q6, q8 and q5 load losslessly. ``block_bytes`` may read a tensor's
    bytes when it is looked up (a GGUF file's mapping, loader.GGUFBlockBytes): each linear reads its names once, and
    the checks below look at names and types only."""

    types: dict[str, str] = field(default_factory=dict)
    block_bytes: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def linear_format(self, names: list[str], in_features: int, weight_format: str) -> str:
        """The format ("q4", "q5", "q6", "q8" or "fp32") of a linear made of the row-concatenated tensors ``names``."""
        check_weight_format(weight_format)
        if weight_format in ("q8", "fp32"):
            return weight_format
        storage = {self.types.get(name, "F32") for name in names}
        have_bytes = all(name in self.block_bytes for name in names)
        if storage <= Q4_LOSSLESS_STORAGE and q4_supports(in_features) and have_bytes:
            return "q4"
        if weight_format != "q4-all" and storage <= Q6_LOSSLESS_STORAGE and q6_supports(in_features) and have_bytes:
            return "q6"
        if weight_format == "q4-all" or (weight_format == "q4" and storage <= Q4_QUANTIZED_STORAGE):
            return "q4"
        if weight_format == "q5" and storage <= Q5_LOSSLESS_STORAGE and q5_supports(in_features) and have_bytes:
            return "q5"
        return "q8"

    def linear_parts(self, names: list[str], in_features: int, weight_format: str) -> list[tuple[list[str], str]]:
        """The parts of a linear made of the row-concatenated tensors ``names``, each (its names, its format): one
        part in linear_format's format, or, where that is q8 only because the file stores the names in different
        block types (Qwen2.5's Q4_K_M: q and k as Q4_K, v as Q6_K; Gemma 3's: q and k as Q5_0, v as Q8_0), one part
        per run of names of one type, each lossless (q4, q5, q6) or q8, instead of the whole requantized to 8 bits."""
        whole = self.linear_format(names, in_features, weight_format)
        if whole != "q8" or weight_format not in ("auto", "q4", "q5") or len(names) < 2:
            return [(list(names), whole)]
        formats = [self.linear_format([name], in_features, weight_format) for name in names]
        if not all(fmt == "q8" or self._keeps_lossless([name], fmt) for name, fmt in zip(names, formats)):
            return [(list(names), whole)]
        parts: list[tuple[list[str], str]] = []
        for name, fmt in zip(names, formats):
            if parts and parts[-1][1] == fmt:
                parts[-1][0].append(name)
            else:
                parts.append(([name], fmt))
        return parts if len(parts) > 1 else [(list(names), whole)]

    def exact_int8(self, names: list[str], in_features: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The int8 values [out, in] and fp16 block scales [out, in/32] of the row-concatenated tensors ``names``
        when the file stores each as Q8_0, Q5_0 or Q4_0 (gguf_int8: q8's values exactly) and keeps its bytes, else
        None (q8 then requantizes the dequantized weight)."""
        if not all(self.types.get(name) in INT8_STORAGE and name in self.block_bytes for name in names):
            return None
        decoded = []
        for name in names:
            raw = self.block_bytes[name]  # [out, in/32 * block bytes], read once
            decoded.append(int8_blocks(raw, self.types[name], raw.shape[0], in_features))
        values = torch.cat([part_values for part_values, _ in decoded])
        if bool((values == -128).any()):  # outside q8's -127..127 (Q8_0 files hold none; a hand-made one might)
            return None
        return values, torch.cat([part_scales for _, part_scales in decoded])

    def lossless_bytes(self, names: list[str], linear_format: str) -> torch.Tensor | None:
        """The file's blocks of the row-concatenated tensors ``names`` ([out, in/256 * 144 or 210], [out, in/32 * 22]
        uint8) when ``linear_format`` loads them losslessly (q4 from Q4_K, q5 from Q5_0, q6 from Q6_K bytes), else
        None."""
        if not self._keeps_lossless(names, linear_format):
            return None
        return torch.cat([self.block_bytes[name] for name in names])

    def _keeps_lossless(self, names: list[str], linear_format: str) -> bool:
        """Whether ``linear_format`` loads every one of ``names`` losslessly from bytes kept here (reads none)."""
        storage_type = LOSSLESS_STORAGE.get(linear_format)
        return storage_type is not None and all(self.types.get(name) == storage_type and name in self.block_bytes
                                                for name in names)


class RotaryTable:
    """cos/sin per position for one rotary base, HF rotate-half layout, grown on demand."""

    def __init__(self, head_dim: int, theta: float, device: torch.device) -> None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        self.inv_freq = 1.0 / (theta**exponents).to(device)  # [head_dim/2]
        self.cos = torch.empty(0, head_dim, device=device)  # [positions, head_dim]
        self.sin = torch.empty(0, head_dim, device=device)  # [positions, head_dim]

    def _grow(self, length: int) -> None:
        positions = torch.arange(length, device=self.inv_freq.device).float()
        freqs = positions[:, None] * self.inv_freq[None, :]  # [length, head_dim/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [length, head_dim]
        self.cos, self.sin = angles.cos(), angles.sin()

    def tables(self, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [>= max_position + 1, head_dim]."""
        if max_position + 1 > self.cos.shape[0]:
            self._grow(max(max_position + 1, 2 * self.cos.shape[0], 1024))
        return self.cos, self.sin


@dataclass(frozen=True)
class Linear:
    """A linear layer in one weight format; call it on activations [rows, in] -> [rows, out] fp32.

    q8: int8 weights with per-row scales, our row-invariant kernel (see docs/kernels.md).
    q4, q5, q6: GGUF Q4_K's 4-bit, Q5_0's 5-bit and Q6_K's 6-bit blocks, our row-invariant kernels (kernels/q4.py,
    kernels/q5.py: bitwise q8's on the same weights, kernels/q6.py).
    fp32: dense fp32 weights and torch's F.linear (reference / parity tests; not row-invariant).
    Exactly one of dense, quantized and blocks is set.
    """

    dense: torch.Tensor | None  # [out, in] fp32, fp32 format only
    quantized: QuantizedWeight | None  # q8 format only
    bias: torch.Tensor | None  # [out] fp32
    blocks: Q4Weight | Q5Weight | Q6Weight | None = None  # q4, q5 and q6 formats only

    @classmethod
    def build(cls, weight: torch.Tensor | None, bias: torch.Tensor | None, weight_format: str,
              block_bytes: torch.Tensor | None = None,
              exact_int8: tuple[torch.Tensor, torch.Tensor] | None = None,
              shape: tuple[int, int] | None = None) -> "Linear":
        """weight [out, in] in "q8", "q4", "q5", "q6" or "fp32" (a resolved format, see TensorStorage.linear_format);
        q4, q5 and q6 from ``block_bytes`` (the file's Q4_K, Q5_0 or Q6_K bytes of this weight, lossless) when given,
        q4 else quantized from weight; q8 from ``exact_int8`` (the file's int8 values and fp16 block scales,
        TensorStorage.exact_int8, lossless) when given, else quantized from weight. weight may be None where the
        file's data suffice, with ``shape`` [out, in] given instead (a load then skips dequantizing it)."""
        if weight is None and (shape is None or (block_bytes is None and exact_int8 is None)):
            raise ValueError("Linear.build needs the weight, or its shape and the file's blocks or int8 values")
        out_features, in_features = weight.shape if weight is not None else shape
        if weight_format == "q8":
            quantized = quantize_weight(weight) if exact_int8 is None else QuantizedWeight.from_int8(*exact_int8)
            return cls(dense=None, quantized=quantized, bias=bias)
        if weight_format == "q4":
            q4 = (q4_from_q4k_blocks(block_bytes, out_features, in_features) if block_bytes is not None
                  else quantize_q4(weight))
            return cls(dense=None, quantized=None, bias=bias, blocks=q4)
        if weight_format == "q5":
            if block_bytes is None:
                raise ValueError("q5 loads a file's Q5_0 blocks: it has no quantizer (use q8 or q4)")
            return cls(dense=None, quantized=None, bias=bias,
                       blocks=q5_from_q5_0_blocks(block_bytes, out_features, in_features))
        if weight_format == "q6":
            if block_bytes is None:
                raise ValueError("q6 loads a file's Q6_K blocks: it has no quantizer (use q8 or q4)")
            return cls(dense=None, quantized=None, bias=bias,
                       blocks=q6_from_q6k_blocks(block_bytes, out_features, in_features))
        if weight_format == "fp32":
            return cls(dense=weight.float().contiguous(), quantized=None, bias=bias)
        raise ValueError(f"unknown linear format {weight_format!r}; choose one of q8, q4, q5, q6, fp32")

    @property
    def q4(self) -> Q4Weight | None:
        return self.blocks if isinstance(self.blocks, Q4Weight) else None

    @property
    def q6(self) -> Q6Weight | None:
        return self.blocks if isinstance(self.blocks, Q6Weight) else None

    @property
    def format(self) -> str:
        if self.blocks is not None:
            return _BLOCK_FORMATS[type(self.blocks)]
        return "q8" if self.quantized is not None else "fp32"

    @property
    def in_features(self) -> int:
        if self.blocks is not None:
            return self.blocks.in_features
        return self.dense.shape[1] if self.dense is not None else self.quantized.in_features

    @property
    def out_features(self) -> int:
        if self.blocks is not None:
            return self.blocks.out_features
        return self.dense.shape[0] if self.dense is not None else self.quantized.scale.shape[0]

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:
            return _BLOCK_LINEARS[type(self.blocks)](inputs, self.blocks, self.bias)
        if self.quantized is not None:
            return q8_linear(inputs, self.quantized, self.bias)
        return F.linear(inputs, self.dense, self.bias)

    def rows(self, row_ids: torch.Tensor) -> "Linear":
        """The layer restricted to some output rows, bit for bit the same weights: row_ids [n] -> [rows n, in]."""
        row_ids = row_ids.to(dtype=torch.long)
        bias = None if self.bias is None else self.bias[row_ids]
        if self.blocks is not None:
            return Linear(dense=None, quantized=None, bias=bias, blocks=self.blocks.rows(row_ids))
        if self.quantized is not None:
            weight = self.quantized
            rows = QuantizedWeight.from_int8(
                weight.int8(row_ids), weight.scale.index_select(0, row_ids.to(weight.scale.device)), weight.layout
            )
            return Linear(dense=None, quantized=rows, bias=bias)
        return Linear(dense=self.dense[row_ids].contiguous(), quantized=None, bias=bias)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the weight as an embedding table: token_ids [n] -> [n, in] fp32 (q8 and fp32 only: embedding
        tables are kept at q8 under q4)."""
        if self.blocks is not None:
            raise ValueError(f"a {self.format} linear is not an embedding table (embeddings are built at q8)")
        if self.quantized is not None:
            return embedding(token_ids, self.quantized)
        return self.dense[token_ids]

    @property
    def parts(self) -> tuple["Linear", ...]:
        """The single-format linears this layer runs (itself; several for a ConcatLinear)."""
        return (self,)

    def nbytes(self) -> int:
        if self.blocks is not None:
            return self.blocks.nbytes
        if self.dense is not None:
            return self.dense.numel() * self.dense.element_size()
        return self.quantized.nbytes


_BLOCK_FORMATS = {Q4Weight: "q4", Q5Weight: "q5", Q6Weight: "q6"}
_BLOCK_LINEARS = {Q4Weight: q4_linear, Q5Weight: q5_linear, Q6Weight: q6_linear}


@dataclass(frozen=True)
class ConcatLinear:
    """Row-concatenated linears, each in its own format: [rows, in] -> [rows, the parts' out summed] fp32, the
    parts' outputs side by side. A file that stores the parts of one fused layer in different block types keeps
    each part lossless this way (TensorStorage.linear_parts). Each part's kernel is row invariant, so the whole is."""

    parts: tuple[Linear, ...]

    def __post_init__(self) -> None:
        if len(self.parts) < 2 or len({part.in_features for part in self.parts}) != 1:
            raise ValueError("a ConcatLinear joins two or more linears of the same input width")

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(inputs) for part in self.parts], dim=-1)

    @property
    def format(self) -> str:
        return "+".join(part.format for part in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def out_features(self) -> int:
        return sum(part.out_features for part in self.parts)

    def rows(self, row_ids: torch.Tensor) -> "Linear | ConcatLinear":
        """The layer restricted to some output rows (increasing), bit for bit the same weights: each part's rows
        among them."""
        row_ids = row_ids.to(dtype=torch.long)
        if row_ids.numel() == 0 or bool((row_ids[1:] <= row_ids[:-1]).any()):
            raise ValueError("rows of a ConcatLinear are taken in increasing order, at least one")
        if int(row_ids[0]) < 0 or int(row_ids[-1]) >= self.out_features:
            raise ValueError(f"row ids must lie in [0, {self.out_features}), got {int(row_ids[0])}..{int(row_ids[-1])}")
        picked, start = [], 0
        for part in self.parts:
            end = start + part.out_features
            local = row_ids[(row_ids >= start) & (row_ids < end)] - start
            if local.numel():
                picked.append(part.rows(local))
            start = end
        return picked[0] if len(picked) == 1 else ConcatLinear(tuple(picked))

    def nbytes(self) -> int:
        return sum(part.nbytes() for part in self.parts)
