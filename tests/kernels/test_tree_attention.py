"""Tree attention (a key range followed by extra keys per row) against chains computed path by path."""

import math

import pytest
import torch

from specdec.kernels import ops

CONFIGS = [(4, 1, 256), (12, 2, 128), (9, 3, 64), (4, 2, 24)]  # (Hq, Hkv, D); D = 24 takes the scalar path
PREFIX = 37  # committed positions 0 .. 36; tree nodes at scratch positions 37 ..
PARENTS = [-1, 0, 1, -1, 3, 0, 5, 6, 2]  # a tree of 9 nodes: branches 0-1-2-8, 3-4, 0-5-6-7


def _path(node):
    nodes = []
    while node >= 0:
        nodes.append(node)
        node = PARENTS[node]
    return nodes[::-1]


def _tree_case(hq, hkv, d, window, seed=0):
    """Rows = tree nodes; each attends the prefix (within the window) then its path's scratch positions."""
    g = torch.Generator().manual_seed(seed + hq + d)
    length = PREFIX + len(PARENTS) + 4
    kc = torch.randn(2, hkv, length, d, generator=g)
    vc = torch.randn(2, hkv, length, d, generator=g)
    q = torch.randn(len(PARENTS), hq, d, generator=g) * 2.0
    starts, ends, extra = [], [], []
    for node in range(len(PARENTS)):
        path = _path(node)
        logical_end = PREFIX + len(path)
        window_start = max(0, logical_end - window) if window else 0
        starts.append(min(window_start, PREFIX))
        ends.append(PREFIX)
        keys = [PREFIX + n for n in path][max(0, window_start - PREFIX):]
        extra.append(keys + [-1] * (len(PARENTS) - len(keys)))
    as32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    return q, kc, vc, as32([1] * len(PARENTS)), as32(starts), as32(ends), 1.0 / math.sqrt(d), as32(extra)


def _chain_reference(q, kc, vc, slots, window, scale):
    """Each node computed alone by the contiguous kernel on a cache holding its path in place."""
    outs = []
    for node in range(len(PARENTS)):
        path = _path(node)
        chain_k, chain_v = kc.clone(), vc.clone()
        for depth, n in enumerate(path):
            chain_k[:, :, PREFIX + depth] = kc[:, :, PREFIX + n]
            chain_v[:, :, PREFIX + depth] = vc[:, :, PREFIX + n]
        end = PREFIX + len(path)
        start = max(0, end - window) if window else 0
        row = slice(node, node + 1)
        as32 = lambda value: torch.tensor([value], dtype=torch.int32)  # noqa: E731
        outs.append(ops.attention(q[row], chain_k, chain_v, slots[row], as32(start), as32(end), scale))
    return torch.cat(outs)


@pytest.fixture(params=ops.KERNEL_ISAS)
def isa(request):
    if request.param not in ops.supported_isas():
        pytest.skip(f"this CPU cannot run the {request.param} kernels")
    with ops.forced_isa(request.param):
        yield request.param


@pytest.mark.skipif(not ops.kernels_available(), reason="compiled kernels unavailable")
@pytest.mark.parametrize("hq,hkv,d", CONFIGS)
@pytest.mark.parametrize("window", [0, 40, 3])  # 3: the window starts inside the tree path
def test_tree_rows_bitwise_equal_chains(isa, hq, hkv, d, window):
    q, kc, vc, slots, ks, ke, scale, extra = _tree_case(hq, hkv, d, window)
    tree = ops.attention(q, kc, vc, slots, ks, ke, scale, extra)
    assert torch.equal(tree, _chain_reference(q, kc, vc, slots, window, scale))


@pytest.mark.parametrize("hq,hkv,d", CONFIGS)
@pytest.mark.parametrize("window", [0, 3])
def test_torch_fallback_tree_rows_close_to_chains(hq, hkv, d, window):
    q, kc, vc, slots, ks, ke, scale, extra = _tree_case(hq, hkv, d, window)
    tree = ops._attention_torch(q, kc, vc, slots, ks, ke, scale, extra)
    torch.testing.assert_close(tree, _chain_reference(q, kc, vc, slots, window, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not ops.kernels_available(), reason="compiled kernels unavailable")
def test_tree_rows_mixed_with_range_rows_are_row_invariant():
    q, kc, vc, slots, ks, ke, scale, extra = _tree_case(12, 2, 128, 0)
    no_extra = torch.full_like(extra, -1)
    mixed_extra = torch.cat([extra, no_extra])  # the same rows again as plain prefix-range rows
    mixed = ops.attention(torch.cat([q, q]), kc, vc, torch.cat([slots, slots]), torch.cat([ks, ks]),
                          torch.cat([ke, ke]), scale, mixed_extra)
    assert torch.equal(mixed[: len(PARENTS)], ops.attention(q, kc, vc, slots, ks, ke, scale, extra))
    assert torch.equal(mixed[len(PARENTS):], ops.attention(q, kc, vc, slots, ks, ke, scale))


@pytest.mark.skipif(not ops.kernels_available(), reason="compiled kernels unavailable")
def test_extra_key_out_of_bounds_is_rejected():
    q, kc, vc, slots, ks, ke, scale, extra = _tree_case(4, 1, 256, 0)
    extra[0, 0] = kc.shape[2]
    with pytest.raises(RuntimeError, match="extra key position out of bounds"):
        ops.attention(q, kc, vc, slots, ks, ke, scale, extra)


@pytest.mark.skipif(not ops.kernels_available(), reason="compiled kernels unavailable")
@pytest.mark.parametrize("hq,hkv,d", CONFIGS)
def test_tree_rows_on_an_fp16_cache_equal_chains(isa, hq, hkv, d):
    q, kc, vc, slots, ks, ke, scale, extra = _tree_case(hq, hkv, d, 40)
    kc16, vc16 = kc.half(), vc.half()
    tree = ops.attention(q, kc16, vc16, slots, ks, ke, scale, extra)
    assert torch.equal(tree, _chain_reference(q, kc16.float(), vc16.float(), slots, 40, scale))
