"""Model configuration: one transformer, per-architecture differences expressed as data."""
from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma3")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the transformer needs to know about one checkpoint.

    Norm weights are stored as the effective multiplier (Gemma's ``1 + w`` is folded in by the loader),
    linear weights as ``[out_features, in_features]`` and rotary embeddings use HF's rotate-half layout.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Rotary base of sliding-window layers (Gemma 3 uses 10000 locally, 1e6 globally); None: same as rope_theta.
    rope_local_theta: float | None = None
    # "full" or "sliding" per layer; empty means all full.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False  # Gemma: extra RMSNorm after attention and after the MLP
    embedding_scale: float = 1.0  # Gemma: sqrt(hidden_size)
    activation: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    tie_word_embeddings: bool = False
    attention_scale: float | None = None  # None: 1/sqrt(head_dim)
    final_logit_softcap: float | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported activation {self.activation!r}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if any(t not in ("full", "sliding") for t in self.layer_types):
            raise ValueError(f"layer_types must be 'full' or 'sliding', got {set(self.layer_types)}")
        if "sliding" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding layers need a sliding_window")

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else "full"

    def layer_rope_theta(self, layer: int) -> float:
        if self.layer_type(layer) == "sliding" and self.rope_local_theta is not None:
            return self.rope_local_theta
        return self.rope_theta

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    @property
    def num_parameters(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp) + embed
