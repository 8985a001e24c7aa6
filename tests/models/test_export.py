"""`specdec export-hf`: checkpoint -> Hugging Face directory, checked by reading it back (ours and transformers)."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from specdec.cache.kv_cache import KVCache
from specdec.models.batch import ForwardBatch
from specdec.models.export import ExportError, export_hf_dir, hf_config_dict
from specdec.models.loader import Checkpoint, hf_tensor_name, load_checkpoint, load_hf_dir
from specdec.models.tokenizer import Tokenizer
from specdec.models.transformer import Transformer
from tiny_models import tiny_config, tiny_tensors, write_tiny_tokenizer

ARCHITECTURES = ("llama", "qwen2", "gemma3")


def _tiny_checkpoint(architecture: str, tmp_path) -> Checkpoint:
    # Gemma's HF class scales embeddings by sqrt(hidden_size) itself; the tiny config's 0.3 is not exportable.
    overrides = {"embedding_scale": math.sqrt(64)} if architecture == "gemma3" else {}
    config = tiny_config(architecture, **overrides)
    tokenizer = Tokenizer.from_hf_dir(write_tiny_tokenizer(tmp_path / "tokenizer"))
    return Checkpoint(config=config, tensors=tiny_tensors(config, seed=1), tokenizer=tokenizer)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_export_round_trips_through_our_loader(tmp_path, architecture: str) -> None:
    checkpoint = _tiny_checkpoint(architecture, tmp_path)
    out = export_hf_dir(checkpoint, tmp_path / "hf")
    assert {path.name for path in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                                    "tokenizer_config.json", "generation_config.json"}
    loaded = load_hf_dir(out)
    assert loaded.config == checkpoint.config
    assert set(loaded.tensors) == set(checkpoint.tensors)
    for name, value in checkpoint.tensors.items():
        assert torch.equal(loaded.tensors[name], value), name
    tokenizer, original = loaded.tokenizer, checkpoint.tokenizer
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids, tokenizer.add_bos, tokenizer.chat_template) == (
        original.bos_token_id, original.eos_token_ids, original.add_bos, original.chat_template)
    assert tokenizer.encode("hello") == original.encode("hello")


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_exported_directory_gives_transformers_our_logits(tmp_path, architecture: str) -> None:
    transformers = pytest.importorskip("transformers")
    checkpoint = _tiny_checkpoint(architecture, tmp_path)
    out = export_hf_dir(checkpoint, tmp_path / "hf")
    reference = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(reference).__name__ == hf_config_dict(checkpoint.config)["architectures"][0]
    ours = Transformer(checkpoint.config, checkpoint.tensors, weight_format="fp32")
    ids = checkpoint.tokenizer.encode("Hi, you")  # shorter than the tiny Gemma's sliding window (8)
    logits = ours.forward(ForwardBatch.build([ids], [0], [0], all_logits=True), KVCache(ours.config, 1, 64))
    with torch.inference_mode():
        reference_logits = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, reference_logits, atol=1e-4, rtol=1e-4)


def test_gemma_norms_are_stored_without_the_plus_one(tmp_path) -> None:
    from safetensors.torch import load_file

    checkpoint = _tiny_checkpoint("gemma3", tmp_path)
    stored = load_file(export_hf_dir(checkpoint, tmp_path / "hf") / "model.safetensors")
    for name in ("norm", "layers.0.attn_norm", "layers.0.q_norm", "layers.1.post_ffn_norm"):
        assert torch.equal(stored[hf_tensor_name(name, "gemma3")], checkpoint.tensors[name] - 1.0), name
    assert "lm_head.weight" not in stored  # tied


def test_hf_names_per_architecture() -> None:
    assert hf_tensor_name("layers.3.ffn_norm", "llama") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_tensor_name("layers.3.ffn_norm", "gemma3") == "model.layers.3.pre_feedforward_layernorm.weight"
    assert hf_tensor_name("layers.3.post_attn_norm", "gemma3") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_tensor_name("layers.0.k_proj.bias", "qwen2") == "model.layers.0.self_attn.k_proj.bias"
    assert hf_tensor_name("lm_head", "qwen2") == "lm_head.weight"
    for name in ("layers.0.post_ffn_norm", "layers.0.post_attn_norm", "layers.0.nope", "output"):
        with pytest.raises(ValueError, match="has no Hugging Face name"):
            hf_tensor_name(name, "llama")


def test_configs_the_hf_class_cannot_express_are_refused() -> None:
    with pytest.raises(ExportError, match="embedding scale embedding_scale=0.3"):
        hf_config_dict(tiny_config("gemma3"))
    with pytest.raises(ExportError, match="q/k/v bias qkv_bias=False"):
        hf_config_dict(tiny_config("qwen2", qkv_bias=False))
    with pytest.raises(ExportError, match="per-layer attention types"):
        hf_config_dict(dataclasses.replace(tiny_config("llama"), layer_types=("full",) * 3))


@pytest.mark.real
def test_real_gemma_export_matches_the_gguf(tmp_path) -> None:
    from real_models import real_model_path

    path = real_model_path("gemma-3-270m")
    gguf = load_checkpoint(path)
    out = export_hf_dir(gguf, tmp_path / "hf")
    exported = load_hf_dir(out)
    assert exported.config == dataclasses.replace(gguf.config, name=gguf.config.name)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    ids = gguf.tokenizer.encode("The capital of France is")
    assert exported.tokenizer.encode("The capital of France is") == ids
    logits = []
    for checkpoint in (gguf, exported):
        model = Transformer(checkpoint.config, checkpoint.tensors, weight_format="fp32")
        logits.append(model.forward(ForwardBatch.build([ids], [0], [0], all_logits=True), KVCache(model.config, 1, 64)))
        del model
    assert torch.equal(logits[0], logits[1])
