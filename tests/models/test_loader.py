"""Loader tests: real GGUF files, dequantization against gguf-py, HF directory round trips, damaged files."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.models import loader
from specdec.models.loader import (ModelLoadError, load_checkpoint, load_gguf, load_hf_dir, load_tokenizer,
                                   read_gguf_file)
from real_models import gguf_dequantize_with_torch, one_gguf_reader, real_model_path
from tiny_models import tiny_config, write_tiny_tokenizer


# ------------------------------------------------------------------------------------------------- real files

EXPECTED_CONFIGS = {  # hand-checked against the models' Hugging Face config.json files
    "gemma-3-270m": dict(
        architecture="gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18,
        num_heads=4, num_kv_heads=1, head_dim=256, max_position_embeddings=32768, rope_theta=1e6,
        rope_local_theta=10000.0, sliding_window=512, qkv_bias=False, qk_norm=True, post_norms=True,
        embedding_scale=math.sqrt(640), activation="gelu_tanh", tie_word_embeddings=True, attention_scale=1 / 16,
        final_logit_softcap=None,
    ),
    "smollm2-135m-instruct": dict(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
        qkv_bias=False, qk_norm=False, post_norms=False, activation="silu", tie_word_embeddings=True,
        layer_types=(), sliding_window=None, embedding_scale=1.0,
    ),
    "qwen2.5-coder-0.5b-instruct": dict(
        architecture="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
        num_heads=14, num_kv_heads=2, head_dim=64, max_position_embeddings=32768, rope_theta=1e6,
        qkv_bias=True, qk_norm=False, post_norms=False, activation="silu", tie_word_embeddings=False,
    ),
}


@pytest.fixture(scope="module")
def real_checkpoints():
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_gguf(real_model_path(name))
        return cache[name]

    return get


@pytest.mark.real
@pytest.mark.parametrize("name", sorted(EXPECTED_CONFIGS))
def test_real_gguf_config_and_shapes(real_checkpoints, name: str) -> None:
    checkpoint = real_checkpoints(name)
    config = checkpoint.config
    for field, expected in EXPECTED_CONFIGS[name].items():
        assert getattr(config, field) == pytest.approx(expected) if isinstance(expected, float) else \
            getattr(config, field) == expected, field
    assert abs(config.rms_norm_eps - (1e-5 if config.architecture == "llama" else 1e-6)) < 1e-9
    tensors = checkpoint.tensors
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors.values())
    assert tensors["embed_tokens"].shape == (config.vocab_size, config.hidden_size)
    assert tensors["layers.0.q_proj"].shape == (config.num_heads * config.head_dim, config.hidden_size)
    assert tensors["layers.0.k_proj"].shape == (config.num_kv_heads * config.head_dim, config.hidden_size)
    assert tensors["layers.0.down_proj"].shape == (config.hidden_size, config.intermediate_size)
    assert ("lm_head" in tensors) == (not config.tie_word_embeddings)
    assert ("layers.0.q_proj.bias" in tensors) == config.qkv_bias
    assert all(torch.isfinite(t).all() for t in tensors.values())
    assert checkpoint.tokenizer.vocab_size == config.vocab_size


@pytest.mark.real
def test_gemma3_layer_pattern_and_norms(real_checkpoints) -> None:
    config = real_checkpoints("gemma-3-270m").config
    assert [i for i, kind in enumerate(config.layer_types) if kind == "full"] == [5, 11, 17]
    assert config.layer_rope_theta(0) == 10000.0 and config.layer_rope_theta(5) == 1e6
    # llama.cpp's converter stores Gemma's (1 + w): the final norm's multipliers are mostly well above zero.
    final_norm = real_checkpoints("gemma-3-270m").tensors["norm"]
    assert final_norm.mean() > 1.0


@pytest.mark.real
def test_dequantization_matches_gguf_py() -> None:
    import gguf
    from gguf.quants import dequantize

    for name in ("gemma-3-270m", "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"):
        path = real_model_path(name)
        gguf_file = read_gguf_file(path)
        reader = gguf.GGUFReader(path)
        seen = set()
        for reference, info in zip(reader.tensors, gguf_file.tensors):
            assert (reference.name, int(reference.data_offset)) == (info.name, info.offset)
            if reference.tensor_type in seen or reference.n_elements > 50_000_000:
                continue
            seen.add(reference.tensor_type)
            expected = dequantize(reference.data, reference.tensor_type).reshape(info.shape)
            actual = loader._dequantize_gguf_tensor(gguf_file, info, path).numpy()
            np.testing.assert_array_equal(actual, expected, err_msg=f"{name} {info.name}")


@pytest.mark.parametrize("type_name", sorted(loader._TORCH_DEQUANTIZERS))
def test_torch_dequantizers_match_gguf_py(type_name: str) -> None:
    """Random blocks (with finite fp16 scales) decode exactly like gguf-py's reference code."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    block_values, block_bytes, _ = loader._TORCH_DEQUANTIZERS[type_name]
    fp16_offsets = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(6, 3 * block_bytes), dtype=np.uint8)  # 6 rows of 3 blocks
    blocks = raw.reshape(-1, block_bytes)
    for offset in fp16_offsets.get(type_name, (0,)):
        scales = rng.uniform(-2, 2, size=(blocks.shape[0], 1)).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8)
    expected = dequantize(raw, GGMLQuantizationType[type_name])
    actual = loader._dequantize_with_torch(raw, type_name, expected.shape).numpy()
    np.testing.assert_array_equal(actual, expected)


@pytest.mark.real
def test_llama_qk_unpermuted_like_transformers(real_checkpoints) -> None:
    """Our q/k rows (HF rotate-half layout) equal transformers' GGUF-loaded SmolLM2 weights."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    path = real_model_path("smollm2-135m-instruct")
    with one_gguf_reader(), gguf_dequantize_with_torch():
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ours = real_checkpoints("smollm2-135m-instruct").tensors
    for layer in (0, 17):
        attention = model.model.layers[layer].self_attn
        for leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
            torch.testing.assert_close(ours[f"layers.{layer}.{leaf}"], getattr(attention, leaf).weight,
                                       rtol=0, atol=0)
    # and they really were permuted in the file
    raw = read_gguf_file(path)
    info = next(t for t in raw.tensors if t.name == "blk.0.attn_q.weight")
    file_rows = loader._dequantize_gguf_tensor(raw, info, path)
    assert not torch.equal(file_rows, ours["layers.0.q_proj"])
    assert torch.equal(loader.unpermute_rope_rows(file_rows, 9), ours["layers.0.q_proj"])


@pytest.mark.real
@pytest.mark.parametrize("name, looked_up", [("smollm2-135m-instruct", ["embed_tokens"]),
                                             ("qwen2.5-coder-0.5b-instruct",
                                              ["layers.0.q_proj", "layers.0.down_proj", "layers.3.gate_proj"])])
def test_block_bytes_are_read_from_the_file_when_looked_up(name: str, looked_up: list[str]) -> None:
    """keep_block_bytes keeps no bytes: each lookup copies one tensor's blocks out of the file (a new tensor each
    time), and those blocks decode to the tensor's fp32 values. The 0.5B's are Q5_0, Q6_K and Q4_K; SmolLM2's
    layers are Q4_1 (no lossless format: not kept), its embedding table Q8_0."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    checkpoint = load_gguf(real_model_path(name), keep_block_bytes=True)
    block_bytes, types = checkpoint.storage.block_bytes, checkpoint.storage.types
    assert isinstance(block_bytes, loader.GGUFBlockBytes)
    assert set(block_bytes) == {tensor for tensor, type_name in types.items()
                                if type_name in loader.BLOCK_STORAGE and len(checkpoint.tensors.shape(tensor)) == 2}
    assert "norm" not in block_bytes
    for tensor in looked_up:
        first, second = block_bytes[tensor], block_bytes[tensor]
        assert torch.equal(first, second) and first.data_ptr() != second.data_ptr()
        values = dequantize(first.numpy(), GGMLQuantizationType[types[tensor]])
        assert torch.equal(torch.from_numpy(values).reshape(checkpoint.tensors.shape(tensor)),
                           checkpoint.tensors[tensor])
    assert not load_gguf(real_model_path(name)).storage.block_bytes


def test_llama_qk_block_bytes_are_unpermuted_like_its_weights(tmp_path) -> None:
    """A llama file's q/k rows, interleaved by llama.cpp, come out of GGUFBlockBytes in HF's order, as the fp32
    tensors do: whole rows of blocks moved, so they decode to the unpermuted weight."""
    import gguf
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    config = tiny_config("llama")
    weights = {"blk.0.attn_q.weight": (config.num_heads, 1), "blk.0.attn_k.weight": (config.num_kv_heads, 2),
               "blk.0.attn_v.weight": (config.num_kv_heads, 3)}
    writer = gguf.GGUFWriter(str(tmp_path / "qk.gguf"), "llama")
    rows = {}
    for tensor_name, (heads, seed) in weights.items():
        weight = np.random.default_rng(seed).standard_normal((heads * config.head_dim, 64)).astype(np.float32)
        rows[tensor_name] = quantize(weight, GGMLQuantizationType.Q8_0)
        writer.add_tensor(tensor_name, rows[tensor_name], raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path = tmp_path / "qk.gguf"
    block_bytes = loader.GGUFBlockBytes(read_gguf_file(path), config, path)
    canonical_names = {"blk.0.attn_q.weight": "layers.0.q_proj", "blk.0.attn_k.weight": "layers.0.k_proj",
                       "blk.0.attn_v.weight": "layers.0.v_proj"}
    for tensor_name, canonical in canonical_names.items():
        heads = weights[tensor_name][0]
        file_values = torch.from_numpy(dequantize(rows[tensor_name], GGMLQuantizationType.Q8_0))
        expected = file_values if canonical.endswith("v_proj") else loader.unpermute_rope_rows(file_values, heads)
        ours = torch.from_numpy(dequantize(block_bytes[canonical].numpy(), GGMLQuantizationType.Q8_0))
        assert torch.equal(ours, expected)
    assert not torch.equal(block_bytes["layers.0.q_proj"], torch.from_numpy(rows["blk.0.attn_q.weight"]))


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"])
def test_rows_of_a_tensor_are_its_rows(real_checkpoints, name: str) -> None:
    """GGUFTensors.rows dequantizes a row range alone, bit for bit those rows of the whole tensor: every block type
    of these files (the 1.5B's embedding table is Q4_K, its output layer Q6_K), llama's reordered q/k rows too."""
    tensors = real_checkpoints(name).tensors
    checked = set()
    for tensor_name in tensors:
        if len(tensors.shape(tensor_name)) != 2 or tensor_name.startswith("layers.") and ".0." not in tensor_name:
            continue
        whole = tensors[tensor_name]
        for start, end in ((0, 1), (3, 70), (whole.shape[0] - 5, whole.shape[0])):
            assert torch.equal(tensors.rows(tensor_name, start, end), whole[start:end]), (tensor_name, start)
        checked.add(real_checkpoints(name).storage.types.get(tensor_name, "F32"))
    assert len(checked) >= 2, checked


def test_unpermute_inverts_llama_cpp_permute() -> None:
    heads, head_dim, hidden = 3, 8, 5
    weight = torch.randn(heads * head_dim, hidden)
    # llama.cpp convert_hf_to_gguf.py: reshape(n_head, 2, d/2, ...).swapaxes(1, 2)
    permuted = weight.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(weight.shape)
    assert torch.equal(loader.unpermute_rope_rows(permuted, heads), weight)


# ------------------------------------------------------------------------------------------------ HF directories

def _tiny_hf_model(architecture: str):
    import transformers

    common = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    if architecture == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=False))
    if architecture == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))
    config = transformers.Gemma3TextConfig(**common, head_dim=16, sliding_window=16, query_pre_attn_scalar=24,
                                           layer_types=["sliding_attention", "full_attention"])
    return transformers.Gemma3ForCausalLM(config)


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "gemma3"])
def test_hf_dir_round_trip(tmp_path, architecture: str) -> None:
    torch.manual_seed(0)
    model = _tiny_hf_model(architecture)
    with torch.no_grad():  # make norm weights non-trivial so the Gemma +1 is visible
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(-0.5, 0.5)
    model.save_pretrained(tmp_path)
    write_tiny_tokenizer(tmp_path)
    checkpoint = load_checkpoint(tmp_path)
    config, tensors = checkpoint.config, checkpoint.tensors
    hf = model.config
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (300, 32, 48)
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (2, 4, 2)
    assert config.head_dim == (16 if architecture == "gemma3" else 8)
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    assert ("lm_head" in tensors) == (not hf.tie_word_embeddings)
    assert config.qkv_bias == (architecture == "qwen2")
    state = model.state_dict()
    shift = 1.0 if architecture == "gemma3" else 0.0
    torch.testing.assert_close(tensors["embed_tokens"], state["model.embed_tokens.weight"])
    torch.testing.assert_close(tensors["norm"], state["model.norm.weight"] + shift)
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        torch.testing.assert_close(tensors[f"layers.{layer}.q_proj"], state[prefix + "self_attn.q_proj.weight"])
        torch.testing.assert_close(tensors[f"layers.{layer}.down_proj"], state[prefix + "mlp.down_proj.weight"])
        torch.testing.assert_close(
            tensors[f"layers.{layer}.attn_norm"], state[prefix + "input_layernorm.weight"] + shift
        )
        if architecture == "gemma3":
            torch.testing.assert_close(tensors[f"layers.{layer}.post_attn_norm"],
                                       state[prefix + "post_attention_layernorm.weight"] + 1)
            torch.testing.assert_close(tensors[f"layers.{layer}.ffn_norm"],
                                       state[prefix + "pre_feedforward_layernorm.weight"] + 1)
            torch.testing.assert_close(tensors[f"layers.{layer}.post_ffn_norm"],
                                       state[prefix + "post_feedforward_layernorm.weight"] + 1)
            torch.testing.assert_close(tensors[f"layers.{layer}.q_norm"], state[prefix + "self_attn.q_norm.weight"] + 1)
        else:
            torch.testing.assert_close(tensors[f"layers.{layer}.ffn_norm"],
                                       state[prefix + "post_attention_layernorm.weight"])
        if architecture == "qwen2":
            torch.testing.assert_close(tensors[f"layers.{layer}.k_proj.bias"], state[prefix + "self_attn.k_proj.bias"])
    if architecture == "gemma3":
        assert config.layer_types == ("sliding", "full")
        assert config.sliding_window == 16
        assert config.attention_scale == pytest.approx(24**-0.5)
        assert (config.rope_local_theta, config.rope_theta) == (10000.0, 1e6)
        assert config.embedding_scale == pytest.approx(math.sqrt(32))
        assert (config.activation, config.qk_norm, config.post_norms) == ("gelu_tanh", True, True)
    assert checkpoint.tokenizer.bos_token_id is not None


def test_hf_dir_errors(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba'; supported: .*llama.*qwen2"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ModelLoadError, match="lacks required field"):
        load_hf_dir(tmp_path)


# ------------------------------------------------------------------------------------------------ damaged files

def _write_tiny_gguf(path: Path, architecture: str = "llama", tensor: np.ndarray | None = None) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_uint32(f"{architecture}.embedding_length", 8)
    writer.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32) if tensor is None else tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_missing_path(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="no such model file or directory"):
        load_checkpoint(tmp_path / "absent.gguf")
    with pytest.raises(ModelLoadError, match="no such GGUF file"):
        load_gguf(tmp_path / "absent.gguf")
    with pytest.raises(ModelLoadError, match="no such GGUF file"):
        load_tokenizer(tmp_path / "absent.gguf")


def test_load_tokenizer_is_the_checkpoints_tokenizer_without_the_weights(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    text = "def add(a, b):\n    return a + b  # ünïcode"
    assert tokenizer.encode(text) == load_hf_dir(tiny_model_dir).tokenizer.encode(text)
    gguf = real_model_path("smollm2-135m-instruct")
    assert load_tokenizer(gguf).encode(text) == load_gguf(gguf).tokenizer.encode(text)


def test_random_bytes(tmp_path) -> None:
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        load_checkpoint(path)
    path.write_bytes(b"GGUF" + np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_checkpoint(path)
    path.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        load_checkpoint(path)


def test_unsupported_architecture(tmp_path) -> None:
    path = _write_tiny_gguf(tmp_path / "mamba.gguf", "mamba")
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'mamba'; supported: llama, qwen2, gemma3"):
        load_gguf(path)


def test_unsupported_quantization_type(tmp_path) -> None:
    path = _write_tiny_gguf(tmp_path / "int.gguf", tensor=np.ones((4, 8), dtype=np.int32))
    gguf_file = read_gguf_file(path)
    with pytest.raises(ModelLoadError, match="tensor token_embd.weight uses quantization type I32"):
        loader._check_gguf_quant_types(gguf_file.tensors, path)


def test_unknown_quantization_type_id(tmp_path) -> None:
    path = _write_tiny_gguf(tmp_path / "unknown.gguf")
    data = bytearray(path.read_bytes())
    name = b"token_embd.weight"
    type_position = data.index(name) + len(name) + 4 + 2 * 8  # n_dims u32, two u64 dims, then the type
    assert data[type_position:type_position + 4] == (0).to_bytes(4, "little")  # F32
    data[type_position:type_position + 4] = (250).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="token_embd.weight uses unknown quantization type id 250"):
        load_gguf(path)


@pytest.mark.real
def test_truncated_real_file(tmp_path) -> None:
    source = real_model_path("smollm2-135m-instruct")
    path = tmp_path / "half.gguf"
    with source.open("rb") as handle:
        path.write_bytes(handle.read(source.stat().st_size // 2))
    with pytest.raises(ModelLoadError, match=r"is truncated: tensor .* ends at byte \d+ but the file has"):
        load_gguf(path)
    with source.open("rb") as handle:
        path.write_bytes(handle.read(100_000))  # cut inside the vocabulary
    with pytest.raises(ModelLoadError, match="truncated or corrupt: header ends early"):
        load_gguf(path)


@pytest.mark.real
@pytest.mark.slow
def test_qwen_1_5b_loads() -> None:
    checkpoint = load_gguf(real_model_path("qwen2.5-coder-1.5b-instruct"))
    config = checkpoint.config
    assert (config.architecture, config.hidden_size, config.intermediate_size) == ("qwen2", 1536, 8960)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (28, 12, 2, 128)
    assert config.qkv_bias and not config.tie_word_embeddings
    assert checkpoint.tensors["lm_head"].shape == (151936, 1536)
    assert checkpoint.tokenizer.vocab_size == 151936
