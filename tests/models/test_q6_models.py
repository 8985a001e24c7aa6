"""Models whose file stores layers as GGUF Q6_K: under auto those layers run as q6 with the file's values exactly,
logits stay bitwise row invariant, and greedy speculation is identical to plain decoding for every drafter, batch 1
and > 1. The tiny models' Q6_K bytes are encoded here (gguf-py has no Q6_K quantizer); the real Q4_K_M files'
Q6_K layers are covered by tests/real."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from specdec.models.layers import TensorStorage
from specdec.models.transformer import Transformer
from tiny_models import tiny_config, tiny_tensors
from test_q4_models import ARCHITECTURES, PROMPTS, Q4_WIDTHS, _assert_row_invariant_and_lossless, _drafter, _run


def q6k_bytes(weight: torch.Tensor) -> np.ndarray:
    """A GGUF Q6_K encoding of weight [out, in] (in a multiple of 256): per sub-block of 16 a scale amax / 31, per
    super-block d = the largest / 127, int8 sub-block scales against d, quants rounded against the quantized
    scales -> [out, in/256 * 210] uint8 (ql[128], qh[64], scales[16], fp16 d per super-block)."""
    out, in_features = weight.shape
    sub = weight.double().reshape(-1, 16, 16)  # [super-blocks, 16 sub-blocks, 16]
    sub_scale = sub.abs().amax(dim=2) / 31  # [S, 16]
    d = (sub_scale.amax(dim=1) / 127).to(torch.float16)  # [S]
    d_exact = d.double().clamp(min=1e-30)
    sc = torch.round(sub_scale / d_exact[:, None]).clamp(-128, 127)  # [S, 16]
    step = (d.double()[:, None] * sc).clamp(min=1e-30)
    quants = (torch.round(sub / step[:, :, None]) + 32).clamp(0, 63).to(torch.uint8).reshape(-1, 2, 4, 32)
    low, high = quants & 0x0F, quants >> 4  # per 128-value half: 4 groups of 32
    ql = torch.cat([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], dim=2)  # [S, 2, 64]
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)  # [S, 2, 32]
    blocks = torch.cat([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.to(torch.int8).view(torch.uint8),
                        d.view(torch.uint8).view(-1, 2)], dim=1)
    return blocks.reshape(out, -1).numpy()


def q6_model(architecture, seed=0, weight_format="auto", **widths):
    """A tiny model whose down projections (and untied output layer) the 'file' stores as Q6_K."""
    overrides = dict(widths or Q4_WIDTHS)
    if architecture == "gemma3":
        overrides["attention_scale"] = 64**-0.5
    config = tiny_config(architecture, **overrides)
    tensors = tiny_tensors(config, seed)
    storage = TensorStorage()
    names = [f"layers.{i}.down_proj" for i in range(config.num_layers)] + [n for n in ("lm_head",) if n in tensors]
    for name in names:
        raw = q6k_bytes(tensors[name])
        storage.types[name] = "Q6_K"
        storage.block_bytes[name] = torch.from_numpy(raw)
        tensors[name] = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType.Q6_K)).view(tensors[name].shape)
    return Transformer(config, tensors, weight_format, storage=storage), tensors


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_q6k_layers_run_as_q6_with_the_files_values(architecture):
    model, tensors = q6_model(architecture)
    for index, layer in enumerate(model.layers):
        assert layer.down_proj.format == "q6" and layer.qkv_proj.format == "q8"
        assert torch.equal(layer.down_proj.q6.dequantize(), tensors[f"layers.{index}.down_proj"])
    assert model.lm_head.format == ("q8" if model.config.tie_word_embeddings else "q6")
    assert set(model.linear_bytes()) == {"q6", "q8"}


def test_q4_all_requantizes_q6k_layers_to_q4():
    """q4-all (a draft model's default) runs the file's Q6_K layers as q4, quantized from their values."""
    model, tensors = q6_model("qwen2", weight_format="q4-all")
    for index, layer in enumerate(model.layers):
        assert layer.down_proj.format == "q4"
        dense = tensors[f"layers.{index}.down_proj"]
        assert (layer.down_proj.q4.dequantize() - dense).norm() / dense.norm() < 0.1
    assert model.lm_head.format == "q4"


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_q6_model_is_row_invariant_and_lossless(tiny_tokenizer, architecture):
    model, _ = q6_model(architecture)
    _assert_row_invariant_and_lossless(model, tiny_tokenizer)


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
@pytest.mark.parametrize("batch", [1, 3])
def test_q6_greedy_speculation_identical_to_plain(make_tiny_model, tiny_tokenizer, method, batch):
    model, _ = q6_model("qwen2")
    prompts = PROMPTS[:batch] if batch > 1 else [PROMPTS[1]]
    plain, _ = _run(model, tiny_tokenizer, prompts)
    speculative, metrics = _run(model, tiny_tokenizer, prompts, _drafter(method, make_tiny_model, "qwen2"))
    assert speculative == plain
    assert metrics.drafted_tokens > 0
