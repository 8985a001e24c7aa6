"""q5 (GGUF Q5_0 blocks, repacked): lossless import of Q5_0 bytes, the 5-bit layout's round trip, and every kernel
path's q5_linear bitwise equal to q8_linear on the same weights (so row and thread invariant as q8 is)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from specdec.kernels import ops, q5
from tiny_models import random_int8_blocks

# whole blocks of 32: one block, a tail unit of each size (64 = 2 blocks, 96 = 3 blocks padded to 128), Gemma's 640,
# Qwen-0.5B's 896, several 512-column groups with tails (2880), a width past the sliced walk (4160)
WIDTHS = (32, 64, 96, 640, 896, 2880, 4160)
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 13, 40, 130)  # every tile size of the avx2 path (1-8), and several tiles


def _random_weight(out_features: int, in_features: int, seed: int) -> q5.Q5Weight:
    """A random q5 weight with every value -16..15 present."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(-16, 16, (out_features, in_features), generator=g, dtype=torch.int8)
    scale = (torch.rand(out_features, -(-in_features // 32), generator=g) * 1e-2).to(torch.float16)
    return q5.Q5Weight.from_int8(values, scale)


def _activations(rows: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] with outlier columns and an all-zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g)
    x[::5, :: max(1, in_features // 5)] *= 30.0
    if rows > 3:
        x[3] = 0.0
    return x


@pytest.mark.parametrize("in_features", [32, 640, 896])
def test_q5_0_import_equals_gguf_dequantization(in_features):
    raw = random_int8_blocks("Q5_0", 7, in_features, seed=in_features)
    weight = q5.q5_from_q5_0_blocks(raw, 7, in_features)
    expected = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType.Q5_0)).view(7, in_features)
    assert torch.equal(weight.dequantize(), expected)
    assert weight.bits_per_weight == pytest.approx(5.5 * (-(-in_features // 64) * 64) / in_features)


@pytest.mark.parametrize("out_features", [1, 4, 7, 9])
@pytest.mark.parametrize("in_features", WIDTHS)
def test_int8_round_trip_and_rows(out_features, in_features):
    g = torch.Generator().manual_seed(out_features * in_features)
    values = torch.randint(-16, 16, (out_features, in_features), generator=g, dtype=torch.int8)
    scale = torch.rand(out_features, -(-in_features // 32), generator=g).to(torch.float16)
    weight = q5.Q5Weight.from_int8(values, scale)
    assert torch.equal(weight.int8(), values)
    picked = torch.tensor([out_features - 1, 0])
    assert torch.equal(weight.rows(picked).int8(), values[picked])
    # the q8 weight of the same values: the very int8 and scales
    q8 = weight.as_q8()
    assert torch.equal(q8.int8(), values) and torch.equal(q8.dequantize(), weight.dequantize())


def test_out_of_range_values_and_wrong_byte_counts_are_refused():
    with pytest.raises(ValueError, match="-16..15"):
        q5.Q5Weight.from_int8(torch.full((4, 32), 16, dtype=torch.int8), torch.ones(4, 1, dtype=torch.float16))
    with pytest.raises(ValueError, match="bytes"):
        q5.q5_from_q5_0_blocks(np.zeros((4, 21), dtype=np.uint8), 4, 32)
    with pytest.raises(ValueError, match="whole blocks"):
        q5.q5_from_q5_0_blocks(np.zeros((4, 22), dtype=np.uint8), 4, 48)


@pytest.mark.parametrize("in_features", WIDTHS)
def test_q5_linear_is_q8_linear_bitwise_on_every_path(in_features, threads):
    """Every path this CPU runs (the scalar one included): q5_linear equals q8_linear on the same weights bit for bit,
    for every row count, full tiles and the last out % 4 rows, with and without bias."""
    out_features = 4 * 9 + 3
    weight = _random_weight(out_features, in_features, seed=in_features)
    reference = weight.as_q8()
    bias = torch.randn(out_features)
    for rows in ROWS:
        x = _activations(rows, in_features, seed=rows)
        for isa in (path for path in ops.supported_isas() if path != "amx") or ("scalar",):
            with ops.forced_isa(isa):
                assert torch.equal(q5.q5_linear(x, weight, bias), ops.q8_linear(x, reference, bias)), (isa, rows)
                assert torch.equal(q5.q5_linear(x, weight), ops.q8_linear(x, reference)), (isa, rows)


def test_q5_linear_on_the_amx_path_is_its_avx512_code():
    """The amx path runs q5 on the avx512 code (q5 has no AMX tile layout): the same bits."""
    if "amx" not in ops.supported_isas():
        pytest.skip("this CPU cannot run the amx kernels")
    weight = _random_weight(40, 896, seed=1)
    x = _activations(8, 896, seed=2)
    with ops.forced_isa("avx512"):
        expected = q5.q5_linear(x, weight)
    with ops.forced_isa("amx"):
        assert torch.equal(q5.q5_linear(x, weight), expected)


def test_rows_of_a_call_do_not_change_a_rows_bits(vector_path):
    weight = _random_weight(64, 896, seed=3)
    x = _activations(13, 896, seed=4)
    together = q5.q5_linear(x, weight)
    for row in (0, 5, 12):
        assert torch.equal(q5.q5_linear(x[row : row + 1], weight), together[row : row + 1])


def test_torch_fallback_is_close_to_the_kernel():
    weight = _random_weight(32, 640, seed=5)
    x = _activations(3, 640, seed=6)
    assert torch.allclose(q5.q5_linear_torch(x, weight), q5.q5_linear(x, weight), rtol=0.02, atol=0.05)


def test_the_kernel_checks_its_inputs():
    weight = _random_weight(8, 64, seed=7)
    with pytest.raises(ValueError, match="features"):
        q5.q5_linear(torch.randn(1, 32), weight)
    ext = ops._load()
    with pytest.raises(RuntimeError, match="quants must be"):
        ext.q5_linear(torch.randn(1, 64), weight.quants[:, :-1].contiguous(), weight.scale, None, 64)
