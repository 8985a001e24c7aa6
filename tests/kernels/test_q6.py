"""q6 (GGUF Q6_K blocks, repacked): lossless import of Q6_K bytes, every vector path bitwise equal to the scalar
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

from specdec.kernels import ops, q6

# in = 256 n: one super-block, a few, Qwen-like widths (1536, 4864 = 19 super-blocks, 8960 = 35)
WIDTHS = (256, 512, 768, 1536, 4864, 8960)


def _random_q6k_bytes(out_features: int, in_features: int, seed: int) -> np.ndarray:
    """Valid random Q6_K super-blocks [out, in/256 * 210]: any quant and scale bytes, finite fp16 d (normal and
    subnormal, some zero)."""
    rng = np.random.default_rng(seed)
    count = out_features * in_features // 256
    blocks = rng.integers(0, 256, size=(count, 210), dtype=np.uint8)
    d = (rng.standard_normal(count) * 1e-3).astype(np.float16)
    d[::7] = np.float16(3e-7)  # subnormal
    d[::13] = 0.0
    blocks[:, 208:210] = d.view(np.uint8).reshape(count, 2)
    return blocks.reshape(out_features, -1)


def _random_weight(out_features: int, in_features: int, seed: int) -> q6.Q6Weight:
    """A random q6 weight with every field at its full range (quants 0..63, int8 scales -128..127)."""
    g = torch.Generator().manual_seed(seed)
    super_blocks = in_features // 256
    return q6.Q6Weight.from_blocks(q6.Q6Blocks(
        quants=torch.randint(0, 64, (out_features, in_features), generator=g, dtype=torch.uint8),
        sub_scales=torch.randint(-128, 128, (out_features, 16 * super_blocks), generator=g, dtype=torch.int8),
        d=(torch.randn(out_features, super_blocks, generator=g) * 1e-4).to(torch.float16),
    ))


def _activations(rows: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] with outlier columns, a row of large values and an all-zero row; bias."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g)
    x[::5, :: max(1, in_features // 5)] *= 30.0
    if rows > 3:
        x[3] = 0.0
    if rows > 6:
        x[6] *= 1e6
    return x, torch.randn(2048, generator=g)


# --------------------------------------------------------------------------- format


@pytest.mark.parametrize("out_features,in_features", [(1, 256), (5, 512), (9, 768), (4, 2304)])
def test_q6k_bytes_load_losslessly(out_features, in_features):
    raw = _random_q6k_bytes(out_features, in_features, seed=in_features + out_features)
    weight = q6.q6_from_q6k_blocks(raw, out_features, in_features)
    expected = gguf_dequantize(raw, GGMLQuantizationType.Q6_K).reshape(out_features, in_features)
    assert np.array_equal(weight.dequantize().numpy().view(np.uint32), expected.astype(np.float32).view(np.uint32))
    assert weight.bits_per_weight == 210 * 8 / 256


@pytest.mark.parametrize("out_features,in_features", [(1, 256), (7, 1536), (9, 4864)])
def test_packing_round_trips(out_features, in_features):
    weight = _random_weight(out_features, in_features, seed=3)
    again = q6.Q6Weight.from_blocks(weight.blocks())
    assert torch.equal(again.quants, weight.quants) and torch.equal(again.scales, weight.scales)

def test_packed_order_is_the_kernel_order():
    """Byte 4 l + i of a unit's chunk c < 2: vector c's low 4 bits (input 16 l + 4 c + i), vector c + 2's in the
    high nibble; chunk 2: the high 2 bits of vector p in bits 2p..2p+1 (q6_scalar.h)."""
    quants = (torch.arange(512) % 64).to(torch.uint8).view(2, 256)
    quants[1] = 63 - quants[1]
    packed = q6._pack_quants(quants).view(2, 3, 64)
    for row in range(2):
        for lane in range(16):
            for i in range(4):
                b = 4 * lane + i
                value = lambda j: int(quants[row, 16 * lane + 4 * j + i])  # noqa: E731
                assert int(packed[row, 0, b]) == (value(0) & 15) | ((value(2) & 15) << 4)
                assert int(packed[row, 1, b]) == (value(1) & 15) | ((value(3) & 15) << 4)
                assert int(packed[row, 2, b]) == sum((value(p) >> 4) << (2 * p) for p in range(4))
    assert torch.equal(q6._unpack_quants(q6._pack_quants(quants)), quants)


def test_q6_needs_a_multiple_of_256():
    assert not q6.q6_supports(896) and q6.q6_supports(4864)
    with pytest.raises(q6.Q6ShapeError, match="multiple of 256"):
        q6.q6_from_q6k_blocks(np.zeros((2, 210), dtype=np.uint8), 2, 200)
    with pytest.raises(ValueError, match="bytes"):
        q6.q6_from_q6k_blocks(np.zeros((2, 209), dtype=np.uint8), 2, 256)
    blocks = _random_weight(2, 256, seed=1).blocks()
    with pytest.raises(ValueError, match="0..63"):
        q6.Q6Weight.from_blocks(blocks._replace(quants=blocks.quants + 64))


# --------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("in_features", WIDTHS)
@pytest.mark.parametrize("out_features", [1, 3, 4, 5, 22, 37])
def test_vector_path_matches_scalar(in_features, out_features, vector_path):
    weight = _random_weight(out_features, in_features, seed=in_features + out_features)
    x, bias = _activations(20, in_features, seed=1)
    bias = bias[:out_features]
    row_counts = range(1, 21) if out_features in (5, 37) else (1, 2, 3, 4, 7, 13, 20)
    for with_bias in (None, bias):
        vector = [q6.q6_linear(x[:m], weight, with_bias) for m in row_counts]
        with ops.forced_isa("scalar"):
            scalar = [q6.q6_linear(x[:m], weight, with_bias) for m in row_counts]
        for m, y, y_scalar in zip(row_counts, vector, scalar):
            assert torch.equal(y, y_scalar), f"{vector_path}, M={m}, bias={with_bias is not None}"


def test_vector_path_matches_scalar_on_wide_outputs(vector_path):
    """Many tiles, handed out in chunks to 2 threads, and a partial tile of plain rows."""
    weight = _random_weight(1027, 512, seed=5)
    x, _ = _activations(9, 512, seed=2)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        vector = q6.q6_linear(x, weight)
        with ops.forced_isa("scalar"):
            scalar = q6.q6_linear(x, weight)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(vector, scalar)


# run in a process of its own: the avx2 path reads SPECDEC_AVX_VNNI once per process
_PLAIN_AVX2_SCRIPT = textwrap.dedent("""
    import torch
    from specdec.kernels import ops, q6

    assert not ops._load().avx_vnni(), "SPECDEC_AVX_VNNI=0 left AVX-VNNI on"
    g = torch.Generator().manual_seed(0)
    for in_features in (256, 1536, 8960):
        for out_features in (5, 37):
            s = in_features // 256
            weight = q6.Q6Weight.from_blocks(q6.Q6Blocks(
                torch.randint(0, 64, (out_features, in_features), generator=g, dtype=torch.uint8),
                torch.randint(-128, 128, (out_features, 16 * s), generator=g, dtype=torch.int8),
                (torch.randn(out_features, s, generator=g) * 1e-4).to(torch.float16)))
            x = torch.randn(13, in_features, generator=g)
            x[::5, :: in_features // 5] *= 30.0
            bias = torch.randn(out_features, generator=g)
            for m in (1, 2, 3, 4, 5, 8, 13):
                with ops.forced_isa("avx2"):
                    y = q6.q6_linear(x[:m], weight, bias)
                with ops.forced_isa("scalar"):
                    y_scalar = q6.q6_linear(x[:m], weight, bias)
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


@pytest.mark.parametrize("in_features,out_features", [(256, 37), (1536, 130), (8960, 22)])
def test_row_invariance(in_features, out_features, threads):
    weight = _random_weight(out_features, in_features, seed=7)
    x, bias = _activations(40, in_features, seed=3)
    bias = bias[:out_features]
    full = q6.q6_linear(x, weight, bias)
    assert full.shape == (40, out_features) and full.dtype == torch.float32
    alone = torch.cat([q6.q6_linear(x[r : r + 1], weight, bias) for r in range(20)])
    assert torch.equal(alone, full[:20])
    for m in range(2, 21):
        assert torch.equal(q6.q6_linear(x[:m], weight, bias), full[:m]), f"M={m}"
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(1))
    assert torch.equal(q6.q6_linear(x[perm], weight, bias), full[perm])


@pytest.mark.parametrize("in_features,out_features", [(512, 301), (8960, 22)])
def test_thread_count_invariance(in_features, out_features):
    weight = _random_weight(out_features, in_features, seed=9)
    x, bias = _activations(33, in_features, seed=4)
    old = torch.get_num_threads()
    try:
        outputs = []
        for count in (1, 2):
            torch.set_num_threads(count)
            outputs.append(q6.q6_linear(x, weight, bias[:out_features]))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(outputs[0], outputs[1])


def test_rows_restriction_is_bitwise():
    weight = _random_weight(37, 768, seed=11)
    x, _ = _activations(5, 768, seed=5)
    ids = [36, 0, 5, 4, 17, 18, 19, 20, 2]
    assert torch.equal(q6.q6_linear(x, weight.rows(ids)), q6.q6_linear(x, weight)[:, ids])
    assert torch.equal(weight.rows(ids).dequantize(), weight.dequantize()[ids])


@pytest.mark.parametrize("in_features", [256, 1536, 8960])
def test_matches_the_dequantized_product(in_features):
    weight = _random_weight(48, in_features, seed=in_features)
    g = torch.Generator().manual_seed(in_features)
    x = torch.randn(6, in_features, generator=g)
    bias = torch.randn(48, generator=g)
    reference = x.double() @ weight.dequantize().double().T + bias.double()
    y = q6.q6_linear(x, weight, bias)
    # the error of int8 activations (per block of 32): a few tenths of a percent
    assert ((y.double() - reference).norm() / reference.norm()).item() < 1e-2
    # the torch fallback (no activation quantization) agrees as closely as fp32 allows
    fallback = q6.q6_linear_torch(x, weight, bias)
    assert ((fallback.double() - reference).norm() / reference.norm()).item() < 1e-5


def test_zero_rows_and_leading_dimensions():
    weight = _random_weight(6, 512, seed=13)
    assert q6.q6_linear(torch.zeros(0, 512), weight).shape == (0, 6)
    assert torch.equal(q6.q6_linear(torch.zeros(2, 512), weight), torch.zeros(2, 6))
    x, _ = _activations(6, 512, seed=6)
    assert torch.equal(q6.q6_linear(x.view(2, 3, 512), weight).view(6, 6), q6.q6_linear(x, weight))
    with pytest.raises(ValueError, match="features"):
        q6.q6_linear(torch.zeros(2, 256), weight)
