"""Tiny random-weight models of each architecture, made in the tests (no downloads)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from specdec.models.config import ModelConfig

TINY_VOCAB = 300  # 256 byte tokens, <bos>, <eos>, then unused ids


def tiny_config(architecture: str, **overrides) -> ModelConfig:
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6)
    per_arch = {
        "llama": dict(rope_theta=10000.0, tie_word_embeddings=True),
        "qwen2": dict(rope_theta=1e6, qkv_bias=True),
        "gemma3": dict(
            rope_theta=1e6,
            rope_local_theta=1e4,
            layer_types=("sliding", "sliding", "full"),
            sliding_window=8,
            qk_norm=True,
            post_norms=True,
            embedding_scale=0.3,
            activation="gelu_tanh",
            tie_word_embeddings=True,
            attention_scale=16**-0.5,
        ),
    }
    return ModelConfig(
        architecture=architecture, name=f"tiny-{architecture}", **{**common, **per_arch[architecture], **overrides}
    )


def tiny_tensors(config: ModelConfig, seed: int = 0, scale: float = 0.5) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=generator) * scale / shape[-1] ** 0.5  # noqa: E731
    norm = lambda dim: 1.0 + 0.1 * torch.randn(dim, generator=generator)  # noqa: E731
    hidden, q_dim, kv_dim = (
        config.hidden_size,
        config.num_heads * config.head_dim,
        config.num_kv_heads * config.head_dim,
    )
    tensors = {"embed_tokens": torch.randn(config.vocab_size, hidden, generator=generator), "norm": norm(hidden)}
    if not config.tie_word_embeddings:
        tensors["lm_head"] = randn(config.vocab_size, hidden) * 8
    for i in range(config.num_layers):
        prefix = f"layers.{i}."
        tensors.update(
            {
                prefix + "attn_norm": norm(hidden),
                prefix + "ffn_norm": norm(hidden),
                prefix + "q_proj": randn(q_dim, hidden) * 4,
                prefix + "k_proj": randn(kv_dim, hidden) * 4,
                prefix + "v_proj": randn(kv_dim, hidden) * 4,
                prefix + "o_proj": randn(hidden, q_dim) * 4,
                prefix + "gate_proj": randn(config.intermediate_size, hidden),
                prefix + "up_proj": randn(config.intermediate_size, hidden),
                prefix + "down_proj": randn(hidden, config.intermediate_size) * 8,
            }
        )
        if config.qkv_bias:
            tensors.update({prefix + "q_proj.bias": 0.1 * torch.randn(q_dim, generator=generator),
                            prefix + "k_proj.bias": 0.1 * torch.randn(kv_dim, generator=generator),
                            prefix + "v_proj.bias": 0.1 * torch.randn(kv_dim, generator=generator)})
        if config.qk_norm:
            tensors.update({prefix + "q_norm": norm(config.head_dim), prefix + "k_norm": norm(config.head_dim)})
        if config.post_norms:
            tensors.update({prefix + "post_attn_norm": norm(hidden), prefix + "post_ffn_norm": norm(hidden)})
    return tensors


def write_tiny_tokenizer(directory: Path) -> Path:
    """A byte-level tokenizer: ids 0..255 are bytes, 256 <bos>, 257 <eos>; the rest unused."""
    byte_tokens = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(sorted(byte_tokens, key=lambda t: ord(t)))}
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<bos>", "<eos>"])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "add_bos_token": True,
                "chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}",
            }
        )
    )
    return directory


def write_tiny_qwen2_dir(directory: Path, num_layers: int = 2, seed: int = 0) -> Path:
    """A random-weight Qwen2 checkpoint (config.json + model.safetensors + tokenizer.json) usable by name/path."""
    from transformers import Qwen2Config, Qwen2ForCausalLM  # test dependency

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=256, eos_token_id=257, initializer_range=0.3)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return write_tiny_tokenizer(directory)


def random_int8_blocks(storage_type: str, out_features: int, in_features: int, seed: int = 0) -> np.ndarray:
    """Valid random GGUF blocks of an int8 type (Q8_0, Q5_0, Q4_0) [out, in/32 * block bytes]: any quant bytes (Q8_0's
    values in -127..127, as llama.cpp's quantizer writes them), finite fp16 scales (normal, subnormal, zero)."""
    from specdec.kernels.gguf_int8 import BLOCK_BYTES

    rng = np.random.default_rng(seed)
    count = out_features * in_features // 32
    blocks = rng.integers(0, 256, size=(count, BLOCK_BYTES[storage_type]), dtype=np.uint8)
    if storage_type == "Q8_0":
        blocks[:, 2:] = rng.integers(-127, 128, size=(count, 32)).astype(np.int8).view(np.uint8)
    scale = (rng.standard_normal(count) * 1e-2).astype(np.float16)
    scale[::7] = np.float16(3e-7)  # subnormal
    scale[::13] = 0.0
    blocks[:, 0:2] = scale.view(np.uint8).reshape(count, 2)
    return blocks.reshape(out_features, -1)
