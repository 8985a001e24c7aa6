"""Range attention: correctness vs a plain reference, bitwise row / thread invariance."""

import math

import pytest
import torch

from specdec.kernels import ops


CONFIGS = [(4, 1, 256), (12, 2, 128), (9, 3, 64)]  # (Hq, Hkv, D): Gemma 3, Qwen2.5-1.5B, SmolLM2


def _reference(q, kc, vc, slots, ks, ke, scale):
    m, hq, d = q.shape
    g = hq // kc.shape[1]
    out = torch.zeros(m, hq, d, dtype=torch.float64)
    for i in range(m):
        a, b = int(ks[i]), int(ke[i])
        if b <= a:
            continue
        for h in range(hq):
            k = kc[int(slots[i]), h // g, a:b].double()
            v = vc[int(slots[i]), h // g, a:b].double()
            p = torch.softmax((k @ q[i, h].double()) * scale, dim=0)
            out[i, h] = p @ v
    return out.float()


def _case(hq, hkv, d, s=3, length=300, seed=0):
    g = torch.Generator().manual_seed(seed + hq * 100 + d)
    kc = torch.randn(s, hkv, length, d, generator=g)
    vc = torch.randn(s, hkv, length, d, generator=g)
    # rows: prefill-like causal block on slot 0, decode rows on others, sliding windows, length 1
    rows = [(0, 0, 1), (0, 0, 2), (0, 0, 17), (0, 5, 40), (1, 0, length), (2, 250, 251), (2, 3, 200), (1, 100, 164)]
    slots = torch.tensor([r[0] for r in rows], dtype=torch.int32)
    ks = torch.tensor([r[1] for r in rows], dtype=torch.int32)
    ke = torch.tensor([r[2] for r in rows], dtype=torch.int32)
    q = torch.randn(len(rows), hq, d, generator=g) * 2.0
    return q, kc, vc, slots, ks, ke, 1.0 / math.sqrt(d)


@pytest.mark.parametrize("hq,hkv,d", CONFIGS)
def test_matches_reference(hq, hkv, d):
    args = _case(hq, hkv, d)
    out = ops.attention(*args)
    assert out.shape == args[0].shape and out.dtype == torch.float32
    torch.testing.assert_close(out, _reference(*args), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ops._attention_torch(*args), _reference(*args), atol=1e-5, rtol=1e-5)


def test_long_range_and_peaked_scores():
    q, kc, vc, slots, ks, ke, scale = _case(4, 1, 256, s=3, length=3000)
    ks[4], ke[4] = 0, 3000
    q = q * 10.0  # large logits: exercises max-subtraction / exp underflow
    out = ops.attention(q, kc, vc, slots, ks, ke, scale)
    torch.testing.assert_close(out, _reference(q, kc, vc, slots, ks, ke, scale), atol=1e-5, rtol=1e-5)


def test_empty_range_gives_zeros():
    q, kc, vc, slots, ks, ke, scale = _case(9, 3, 64)
    ke[2] = ks[2]
    out = ops.attention(q, kc, vc, slots, ks, ke, scale)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


@pytest.mark.parametrize("hq,hkv,d", CONFIGS)
@pytest.mark.parametrize("threads", [1, 2])
def test_row_invariance(hq, hkv, d, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, kc, vc, slots, ks, ke, scale = _case(hq, hkv, d)
        full = ops.attention(q, kc, vc, slots, ks, ke, scale)
        for i in range(q.shape[0]):
            sl = slice(i, i + 1)
            alone = ops.attention(q[sl], kc, vc, slots[sl], ks[sl], ke[sl], scale)
            assert torch.equal(alone, full[sl]), f"row {i}"
        perm = torch.tensor([5, 2, 7, 0, 3, 1, 6, 4])
        assert torch.equal(ops.attention(q[perm], kc, vc, slots[perm], ks[perm], ke[perm], scale), full[perm])
        # same rows batched with unrelated rows of other slots
        q2 = torch.cat([torch.randn(3, hq, d), q[2:5]])
        s2 = torch.cat([torch.tensor([2, 1, 2], dtype=torch.int32), slots[2:5]])
        a2 = torch.cat([torch.tensor([0, 7, 9], dtype=torch.int32), ks[2:5]])
        e2 = torch.cat([torch.tensor([300, 8, 123], dtype=torch.int32), ke[2:5]])
        assert torch.equal(ops.attention(q2, kc, vc, s2, a2, e2, scale)[3:], full[2:5])
    finally:
        torch.set_num_threads(old)


def test_thread_count_invariance():
    args = _case(12, 2, 128)
    old = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2):
            torch.set_num_threads(t)
            outs.append(ops.attention(*args))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(outs[0], outs[1])


def test_scalar_path_matches_simd(vector_path):
    args = _case(9, 3, 64)
    out = ops.attention(*args)
    with ops.forced_isa("scalar"):
        outs = ops.attention(*args)
    assert torch.equal(out, outs)


def _verify_block(hq, hkv, d, m=9, ctx=203, window=None, seed=3):
    """k+1 verify rows of one sequence (slot 1) next to decode rows of other slots."""
    g = torch.Generator().manual_seed(seed)
    length = ctx + m + 8
    kc = torch.randn(3, hkv, length, d, generator=g)
    vc = torch.randn(3, hkv, length, d, generator=g)
    ends = [ctx + 1 + i for i in range(m)]
    starts = [0 if window is None else max(0, e - window) for e in ends]
    rows = [(1, s, e) for s, e in zip(starts, ends)] + [(0, 0, 50), (2, 7, 130), (1, 100, 101)]
    slots = torch.tensor([r[0] for r in rows], dtype=torch.int32)
    ks = torch.tensor([r[1] for r in rows], dtype=torch.int32)
    ke = torch.tensor([r[2] for r in rows], dtype=torch.int32)
    q = torch.randn(len(rows), hq, d, generator=g) * 2.0
    return q, kc, vc, slots, ks, ke, 1.0 / math.sqrt(d)


@pytest.mark.parametrize("hq,hkv,d", CONFIGS)
@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.parametrize("threads", [1, 2])
def test_shared_kv_rows_bitwise(hq, hkv, d, window, threads):
    """Rows of one slot are computed together (K/V read once); each must equal the row alone."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, kc, vc, slots, ks, ke, scale = _verify_block(hq, hkv, d, window=window)
        full = ops.attention(q, kc, vc, slots, ks, ke, scale)
        torch.testing.assert_close(full, _reference(q, kc, vc, slots, ks, ke, scale), atol=1e-5, rtol=1e-5)
        for i in range(q.shape[0]):
            sl = slice(i, i + 1)
            assert torch.equal(ops.attention(q[sl], kc, vc, slots[sl], ks[sl], ke[sl], scale), full[sl]), f"row {i}"
        for lo, hi in [(0, 4), (3, 8), (1, 2), (5, 12)]:
            sl = slice(lo, hi)
            assert torch.equal(ops.attention(q[sl], kc, vc, slots[sl], ks[sl], ke[sl], scale), full[sl])
        perm = torch.randperm(q.shape[0], generator=torch.Generator().manual_seed(2))
        assert torch.equal(ops.attention(q[perm], kc, vc, slots[perm], ks[perm], ke[perm], scale), full[perm])
        for path in ops.supported_isas():  # every kernel path, the same bits
            with ops.forced_isa(path):
                assert torch.equal(ops.attention(q, kc, vc, slots, ks, ke, scale), full), path
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("hq,hkv,d", CONFIGS + [(4, 2, 24)])  # D = 24 takes the scalar path
@pytest.mark.parametrize("path", ops.KERNEL_ISAS)
def test_fp16_cache_gives_bitwise_the_fp32_result_of_its_values(hq, hkv, d, path):
    """An fp16 cache is read as exact fp32 values: the result equals the fp32 kernel on those values, bit for
    bit, on both paths (so everything proven for fp32 caches -- row, thread and tree invariance -- carries over),
    and it stays row invariant in a verify block beside other slots."""
    if path not in ops.supported_isas():
        pytest.skip(f"this CPU cannot run the {path} kernels")
    q, kc, vc, slots, ks, ke, scale = _verify_block(hq, hkv, d, window=64)
    kc16, vc16 = kc.half(), vc.half()
    with ops.forced_isa(path):
        full = ops.attention(q, kc16, vc16, slots, ks, ke, scale)
        assert torch.equal(full, ops.attention(q, kc16.float(), vc16.float(), slots, ks, ke, scale))
        for i in range(q.shape[0]):
            sl = slice(i, i + 1)
            assert torch.equal(ops.attention(q[sl], kc16, vc16, slots[sl], ks[sl], ke[sl], scale), full[sl]), f"row {i}"
    torch.testing.assert_close(
        full, _reference(q, kc16.float(), vc16.float(), slots, ks, ke, scale), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(ops._attention_torch(q, kc16, vc16, slots, ks, ke, scale), full, atol=1e-5, rtol=1e-5)


def test_caches_of_different_dtypes_are_rejected():
    q, kc, vc, slots, ks, ke, scale = _case(4, 1, 256)
    with pytest.raises(RuntimeError, match="k_cache is .*Float.* but v_cache is .*Half"):
        ops.attention(q, kc, vc.half(), slots, ks, ke, scale)


def test_work_items_balance_the_threads():
    """Pairs of one (slot, kv head) are cut into items so that the threads finish together: SmolLM2's 8 verify rows
    (3 kv heads x 24 pairs) were 3 items on 2 threads (one thread did two); Gemma's (1 kv head x 32 pairs) 2."""
    assert ops.attention_split([24, 24, 24], 2) == [12] * 6
    assert ops.attention_split([32], 2) == [16, 16]
    assert ops.attention_split([24, 24, 24], 1) == [24, 24, 24]  # one thread: one item per group
    assert ops.attention_split([3, 3, 3], 2) == [2, 1] * 3  # a decode row of SmolLM2's 9 heads
    assert ops.attention_split([48, 48], 2) == [24] * 4  # Qwen-1.5B's 8 rows: pieces keep whole tiles of 4 pairs
    assert sum(ops.attention_split([7, 30, 5], 2)) == 42
