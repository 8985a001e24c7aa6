"""The real Q4_K_M files under the default weight format (auto): their Q4_K layers run as q4 and their Q6_K layers
as q6, both carrying the file's values exactly (the fp32 dequantization of the same bytes); their Q5_0 layers as q5 on
the avx2 path and q8 elsewhere (resolved_weight_format); everything else stays q8."""
import pytest
import torch

from specdec.cache.kv_cache import KVCache
from specdec.kernels import avx_vnni_active, forced_isa, supported_isas
from specdec.models.layers import resolved_weight_format
from specdec.models.batch import ForwardBatch
from specdec.models.catalog import model_path
from specdec.models.loader import load_checkpoint
from specdec.models.transformer import Transformer
from real_models import real_model_path

pytestmark = pytest.mark.real


def test_gemma_block_layers_are_q4_and_q6_and_lossless():
    real_model_path("gemma-3-270m")
    checkpoint = load_checkpoint(model_path("gemma-3-270m"), keep_block_bytes=True)
    model = Transformer(checkpoint.config, checkpoint.tensors, "auto", storage=checkpoint.storage)
    q5_in_auto = resolved_weight_format("auto") == "q5"
    counts = {"Q4_K": 0, "Q6_K": 0}
    for index, layer in enumerate(model.layers):
        for linear, name in ((layer.o_proj, "o_proj"), (layer.down_proj, "down_proj")):
            stored = checkpoint.storage.types[f"layers.{index}.{name}"]
            assert linear.format == {"Q4_K": "q4", "Q6_K": "q6"}.get(stored, "q8"), (index, name, stored)
            if stored in counts:
                counts[stored] += 1
                assert torch.equal(linear.blocks.dequantize(), checkpoint.tensors[f"layers.{index}.{name}"])
        # Q5_0 / Q8_0 in this file, and 640 inputs
        assert layer.qkv_proj.format in (("q5", "q5+q8") if q5_in_auto else ("q8",))
    assert counts == {"Q4_K": 27, "Q6_K": 9}  # 18 o_proj + 9 down_proj as Q4_K, 9 down_proj as Q6_K
    assert set(model.linear_bytes()) == {"q4", "q6", "q8"} | ({"q5"} if q5_in_auto else set())


def test_qwen_1_5b_mixed_qkv_runs_as_lossless_q4_and_q6_parts():
    """Qwen2.5-Coder-1.5B's Q4_K_M stores q and k as Q4_K and v as Q6_K in half of its layers: those run as a q4 part
    and a q6 part (ConcatLinear) with the file's values, the others as one q4 linear."""
    real_model_path("qwen2.5-coder-1.5b-instruct")
    checkpoint = load_checkpoint(model_path("qwen2.5-coder-1.5b-instruct"), keep_block_bytes=True)
    model = Transformer(checkpoint.config, checkpoint.tensors, "auto", storage=checkpoint.storage)
    mixed = 0
    for index, layer in enumerate(model.layers):
        names = [f"layers.{index}.{leaf}" for leaf in ("q_proj", "k_proj", "v_proj")]
        stored = [checkpoint.storage.types[name] for name in names]
        if stored == ["Q4_K", "Q4_K", "Q6_K"]:
            mixed += 1
            assert layer.qkv_proj.format == "q4+q6", index
            q4_part, q6_part = layer.qkv_proj.parts
            assert torch.equal(q4_part.q4.dequantize(), torch.cat([checkpoint.tensors[name] for name in names[:2]]))
            assert torch.equal(q6_part.q6.dequantize(), checkpoint.tensors[names[2]])
        else:
            assert stored == ["Q4_K"] * 3 and layer.qkv_proj.format == "q4", (index, stored)
    assert mixed == 14


def test_gemma_q5_runs_its_q5_0_layers_as_q5_with_autos_bits(monkeypatch):
    """Gemma-3-270M's Q5_0 layers (q/k and gate/up, 640 inputs) and Q8_0 layers (v in half the layers, the embedding
    table and tied output layer) carry the file's values exactly: as q8 under auto off the avx2 path, as q5 (Q5_0)
    under weight_format="q5" and under auto on the avx2 path, in a third fewer bytes; all give the same logits bit for
    bit. q5 reduces in the vnni layout's order, so every q8 layer here is packed in that layout (the amx path's
    default, the amx layout, reduces in another order)."""
    monkeypatch.setenv("SPECDEC_Q8_LAYOUT", "vnni")
    real_model_path("gemma-3-270m")
    checkpoint = load_checkpoint(model_path("gemma-3-270m"), keep_block_bytes=True)
    with forced_isa("scalar"):  # auto as it loads off the avx2 path (the vnni layout runs on every path)
        auto = Transformer(checkpoint.config, checkpoint.tensors, "auto", storage=checkpoint.storage)
    small = Transformer(checkpoint.config, checkpoint.tensors, "q5", storage=checkpoint.storage)
    q5_parts = 0
    for index, (auto_layer, layer) in enumerate(zip(auto.layers, small.layers)):
        gate = f"layers.{index}.gate_proj"
        assert checkpoint.storage.types[gate] == "Q5_0" and layer.gate_up_proj.format == "q5"
        expected = torch.cat([checkpoint.tensors[gate], checkpoint.tensors[f"layers.{index}.up_proj"]])
        assert torch.equal(layer.gate_up_proj.blocks.dequantize(), expected)
        assert torch.equal(auto_layer.gate_up_proj.quantized.dequantize(), expected)
        qkv = torch.cat([checkpoint.tensors[f"layers.{index}.{leaf}"] for leaf in ("q_proj", "k_proj", "v_proj")])
        assert torch.equal(auto_layer.qkv_proj.quantized.dequantize(), qkv)
        q5_parts += sum(part.format == "q5" for part in layer.qkv_proj.parts)
    assert q5_parts == 18  # q/k (and v where it is Q5_0) as one q5 part per layer
    assert torch.equal(auto.embed_tokens.quantized.dequantize(), checkpoint.tensors["embed_tokens"])  # Q8_0
    assert small.linear_bytes()["q5"] < 0.7 * (auto.linear_bytes()["q8"] - small.linear_bytes()["q8"])
    models = {"auto off avx2": auto, "q5": small}
    if "avx2" in supported_isas():
        with forced_isa("avx2"):
            models["auto on avx2"] = Transformer(checkpoint.config, checkpoint.tensors, "auto",
                                                 storage=checkpoint.storage)
            on_avx2 = {layer.gate_up_proj.format for layer in models["auto on avx2"].layers}
            assert on_avx2 == ({"q8"} if avx_vnni_active() else {"q5"})
    logits = {}
    for name, model in models.items():
        cache = KVCache(model.config, 1, 64, model.device, dtype=model.kv_cache_dtype)
        logits[name] = model.forward(ForwardBatch.build([list(range(2, 14))], [0], [0], all_logits=True), cache)
    for name, model_logits in logits.items():
        assert torch.equal(model_logits, logits["q5"]), name
