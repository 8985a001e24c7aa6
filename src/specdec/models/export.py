"""Writing a checkpoint as a Hugging Face directory, for engines that read safetensors (the vLLM peer).

The directory holds what ``load_hf_dir`` (and transformers / vLLM) read back:

    config.json             the architecture's HF config (LlamaForCausalLM, Qwen2ForCausalLM, Gemma3ForCausalLM)
    model.safetensors       the dequantized weights under HF tensor names (``loader.hf_tensor_name``); Gemma's
                            norm weights are stored as HF does, without the +1 (``loader.hf_tensor_value``)
    tokenizer.json, tokenizer_config.json, generation_config.json

Canonical tensors are already in HF's rotate-half layout (the loader undoes llama.cpp's q/k permutation of
Llama GGUF files), so the weights need no other transform. Exporting then loading the directory gives the
same canonical tensors, config and tokenizer (tests/models/test_export.py).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from specdec.models.config import ModelConfig
from specdec.models.loader import Checkpoint, hf_tensor_name, hf_tensor_value, load_checkpoint
from specdec.models.tokenizer import Tokenizer

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXPORT_FORMAT_VERSION = 1  # part of the export cache key: bump when the written files change

_HF_CLASSES = {  # our architecture -> (HF model_type, HF architectures entry)
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
_HF_LAYER_TYPES = {"full": "full_attention", "sliding": "sliding_attention"}


class ExportError(ValueError):
    """The checkpoint cannot be written in the Hugging Face format of its architecture."""


def export_hf_dir(checkpoint: Checkpoint, out_dir: str | os.PathLike[str], dtype: str = "float32") -> Path:
    """Write ``checkpoint`` as a Hugging Face directory ``out_dir`` (created; existing files are overwritten)."""
    from safetensors.torch import save_file

    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"unsupported export dtype {dtype!r}; supported: {', '.join(EXPORT_DTYPES)}")
    config, tokenizer = checkpoint.config, checkpoint.tokenizer
    hf_config = hf_config_dict(config, tokenizer, dtype)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tensors = {hf_tensor_name(name, config.architecture):
               hf_tensor_value(name, value, config.architecture).to(EXPORT_DTYPES[dtype]).contiguous()
               for name, value in checkpoint.tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", hf_config)
    _write_tokenizer(tokenizer, out)
    _write_json(out / "generation_config.json", {
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": sorted(tokenizer.eos_token_ids),
        "do_sample": False})
    return out


def export_model_hf(model: str | os.PathLike[str], out_dir: str | os.PathLike[str], dtype: str = "float32") -> Path:
    """Load a model (catalogue name, .gguf file or HF directory) and export it as a HF directory."""
    from specdec.models.catalog import resolve_model

    return export_hf_dir(load_checkpoint(resolve_model(model)), out_dir, dtype)


def cached_hf_export(model: str | os.PathLike[str], dtype: str = "float32") -> Path:
    """The model's HF export under ``$XDG_CACHE_HOME/specdec/hf-exports``, written on first use.

    Keyed by the file's sha256 (so a changed file gets a new export), the dtype and EXPORT_FORMAT_VERSION;
    written to a temporary directory and renamed, so an interrupted export is never used.
    HF directories are returned as they are.
    """
    from specdec.models.catalog import models_dir, resolve_model, sha256_of

    path = resolve_model(model)
    if path.is_dir():
        return path
    key = f"{path.stem}-{sha256_of(path)[:16]}-{dtype}-v{EXPORT_FORMAT_VERSION}"
    target = models_dir().parent / "hf-exports" / key
    if (target / "config.json").is_file():
        return target
    partial = target.with_name(f".{key}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        export_hf_dir(load_checkpoint(path), partial, dtype)
        os.replace(partial, target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def hf_config_dict(config: ModelConfig, tokenizer: Tokenizer | None = None, dtype: str = "float32") -> dict[str, Any]:
    """The HF ``config.json`` of ``config``: ``loader._hf_config`` reads it back to an equal ModelConfig."""
    model_type, hf_class = _HF_CLASSES[config.architecture]
    _check_exportable(config)
    hf: dict[str, Any] = {
        "architectures": [hf_class], "model_type": model_type, "_name_or_path": config.name,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps, "tie_word_embeddings": config.tie_word_embeddings,
        "rope_theta": config.rope_theta, "rope_scaling": None, "torch_dtype": dtype,
    }
    if tokenizer is not None:
        hf["bos_token_id"] = tokenizer.bos_token_id
        hf["eos_token_id"] = sorted(tokenizer.eos_token_ids)
    if config.architecture == "gemma3":
        query_pre_attn_scalar = config.scale ** -2
        local_theta = config.rope_theta if config.rope_local_theta is None else config.rope_local_theta
        hf.update({
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": _integral_or_float(query_pre_attn_scalar),
            "sliding_window": config.sliding_window,
            "layer_types": [_HF_LAYER_TYPES[config.layer_type(layer)] for layer in range(config.num_layers)],
            "rope_local_base_freq": local_theta,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
                "full_attention": {"rope_type": "default", "rope_theta": config.rope_theta}},
            "final_logit_softcapping": config.final_logit_softcap, "attn_logit_softcapping": None,
            "attention_bias": False, "use_bidirectional_attention": False,
        })
    else:
        hf.update({"hidden_act": "silu", "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta}})
        if config.architecture == "llama":
            hf.update({"attention_bias": config.qkv_bias, "mlp_bias": False})
        else:
            hf.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": config.num_layers})
    return hf


def _integral_or_float(value: float) -> int | float:
    return round(value) if abs(value - round(value)) < 1e-6 * max(1.0, abs(value)) else value


def _check_exportable(config: ModelConfig) -> None:
    """Everything the HF class of the architecture derives itself must match what the config holds."""
    gemma = config.architecture == "gemma3"
    fixed = {  # field -> (value the HF class implies, what it means)
        "qk_norm": (gemma, "q/k norms"),
        "post_norms": (gemma, "post-attention/post-MLP norms"),
        "activation": ("gelu_tanh" if gemma else "silu", "activation"),
        "embedding_scale": (config.hidden_size ** 0.5 if gemma else 1.0, "embedding scale"),
    }
    if config.architecture == "qwen2":
        fixed["qkv_bias"] = (True, "q/k/v bias")
    if config.architecture != "gemma3":
        fixed["layer_types"] = ((), "per-layer attention types")
        fixed["attention_scale"] = (None, "attention scale")
        fixed["final_logit_softcap"] = (None, "final logit softcap")
    for field, (implied, meaning) in fixed.items():
        value = getattr(config, field)
        same = abs(value - implied) <= 1e-6 * abs(implied) if isinstance(implied, float) else value == implied
        if not same:
            raise ExportError(f"{config.architecture} checkpoint {config.name!r} has {meaning} {field}={value!r}; "
                              f"the Hugging Face {_HF_CLASSES[config.architecture][1]} implies {implied!r}")


def _write_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    tokenizer.backend.save(str(out / "tokenizer.json"))
    token_text = lambda token_id: None if token_id is None else tokenizer.id_to_token(token_id)  # noqa: E731
    eos_id = min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else None
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token_text(tokenizer.bos_token_id),
        "eos_token": token_text(eos_id), "add_bos_token": tokenizer.add_bos, "add_eos_token": False,
        "chat_template": tokenizer.chat_template})


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
