"""Row-invariant CPU kernels (int8 linear, range attention); see ops.py."""

from specdec.kernels.ops import (
    QKNormRope,
    QuantizedWeight,
    attention,
    build_kernels,
    embedding,
    kernel_isa,
    kernels_available,
    q8_linear,
    qk_norm_rope,
    quantize_weight,
    rms_norm,
)

__all__ = [
    "QKNormRope",
    "QuantizedWeight",
    "attention",
    "build_kernels",
    "embedding",
    "kernel_isa",
    "kernels_available",
    "q8_linear",
    "qk_norm_rope",
    "quantize_weight",
    "rms_norm",
]
