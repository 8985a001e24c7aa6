"""Row-wise RMS norm and the fused QK-norm + RoPE kernel: close to the torch expressions, row invariant."""

import pytest
import torch

from specdec.kernels import ops
from specdec.models.layers import RotaryTable

pytestmark = pytest.mark.skipif(not ops.kernels_available(), reason="compiled kernels are built by setup")

SHAPES = [(4, 1, 256, True), (12, 2, 128, False), (9, 3, 64, False), (3, 1, 40, True)]  # H, Hkv, D, QK-norm


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dim", [640, 1536, 576, 40])
def test_rms_norm_matches_torch_and_is_row_invariant(dim):
    generator = _generator(dim)
    hidden = torch.randn(9, dim, generator=generator) * 3.0  # [rows, dim]
    weight = torch.randn(dim, generator=generator)
    out = ops.rms_norm(hidden, weight, 1e-6)
    torch.testing.assert_close(out, ops._rms_norm_torch(hidden, weight, 1e-6), rtol=1e-5, atol=1e-5)
    for row in range(hidden.shape[0]):
        assert torch.equal(ops.rms_norm(hidden[row : row + 1], weight, 1e-6), out[row : row + 1])
    assert torch.equal(ops.rms_norm(hidden.view(3, 3, dim), weight, 1e-6), out.view(3, 3, dim))


@pytest.mark.parametrize("dim", [640, 576, 40, 7, 256])
def test_rms_norm_simd_and_scalar_paths_give_the_same_bits(dim, vector_path):
    generator = _generator(dim + 1)
    hidden = torch.randn(5, dim, generator=generator) * 30.0  # [rows, dim]
    weight = torch.randn(dim, generator=generator)
    simd = ops.rms_norm(hidden, weight, 1e-6)
    qkv, positions, cos, sin = _qkv_case(4, 1, 40 if dim == 40 else 64, seed=dim)
    shape = ops.QKNormRope(4, 1, qkv.shape[1] // 6, 1e-6)
    norms = (torch.rand(shape.head_dim) + 0.5, torch.rand(shape.head_dim) + 0.5)
    simd_qk = ops.qk_norm_rope(qkv, shape, *norms, cos, sin, positions)
    with ops.forced_isa("scalar"):
        assert torch.equal(ops.rms_norm(hidden, weight, 1e-6), simd)
        scalar_qk = ops.qk_norm_rope(qkv, shape, *norms, cos, sin, positions)
        assert all(torch.equal(a, b) for a, b in zip(scalar_qk, simd_qk))


@pytest.mark.parametrize("dim", [32, 64, 128, 256, 40])
def test_rope_simd_and_scalar_paths_give_the_same_bits(dim, vector_path):
    qkv, positions, cos, sin = _qkv_case(3, 1, dim, seed=dim + 7)
    qkv = qkv * 1e3  # [tokens, (H + 2 Hkv) * D]
    qkv[0, :dim] = 0.0  # signed zeros through the negated half
    shape = ops.QKNormRope(3, 1, dim, 1e-6)
    simd_qk = ops.qk_norm_rope(qkv, shape, None, None, cos, sin, positions)
    with ops.forced_isa("scalar"):
        scalar_qk = ops.qk_norm_rope(qkv, shape, None, None, cos, sin, positions)
    assert all(torch.equal(a, b) for a, b in zip(scalar_qk, simd_qk))
    assert torch.equal(simd_qk[0].signbit(), scalar_qk[0].signbit())


def test_rms_norm_rejects_a_weight_of_the_wrong_size():
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.randn(2, 64), torch.randn(32), 1e-6)


def _qkv_case(heads, kv_heads, dim, tokens=7, seed=0):
    generator = _generator(seed + heads * 10 + dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator)  # [tokens, (H + 2 Hkv) * D]
    positions = torch.tensor([0, 1, 2, 57, 58, 300, 1000][:tokens])
    cos, sin = RotaryTable(dim, 10000.0, torch.device("cpu")).tables(int(positions.max()))
    return qkv, positions, cos, sin


@pytest.mark.parametrize("heads,kv_heads,dim,qk_norm", SHAPES)
def test_qk_norm_rope_matches_the_torch_path(heads, kv_heads, dim, qk_norm):
    qkv, positions, cos, sin = _qkv_case(heads, kv_heads, dim)
    shape = ops.QKNormRope(heads, kv_heads, dim, 1e-6)
    norms = (torch.rand(dim) + 0.5, torch.rand(dim) + 0.5) if qk_norm else (None, None)
    query, key = ops.qk_norm_rope(qkv, shape, *norms, cos, sin, positions)
    ref_query, ref_key = ops._qk_norm_rope_torch(qkv, shape, *norms, cos, sin, positions)
    assert query.shape == (len(positions), heads, dim) and key.shape == (len(positions), kv_heads, dim)
    if qk_norm:  # the norm's reduction order differs from torch's
        torch.testing.assert_close(query, ref_query, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(key, ref_key, rtol=1e-5, atol=1e-5)
    else:  # RoPE alone is the same elementwise expression as torch's: bitwise equal
        assert torch.equal(query, ref_query) and torch.equal(key, ref_key)


@pytest.mark.parametrize("heads,kv_heads,dim,qk_norm", SHAPES)
def test_qk_norm_rope_is_row_invariant(heads, kv_heads, dim, qk_norm):
    qkv, positions, cos, sin = _qkv_case(heads, kv_heads, dim, seed=1)
    shape = ops.QKNormRope(heads, kv_heads, dim, 1e-6)
    norms = (torch.rand(dim) + 0.5, torch.rand(dim) + 0.5) if qk_norm else (None, None)
    query, key = ops.qk_norm_rope(qkv, shape, *norms, cos, sin, positions)
    for row in range(len(positions)):
        alone_query, alone_key = ops.qk_norm_rope(qkv[row : row + 1], shape, *norms, cos, sin, positions[row : row + 1])
        assert torch.equal(alone_query[0], query[row]) and torch.equal(alone_key[0], key[row])


def test_qk_norm_rope_rejects_positions_past_the_table():
    qkv, positions, cos, sin = _qkv_case(4, 1, 64)
    with pytest.raises(RuntimeError, match="position out of table"):
        ops.qk_norm_rope(qkv, ops.QKNormRope(4, 1, 64, 1e-6), None, None, cos[:10], sin[:10], positions)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("inter", [2048, 37])
def test_gated_activation_matches_torch_and_scalar_path(activation, inter, vector_path):
    gate_up = torch.randn(5, 2 * inter, generator=_generator(inter)) * 4.0  # [rows, 2 * inter]
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -1e-30])  # saturation and zero
    out = ops.gated_activation(gate_up, activation)
    torch.testing.assert_close(out, ops._gated_activation_torch(gate_up, activation), rtol=2e-6, atol=2e-6)
    with ops.forced_isa("scalar"):
        assert torch.equal(ops.gated_activation(gate_up, activation), out)  # scalar = the vector path, lane by lane
    for row in range(gate_up.shape[0]):
        assert torch.equal(ops.gated_activation(gate_up[row : row + 1], activation), out[row : row + 1])


def test_gated_activation_rejects_an_unknown_activation():
    with pytest.raises(RuntimeError, match="activation must be"):
        ops.gated_activation(torch.randn(2, 8), "relu")


def test_autograd_inputs_take_the_differentiable_torch_path():
    hidden = torch.randn(3, 64, requires_grad=True)
    weight = torch.rand(64) + 0.5
    ops.rms_norm(hidden, weight, 1e-6).sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0
    gate_up = torch.randn(3, 64, requires_grad=True)
    ops.gated_activation(gate_up, "silu").sum().backward()
    assert gate_up.grad is not None and gate_up.grad.abs().sum() > 0
    qkv, positions, cos, sin = _qkv_case(4, 1, 64)
    qkv.requires_grad_(True)
    query, key = ops.qk_norm_rope(qkv, ops.QKNormRope(4, 1, 64, 1e-6), None, None, cos, sin, positions)
    (query.sum() + key.sum()).backward()
    assert qkv.grad is not None and qkv.grad[:, : 5 * 64].abs().sum() > 0


def test_prefill_sized_calls_split_rows_over_threads_without_changing_them():
    """Above 2^16 values (a prefill) the row-wise kernels run their rows on the intra-op threads; every row must
    equal the row computed alone, as in a decode step."""
    assert ops.parallel_threads(4) == min(4, torch.get_num_threads())
    generator = _generator(7)
    hidden = torch.randn(160, 640, generator=generator)  # [rows, dim]: 102 400 values
    weight = torch.randn(640, generator=generator)
    out = ops.rms_norm(hidden, weight, 1e-6)
    for row in (0, 79, 80, 159):
        assert torch.equal(ops.rms_norm(hidden[row : row + 1], weight, 1e-6), out[row : row + 1])
    qkv = torch.randn(120, 6 * 256, generator=generator)  # [tokens, (H + 2 Hkv) * D]: 120 x 5 x 256 roped values
    positions = torch.arange(120) * 3
    cos, sin = RotaryTable(256, 10000.0, torch.device("cpu")).tables(int(positions.max()))
    shape = ops.QKNormRope(4, 1, 256, 1e-6)
    norms = (torch.rand(256, generator=generator) + 0.5, torch.rand(256, generator=generator) + 0.5)
    query, key = ops.qk_norm_rope(qkv, shape, *norms, cos, sin, positions)
    for row in (0, 59, 60, 119):
        alone_query, alone_key = ops.qk_norm_rope(qkv[row : row + 1], shape, *norms, cos, sin, positions[row : row + 1])
        assert torch.equal(alone_query[0], query[row]) and torch.equal(alone_key[0], key[row])


def test_kernel_build_id_names_the_loaded_build_not_the_source_on_disk(monkeypatch):
    loaded = ops.kernel_build_id()
    monkeypatch.setattr(ops, "_build_dir", lambda: ("/elsewhere", "0123456789abcdef"))  # the source was edited
    assert ops.kernel_build_id() == loaded
