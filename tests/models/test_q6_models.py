"""Models whose file stores layers as GGUF Q6_K: under auto those layers run as q6 with the file's values exactly,
logits stay bitwise row invariant, and greedy speculation is identical to plain decoding for every drafter, batch 1
and > 1. The tiny models' Q6_K bytes are encoded here (gguf-py has no Q6_K quantizer); the real Q4_K_M files'
Q6_K layers are covered by tests/real."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from specdec.models.layers import ConcatLinear, TensorStorage
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


def q4k_bytes(out_features: int, in_features: int, seed: int) -> np.ndarray:
    """Valid random GGUF Q4_K super-blocks [out, in/256 * 144] (any scale, min and quant bytes; small fp16 d and
    dmin, so that the weights stay of the tiny models' size)."""
    rng = np.random.default_rng(seed)
    count = out_features * in_features // 256
    blocks = rng.integers(0, 256, size=(count, 144), dtype=np.uint8)
    blocks[:, 0:2] = (rng.standard_normal(count) * 1e-4).astype(np.float16).view(np.uint8).reshape(count, 2)
    blocks[:, 2:4] = np.abs(rng.standard_normal(count) * 1e-4).astype(np.float16).view(np.uint8).reshape(count, 2)
    return blocks.reshape(out_features, -1)


def mixed_qkv_model(architecture, seed=0):
    """A tiny model whose 'file' stores q and k as Q4_K and v as Q6_K in every layer (as Qwen2.5-Coder-1.5B's
    Q4_K_M stores half its layers)."""
    overrides = dict(Q4_WIDTHS, attention_scale=64**-0.5) if architecture == "gemma3" else Q4_WIDTHS
    config = tiny_config(architecture, **overrides)
    tensors = tiny_tensors(config, seed)
    storage = TensorStorage()
    for index in range(config.num_layers):
        for leaf in ("q_proj", "k_proj", "v_proj"):
            name = f"layers.{index}.{leaf}"
            out_features, in_features = tensors[name].shape
            if leaf == "v_proj":
                raw, block_type = q6k_bytes(tensors[name]), GGMLQuantizationType.Q6_K
            else:
                raw = q4k_bytes(out_features, in_features, seed + 3 * index + len(leaf))
                block_type = GGMLQuantizationType.Q4_K
            storage.types[name] = block_type.name
            storage.block_bytes[name] = torch.from_numpy(raw)
            tensors[name] = torch.from_numpy(gguf_dequantize(raw, block_type)).view(out_features, in_features)
    return Transformer(config, tensors, "auto", storage=storage), tensors


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_mixed_qkv_runs_each_part_lossless_in_the_files_order(architecture):
    model, tensors = mixed_qkv_model(architecture)
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for index, layer in enumerate(model.layers):
        qkv = layer.qkv_proj
        assert isinstance(qkv, ConcatLinear) and qkv.format == "q4+q6"
        names = [f"layers.{index}.{leaf}" for leaf in ("q_proj", "k_proj", "v_proj")]
        assert torch.equal(qkv.parts[0].q4.dequantize(), torch.cat([tensors[name] for name in names[:2]]))
        assert torch.equal(qkv.parts[1].q6.dequantize(), tensors[names[2]])
        dense = torch.cat([tensors[name] for name in names])
        bias = qkv.parts[0].bias
        if model.config.qkv_bias:  # each part has its rows of the bias
            bias = torch.cat([qkv.parts[0].bias, qkv.parts[1].bias])
            assert torch.equal(bias, torch.cat([tensors[f"layers.{index}.{leaf}.bias"]
                                                for leaf in ("q_proj", "k_proj", "v_proj")]))
        reference = torch.nn.functional.linear(x, dense, bias)  # [5, q + 2 kv]
        assert ((qkv(x) - reference).norm() / reference.norm()).item() < 0.02  # int8 activations
    assert set(model.linear_bytes()) == {"q4", "q6", "q8"}
    assert model.linear_bytes()["q6"] == sum(layer.qkv_proj.parts[1].nbytes() for layer in model.layers)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_mixed_qkv_model_is_row_invariant_and_lossless(tiny_tokenizer, architecture):
    """Prefill (whose last layer projects only the keys and values of rows without logits: the q4 part's key rows
    and the q6 part) and verify blocks give token-by-token decoding's logits bit for bit."""
    model, _ = mixed_qkv_model(architecture)
    _assert_row_invariant_and_lossless(model, tiny_tokenizer)


def test_concat_linear_rows_take_each_parts_rows():
    model, _ = mixed_qkv_model("qwen2")
    qkv = model.layers[0].qkv_proj
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    full = qkv(x)  # [3, out]
    q_rows, out = qkv.parts[0].out_features, qkv.out_features
    for row_ids in (torch.arange(q_rows - 64, out), torch.arange(0, 8), torch.arange(q_rows, out)):
        assert torch.equal(qkv.rows(row_ids)(x), full[:, row_ids])
    assert qkv.rows(torch.arange(0, 8)).format == "q4" and qkv.rows(torch.arange(q_rows, out)).format == "q6"
    with pytest.raises(ValueError, match="increasing order"):
        qkv.rows(torch.tensor([5, 3]))
    with pytest.raises(ValueError, match=r"row ids must lie in \[0, "):
        qkv.rows(torch.tensor([out]))
