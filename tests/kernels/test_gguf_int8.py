"""The GGUF int8 block types (Q8_0, Q5_0, Q4_0) decode to int8 values and fp16 block scales whose products are
gguf-py's dequantization bit for bit, and a q8 weight built from them carries exactly those values."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from specdec.kernels import QuantizedWeight
from specdec.kernels.gguf_int8 import int8_blocks
from tiny_models import random_int8_blocks


@pytest.mark.parametrize("storage_type", ["Q8_0", "Q5_0", "Q4_0"])
@pytest.mark.parametrize("in_features", [32, 96, 896])
def test_values_times_scales_are_gguf_dequantization(storage_type, in_features):
    raw = random_int8_blocks(storage_type, 5, in_features, seed=in_features)
    values, scales = int8_blocks(raw, storage_type, 5, in_features)
    expected = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[storage_type])).view(5, in_features)
    dequantized = values.float() * scales.float().repeat_interleave(32, dim=1)
    assert torch.equal(dequantized, expected)
    low, high = {"Q8_0": (-127, 127), "Q5_0": (-16, 15), "Q4_0": (-8, 7)}[storage_type]
    assert int(values.min()) >= low and int(values.max()) <= high
    assert torch.equal(QuantizedWeight.from_int8(values, scales).dequantize(), expected)  # a q8 weight holds them


def test_wrong_types_widths_and_byte_counts_are_refused():
    with pytest.raises(ValueError, match="not an int8 block type"):
        int8_blocks(np.zeros((1, 18), dtype=np.uint8), "Q4_1", 1, 32)
    with pytest.raises(ValueError, match="whole blocks"):
        int8_blocks(np.zeros((1, 34), dtype=np.uint8), "Q8_0", 1, 40)
    with pytest.raises(ValueError, match="bytes"):
        int8_blocks(np.zeros((1, 33), dtype=np.uint8), "Q8_0", 1, 32)
