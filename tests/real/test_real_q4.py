"""The real Q4_K_M files under the default weight format (auto): their Q4_K layers run as q4 and carry the file's
values exactly (the fp32 dequantization of the same bytes), everything else stays q8."""
import pytest
import torch

from specdec.models.catalog import model_path
from specdec.models.loader import load_checkpoint
from specdec.models.transformer import Transformer
from real_models import real_model_path

pytestmark = pytest.mark.real


def test_gemma_q4k_layers_are_q4_and_lossless():
    real_model_path("gemma-3-270m")
    checkpoint = load_checkpoint(model_path("gemma-3-270m"), keep_q4k_bytes=True)
    model = Transformer(checkpoint.config, checkpoint.tensors, "auto", storage=checkpoint.storage)
    q4_layers = 0
    for index, layer in enumerate(model.layers):
        for linear, name in ((layer.o_proj, "o_proj"), (layer.down_proj, "down_proj")):
            stored = checkpoint.storage.types[f"layers.{index}.{name}"]
            assert linear.format == ("q4" if stored == "Q4_K" else "q8"), (index, name, stored)
            if stored == "Q4_K":
                q4_layers += 1
                assert torch.equal(linear.q4.dequantize(), checkpoint.tensors[f"layers.{index}.{name}"])
        assert layer.qkv_proj.format == "q8"  # Q5_0 / Q8_0 in this file, and 640 inputs
    assert q4_layers == 27  # 18 o_proj + 9 down_proj stored as Q4_K
    assert set(model.linear_bytes()) == {"q4", "q8"}
