"""Building blocks of the transformer: rotary tables and linear-weight formats (the row-wise norm, RoPE and
gated activation are kernels: `specdec.kernels`).

Every function here computes each row (token) independently with a reduction order that does not
depend on how many rows are in the call; that is what keeps a token's logits bitwise identical whether
it is decoded alone, verified in a block of draft tokens, or batched with other sequences.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.kernels import QuantizedWeight, embedding, q8_linear, quantize_weight

WEIGHT_FORMATS = ("q8", "fp32")


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

    q8: int8 weights with per-row scales, our row-invariant kernel (the default; see docs/kernels.md).
    fp32: dense fp32 weights and torch's F.linear (reference / parity tests; not row-invariant).
    """

    dense: torch.Tensor | None  # [out, in] fp32, fp32 format only
    quantized: QuantizedWeight | None  # q8 format only
    bias: torch.Tensor | None  # [out] fp32

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None, weight_format: str) -> "Linear":
        if weight_format == "q8":
            return cls(dense=None, quantized=quantize_weight(weight), bias=bias)
        if weight_format == "fp32":
            return cls(dense=weight.float().contiguous(), quantized=None, bias=bias)
        raise ValueError(f"unknown weight format {weight_format!r}; choose one of {', '.join(WEIGHT_FORMATS)}")

    @property
    def out_features(self) -> int:
        return self.dense.shape[0] if self.dense is not None else self.quantized.scale.shape[0]

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return q8_linear(inputs, self.quantized, self.bias)
        return F.linear(inputs, self.dense, self.bias)

    def rows(self, row_ids: torch.Tensor) -> "Linear":
        """The layer restricted to some output rows, bit for bit the same weights: row_ids [n] -> [rows n, in]."""
        row_ids = row_ids.to(dtype=torch.long)
        bias = None if self.bias is None else self.bias[row_ids]
        if self.quantized is not None:
            weight = self.quantized
            rows = QuantizedWeight.from_int8(weight.int8(row_ids), weight.scale.index_select(0, row_ids.to(weight.scale.device)),
                                             weight.layout)
            return Linear(dense=None, quantized=rows, bias=bias)
        return Linear(dense=self.dense[row_ids].contiguous(), quantized=None, bias=bias)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the weight as an embedding table: token_ids [n] -> [n, in] fp32."""
        if self.quantized is not None:
            return embedding(token_ids, self.quantized)
        return self.dense[token_ids]

    def nbytes(self) -> int:
        if self.dense is not None:
            return self.dense.numel() * self.dense.element_size()
        return self.quantized.nbytes
