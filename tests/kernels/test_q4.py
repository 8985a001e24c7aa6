"""q4 (GGUF Q4_K blocks, repacked): lossless import of Q4_K bytes, every vector path bitwise equal to the scalar
path, bitwise row and thread invariance, accuracy against the dequantized weight, the torch fallback."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from specdec.kernels import ops, q4

# in = 256 n for n = 1..4 (a lone unit of 8 sub-blocks, one of 16, 16 + 8, 16 + 16), Qwen-like widths (1536, 2048,
# 8960 = 35 super-blocks: 17 units of 16 and one of 8)
WIDTHS = (256, 512, 768, 1024, 1536, 2048, 8960)


def _random_q4k_bytes(out_features: int, in_features: int, seed: int) -> np.ndarray:
    """Valid random Q4_K super-blocks [out, in/256 * 144]: any scale and quant bytes, finite fp16 d and dmin
    (normal and subnormal, some zero)."""
    rng = np.random.default_rng(seed)
    count = out_features * in_features // 256
    blocks = rng.integers(0, 256, size=(count, 144), dtype=np.uint8)
    d = (rng.standard_normal(count) * 1e-3).astype(np.float16)
    dmin = np.abs(rng.standard_normal(count) * 1e-3).astype(np.float16)
    d[:: 7] = np.float16(3e-7)  # subnormal
    dmin[:: 11] = 0.0
    blocks[:, 0:2] = d.view(np.uint8).reshape(count, 2)
    blocks[:, 2:4] = dmin.view(np.uint8).reshape(count, 2)
    return blocks.reshape(out_features, -1)


def _random_weight(out_features: int, in_features: int, seed: int) -> q4.Q4Weight:
    """A random q4 weight with every field at its full range (quants 0..15, 6-bit scales and mins)."""
    g = torch.Generator().manual_seed(seed)
    super_blocks = in_features // 256
    blocks = q4.Q4Blocks(
        quants=torch.randint(0, 16, (out_features, in_features), generator=g, dtype=torch.uint8),
        sub_scales=torch.randint(0, 64, (out_features, 8 * super_blocks), generator=g, dtype=torch.uint8),
        sub_mins=torch.randint(0, 64, (out_features, 8 * super_blocks), generator=g, dtype=torch.uint8),
        d=(torch.rand(out_features, super_blocks, generator=g) * 2e-3).to(torch.float16),
        dmin=(torch.rand(out_features, super_blocks, generator=g) * 2e-3).to(torch.float16),
    )
    return q4.Q4Weight.from_blocks(blocks)


def _activations(rows: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] with outlier columns, a row of large values and an all-zero row; bias."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g)
    x[::5, :: max(1, in_features // 5)] *= 30.0
    if rows > 3:
        x[3] = 0.0
    if rows > 6:
        x[6] *= 1e6
    return x, torch.randn(256 * 40, generator=g)


def _bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)


# --------------------------------------------------------------------------- format


@pytest.mark.parametrize("out_features,in_features", [(1, 256), (5, 512), (9, 768), (4, 2304)])
def test_q4k_bytes_load_losslessly(out_features, in_features):
    raw = _random_q4k_bytes(out_features, in_features, seed=in_features + out_features)
    weight = q4.q4_from_q4k_blocks(raw, out_features, in_features)
    reference = gguf_dequantize(raw, GGMLQuantizationType.Q4_K).reshape(out_features, in_features)
    assert np.array_equal(_bits(weight.dequantize().numpy()), _bits(reference))
    assert weight.bits_per_weight == pytest.approx(4.625)
    # the torch-tensor input takes the same path
    again = q4.q4_from_q4k_blocks(torch.from_numpy(raw), out_features, in_features)
    assert torch.equal(again.quants, weight.quants) and torch.equal(again.scales, weight.scales)


@pytest.mark.parametrize("out_features,in_features", [(7, 256), (9, 1280), (4, 512)])
def test_packing_round_trips(out_features, in_features):
    weight = _random_weight(out_features, in_features, seed=3)
    blocks = weight.blocks()
    repacked = q4.Q4Weight.from_blocks(blocks)
    assert torch.equal(repacked.quants, weight.quants) and torch.equal(repacked.scales, weight.scales)
    assert all(torch.equal(a, b) for a, b in zip(repacked.blocks(), blocks))


def test_nibble_columns_cover_every_column_once():
    for in_features in (256, 512, 768, 8960):
        low, high = q4._nibble_columns(in_features)
        assert sorted(torch.cat([low, high]).tolist()) == list(range(in_features))


def test_nibbles_are_packed_in_the_order_the_nibble_columns_say():
    generator = torch.Generator().manual_seed(5)
    for in_features in range(256, 9216 + 256, 256):
        quants = torch.randint(0, 16, (5, in_features), dtype=torch.uint8, generator=generator)
        low, high = q4._nibble_columns(in_features)
        expected = quants.index_select(1, low) | (quants.index_select(1, high) << 4)
        assert torch.equal(q4._pack_nibbles(quants), expected), in_features


def test_q4k_tensors_need_a_multiple_of_256():
    assert not q4.q4_supports(640) and q4.q4_supports(2048)
    with pytest.raises(q4.Q4ShapeError, match="keep this layer at q8"):
        q4.q4_from_q4k_blocks(np.zeros((2, 144 * 2), np.uint8), 2, 320)
    assert [q4.padded_width(w) for w in (1, 32, 256, 257, 640, 896)] == [256, 256, 256, 512, 768, 1024]
    with pytest.raises(ValueError, match="in_features must be positive"):
        q4.padded_width(0)
    with pytest.raises(ValueError, match="768 stored columns do not pad a width of 512"):
        q4.Q4Weight.from_blocks(_random_weight(4, 768, seed=1).blocks(), in_features=512)


@pytest.mark.parametrize("in_features", [32, 100, 640, 896])
def test_padded_widths_add_exactly_nothing(in_features):
    """A weight quantized at a width that is no multiple of 256 is stored padded; the padded columns meet zero
    activations, so whatever they hold (here: random quants, and random scales and mins in sub-blocks that are
    padding only) the result is bit for bit the same, and it is the unpadded weight's product."""
    g = torch.Generator().manual_seed(in_features)
    dense = torch.randn(37, in_features, generator=g) * 0.05
    weight = q4.quantize_q4(dense)
    padded = q4.padded_width(in_features)
    assert (weight.in_features, weight.padded_in_features) == (in_features, padded)
    assert weight.dequantize().shape == (37, in_features)
    assert (weight.dequantize() - dense).norm() / dense.norm() < 0.1
    blocks = weight.blocks()
    first_padding_block = -(-in_features // 32)  # sub-blocks from here on are padding only: all zero
    assert not blocks.quants[:, first_padding_block * 32 :].any()
    assert not blocks.sub_scales[:, first_padding_block:].any()
    garbage = torch.randint(0, 16, blocks.quants[:, in_features:].shape, generator=g, dtype=torch.uint8)
    quants = blocks.quants.clone()
    quants[:, in_features:] = garbage
    sub_scales, sub_mins = blocks.sub_scales.clone(), blocks.sub_mins.clone()
    sub_scales[:, first_padding_block:] = torch.randint(0, 64, sub_scales[:, first_padding_block:].shape, generator=g,
                                                        dtype=torch.uint8)
    sub_mins[:, first_padding_block:] = torch.randint(0, 64, sub_mins[:, first_padding_block:].shape, generator=g,
                                                      dtype=torch.uint8)
    dirty = q4.Q4Weight.from_blocks(q4.Q4Blocks(quants, sub_scales, sub_mins, blocks.d, blocks.dmin), in_features)
    x, bias = _activations(9, in_features, seed=3)
    y = q4.q4_linear(x, weight, bias[:37])
    assert torch.equal(q4.q4_linear(x, dirty, bias[:37]), y)
    # the same weight read as a full-width one, with the activations padded by explicit zero columns
    full_width = q4.Q4Weight(weight.quants, weight.scales, padded)
    assert torch.equal(q4.q4_linear(torch.nn.functional.pad(x, (0, padded - in_features)), full_width, bias[:37]), y)
    reference = x @ weight.dequantize().T + bias[:37]
    assert (y - reference).norm() / reference.norm() < 2e-2
    for row in range(9):  # row invariance at a padded width
        assert torch.equal(q4.q4_linear(x[row : row + 1], weight, bias[:37]), y[row : row + 1])
    assert torch.equal(q4.q4_linear(x, weight.rows([36, 2, 5]), bias[[36, 2, 5]]), y[:, [36, 2, 5]])
    with pytest.raises(ValueError, match=f"q4_linear: x has {padded} features, weight expects {in_features}"):
        q4.q4_linear(torch.zeros(2, padded), weight)


def test_quantize_q4_search_beats_min_max():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 1024, generator=g) * 0.02
    weight[:, ::97] *= 10.0
    errors = {}
    for steps in (0, 20):
        quantized = q4.quantize_q4(weight, search_steps=steps)
        errors[steps] = (quantized.dequantize() - weight).pow(2).mean().sqrt().item()
    assert errors[20] < 0.95 * errors[0]
    assert errors[20] < 0.1 * weight.pow(2).mean().sqrt().item()


@pytest.mark.skipif(ops._load() is None, reason="the compiled kernels are not built on this platform")
def test_compiled_scale_search_agrees_with_the_torch_one(monkeypatch):
    g = torch.Generator().manual_seed(3)
    x = torch.distributions.StudentT(4.0).sample((8192, 32)) * 0.02
    x[:: 97] *= 40.0
    x[1] = 0.0  # flat
    x[2] = -0.5  # constant negative: only the min
    x[3] = 0.25  # constant positive
    x[4, 7] = 1.0  # a spike
    for steps in (0, 20):
        compiled = torch.stack(q4._fit_sub_blocks(x, steps), dim=1)  # [B, 2]
        reference = torch.stack(q4._fit_sub_blocks_torch(x, steps), dim=1)
        close = torch.isclose(compiled, reference, rtol=1e-4, atol=1e-9).all(dim=1)
        # sums in another order can tip a near tie between two grids: a few fits differ, each as good
        assert close[:5].all() and close.float().mean() > (0.999 if steps == 0 else 0.98), (steps, close.float().mean())
    weight = torch.randn(64, 768, generator=g) * 0.02
    errors = [(q4.quantize_q4(weight).dequantize() - weight).pow(2).mean().sqrt().item()]
    monkeypatch.setattr(q4.ops, "_load", lambda: None)  # the torch fallback
    errors.append((q4.quantize_q4(weight).dequantize() - weight).pow(2).mean().sqrt().item())
    assert abs(errors[0] - errors[1]) < 1e-3 * errors[1]


def test_quantize_q4_edge_rows():
    weight = torch.zeros(4, 256)
    weight[1] = -0.5  # constant negative: only the min
    weight[2] = 0.25  # constant positive
    weight[3, 7] = 1.0  # one spike
    restored = q4.quantize_q4(weight).dequantize()
    assert torch.equal(restored[0], torch.zeros(256))
    assert torch.allclose(restored[1:], weight[1:], atol=2e-3)


# --------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("in_features", WIDTHS)
@pytest.mark.parametrize("out_features", [1, 3, 4, 5, 22, 37])
def test_vector_path_matches_scalar(in_features, out_features, vector_path):
    weight = _random_weight(out_features, in_features, seed=in_features + out_features)
    x, bias = _activations(20, in_features, seed=1)
    bias = bias[:out_features]
    row_counts = range(1, 21) if out_features in (5, 37) else (1, 2, 3, 4, 7, 13, 20)
    for with_bias in (None, bias):
        vector = [q4.q4_linear(x[:m], weight, with_bias) for m in row_counts]
        with ops.forced_isa("scalar"):
            scalar = [q4.q4_linear(x[:m], weight, with_bias) for m in row_counts]
        for m, y, y_scalar in zip(row_counts, vector, scalar):
            assert torch.equal(y, y_scalar), f"{vector_path}, M={m}, bias={with_bias is not None}"


@pytest.mark.parametrize("in_features", [100, 896, 4864 + 32])
def test_vector_path_matches_scalar_at_padded_widths(in_features, vector_path):
    """Widths that are no multiple of 256: the kernel quantizes the activations as zero past in_features."""
    g = torch.Generator().manual_seed(in_features)
    weight = q4.quantize_q4(torch.randn(37, in_features, generator=g) * 0.05, search_steps=0)
    x, bias = _activations(13, in_features, seed=4)
    vector = [q4.q4_linear(x[:m], weight, bias[:37]) for m in (1, 2, 5, 13)]
    with ops.forced_isa("scalar"):
        scalar = [q4.q4_linear(x[:m], weight, bias[:37]) for m in (1, 2, 5, 13)]
    for y, y_scalar in zip(vector, scalar):
        assert torch.equal(y, y_scalar), vector_path


def test_vector_path_matches_scalar_on_wide_outputs(vector_path):
    """Many tiles, handed out in chunks to 2 threads, and a partial tile of plain rows."""
    weight = _random_weight(1027, 512, seed=5)
    x, _ = _activations(9, 512, seed=2)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        vector = q4.q4_linear(x, weight)
        with ops.forced_isa("scalar"):
            scalar = q4.q4_linear(x, weight)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(vector, scalar)


# run in a process of its own: the avx2 path reads SPECDEC_AVX_VNNI once per process
_PLAIN_AVX2_SCRIPT = textwrap.dedent("""
    import torch
    from specdec.kernels import ops, q4

    assert not ops._load().avx_vnni(), "SPECDEC_AVX_VNNI=0 left AVX-VNNI on"
    g = torch.Generator().manual_seed(0)
    for in_features in (256, 768, 1536, 8960):
        for out_features in (5, 37):
            s = in_features // 256
            weight = q4.Q4Weight.from_blocks(q4.Q4Blocks(
                torch.randint(0, 16, (out_features, in_features), generator=g, dtype=torch.uint8),
                torch.randint(0, 64, (out_features, 8 * s), generator=g, dtype=torch.uint8),
                torch.randint(0, 64, (out_features, 8 * s), generator=g, dtype=torch.uint8),
                (torch.rand(out_features, s, generator=g) * 2e-3).to(torch.float16),
                (torch.rand(out_features, s, generator=g) * 2e-3).to(torch.float16)))
            x = torch.randn(13, in_features, generator=g)
            x[::5, :: in_features // 5] *= 30.0
            bias = torch.randn(out_features, generator=g)
            for m in (1, 2, 3, 4, 5, 8, 13):
                with ops.forced_isa("avx2"):
                    y = q4.q4_linear(x[:m], weight, bias)
                with ops.forced_isa("scalar"):
                    y_scalar = q4.q4_linear(x[:m], weight, bias)
                assert torch.equal(y, y_scalar), (in_features, out_features, m)
    print("ok")
""")


def test_plain_avx2_code_matches_scalar():
    """The avx2 path's code without AVX-VNNI (vpmaddubsw, vpmaddwd), which a CPU with AVX-VNNI runs only when
    SPECDEC_AVX_VNNI=0: bitwise the scalar path's results too."""
    if "avx2" not in ops.supported_isas():
        pytest.skip("this CPU cannot run the avx2 kernels")
    env = {**os.environ, "SPECDEC_AVX_VNNI": "0"}
    done = subprocess.run([sys.executable, "-c", _PLAIN_AVX2_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.parametrize("in_features,out_features", [(256, 37), (768, 130), (2048, 64), (8960, 22)])
def test_row_invariance(in_features, out_features, threads):
    weight = _random_weight(out_features, in_features, seed=7)
    x, bias = _activations(40, in_features, seed=3)
    bias = bias[:out_features]
    full = q4.q4_linear(x, weight, bias)
    assert full.shape == (40, out_features) and full.dtype == torch.float32
    alone = torch.cat([q4.q4_linear(x[r : r + 1], weight, bias) for r in range(20)])
    assert torch.equal(alone, full[:20])
    for m in range(2, 21):
        assert torch.equal(q4.q4_linear(x[:m], weight, bias), full[:m]), f"M={m}"
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(1))
    assert torch.equal(q4.q4_linear(x[perm], weight, bias), full[perm])


@pytest.mark.parametrize("in_features,out_features", [(512, 301), (8960, 22)])
def test_thread_count_invariance(in_features, out_features):
    weight = _random_weight(out_features, in_features, seed=9)
    x, bias = _activations(33, in_features, seed=4)
    old = torch.get_num_threads()
    try:
        outputs = []
        for count in (1, 2):
            torch.set_num_threads(count)
            outputs.append(q4.q4_linear(x, weight, bias[:out_features]))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(outputs[0], outputs[1])


def test_rows_restriction_is_bitwise():
    weight = _random_weight(37, 768, seed=11)
    x, _ = _activations(5, 768, seed=5)
    ids = [36, 0, 5, 4, 17, 18, 19, 20, 2]
    assert torch.equal(q4.q4_linear(x, weight.rows(ids)), q4.q4_linear(x, weight)[:, ids])
    assert torch.equal(weight.rows(ids).dequantize(), weight.dequantize()[ids])


@pytest.mark.parametrize("in_features", [256, 1536, 8960])
def test_matches_the_dequantized_product(in_features):
    g = torch.Generator().manual_seed(in_features)
    weight = q4.quantize_q4(torch.randn(48, in_features, generator=g) * 0.05)
    x = torch.randn(6, in_features, generator=g)
    bias = torch.randn(48, generator=g)
    reference = x @ weight.dequantize().T + bias
    y = q4.q4_linear(x, weight, bias)
    assert (y - reference).norm() / reference.norm() < 1e-2
    # the torch fallback (no activation quantization) agrees as closely
    fallback = q4.q4_linear_torch(x, weight, bias)
    assert (fallback - reference).norm() / reference.norm() < 1e-5
    assert (y - fallback).norm() / fallback.norm() < 1e-2


def test_zero_rows_and_leading_dimensions():
    weight = _random_weight(6, 512, seed=13)
    assert q4.q4_linear(torch.zeros(0, 512), weight).shape == (0, 6)
    assert torch.equal(q4.q4_linear(torch.zeros(2, 512), weight), torch.zeros(2, 6))
    x, _ = _activations(6, 512, seed=6)
    assert torch.equal(q4.q4_linear(x.view(2, 3, 512), weight).view(6, 6), q4.q4_linear(x, weight))
