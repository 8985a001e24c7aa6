"""Row-invariant CPU kernels (int8 linear, range attention); see ops.py."""

from specdec.kernels.ops import (
    QKNormRope,
    QuantizedWeight,
    argmax_rows,
    attention,
    build_kernels,
    embedding,
    forced_isa,
    gated_activation,
    kernel_isa,
    kernels_available,
    kv_write,
    q8_linear,
    qk_norm_rope,
    quantize_weight,
    rms_norm,
    supported_isas,
)

__all__ = [
    "QKNormRope",
    "QuantizedWeight",
    "argmax_rows",
    "attention",
    "build_kernels",
    "embedding",
    "forced_isa",
    "gated_activation",
    "kernel_isa",
    "kernels_available",
    "kv_write",
    "q8_linear",
    "qk_norm_rope",
    "quantize_weight",
    "rms_norm",
    "supported_isas",
]
