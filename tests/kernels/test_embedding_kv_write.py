"""embedding_rows and kv_write: the kernels give exactly what the torch expressions they replace give."""
import pytest
import torch

from specdec.kernels import QuantizedWeight, ops


@pytest.fixture(params=ops.KERNEL_ISAS)
def scalar(request):
    """Each kernel path this CPU runs (every one must give the torch expression's bits)."""
    if request.param not in ops.supported_isas():
        pytest.skip(f"this CPU cannot run the {request.param} kernels")
    with ops.forced_isa(request.param):
        yield request.param


@pytest.mark.parametrize("layout", ops.Q8_LAYOUTS)
@pytest.mark.parametrize("rows,features", [(9, 640), (7, 576), (5, 1536), (4, 40), (3, 2048), (37, 96)])
def test_embedding_equals_the_dequantized_rows(rows, features, layout):
    generator = torch.Generator().manual_seed(rows * features)
    weight = QuantizedWeight.from_int8(
        torch.randint(-127, 128, (rows, features), generator=generator, dtype=torch.int8),
        torch.rand(rows, -(-features // 32), generator=generator) * 0.1,
        layout,
    )
    ids = torch.tensor([rows - 1, 0, 3 % rows, rows - 1, 1 % rows])  # tiled rows and the plain last N % 4 rows
    expected = weight.int8(ids).to(torch.float32) * weight._scales(ids)  # the torch expression
    got = ops.embedding(ids, weight)
    assert got.shape == (5, features) and torch.equal(got, expected)
    assert torch.equal(ops.embedding(ids.view(1, 5), weight), expected.view(1, 5, features))
    assert torch.equal(ops.embedding(torch.arange(rows), weight), weight.dequantize())


@pytest.mark.parametrize("layout", ops.Q8_LAYOUTS)
def test_embedding_rejects_token_ids_outside_the_table(layout):
    weight = QuantizedWeight.from_int8(torch.zeros(6, 64, dtype=torch.int8), torch.ones(6, 2), layout)
    with pytest.raises(RuntimeError, match=r"token id 6 out of range \[0, 6\)"):
        ops.embedding(torch.tensor([1, 6]), weight)
    with pytest.raises(RuntimeError, match="token id -1 out of range"):
        ops.embedding(torch.tensor([-1]), weight)


def _torch_write(key_cache, value_cache, slots, positions, keys, values):
    key_cache[slots, :, positions] = keys.to(key_cache.dtype)
    value_cache[slots, :, positions] = values.to(value_cache.dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("rows,heads,dim", [(1, 1, 256), (8, 3, 64), (700, 2, 128), (5, 2, 24)])
def test_kv_write_equals_indexed_assignment(scalar, dtype, rows, heads, dim):
    generator = torch.Generator().manual_seed(rows + heads + dim)
    shape = (3, heads, 1024, dim)
    caches = [torch.randn(shape, generator=generator).to(dtype) for _ in range(2)]
    expected = [cache.clone() for cache in caches]
    slots = torch.randint(0, 3, (rows,), generator=generator)
    positions = torch.randperm(1024, generator=generator)[:rows]
    keys = torch.randn(rows, heads, dim, generator=generator) * 100
    values = torch.randn(rows, heads, dim, generator=generator)
    # values fp16 rounds in every way: halfway cases (even and odd), subnormals, overflow to inf, signed zero
    special = torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11, 2 ** -20, -2 ** -24, 2 ** -25, 65504.0, 65520.0, 1e6,
                            -0.0, float("inf"), -float("inf"), 3e-5])
    keys.view(-1)[: special.numel()] = special[: keys.numel()]
    ops.kv_write(caches[0], caches[1], slots, positions, keys, values)
    _torch_write(expected[0], expected[1], slots, positions, keys, values)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


@pytest.mark.parametrize("rows", [1, 8])
def test_kv_write_reads_strided_rows_in_place(scalar, rows):
    """The transformer passes its values as a column slice of the fused qkv rows (row stride > heads * dim)."""
    generator = torch.Generator().manual_seed(rows)
    caches = [torch.zeros(2, 3, 64, 16, dtype=torch.float16) for _ in range(2)]
    expected = [cache.clone() for cache in caches]
    qkv = torch.randn(rows, 9 * 16, generator=generator)
    keys, values = qkv[:, 96:].reshape(rows, 3, 16).clone(), qkv[:, 48:96].reshape(rows, 3, 16)
    assert not values.is_contiguous() or rows == 1
    slots, positions = torch.zeros(rows, dtype=torch.long), torch.arange(5, 5 + rows)
    ops.kv_write(caches[0], caches[1], slots, positions, keys, values)
    _torch_write(expected[0], expected[1], slots, positions, keys, values)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_kv_write_rejects_positions_outside_the_cache_and_bad_shapes():
    caches = [torch.zeros(2, 1, 16, 8, dtype=torch.float16) for _ in range(2)]
    keys = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match=r"\(slot, position\) \(0, 16\) outside the cache's \[2, 16\)"):
        ops.kv_write(*caches, torch.tensor([0]), torch.tensor([16]), keys, keys)
    with pytest.raises(RuntimeError, match=r"\(2, 0\) outside"):
        ops.kv_write(*caches, torch.tensor([2]), torch.tensor([0]), keys, keys)
    with pytest.raises(RuntimeError, match=r"keys and values must be \[1, 1, 8\]"):
        ops.kv_write(*caches, torch.tensor([0]), torch.tensor([0]), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    with pytest.raises(RuntimeError, match="both fp32 or both fp16"):
        ops.kv_write(caches[0], caches[1].float(), torch.tensor([0]), torch.tensor([0]), keys, keys)
