"""Row-invariant CPU kernels (int8 linear, range attention); see ops.py."""

from specdec.kernels.ops import (
    QuantizedWeight,
    attention,
    build_kernels,
    embedding,
    kernel_isa,
    kernels_available,
    q8_linear,
    quantize_weight,
)

__all__ = [
    "QuantizedWeight",
    "attention",
    "build_kernels",
    "embedding",
    "kernel_isa",
    "kernels_available",
    "q8_linear",
    "quantize_weight",
]
