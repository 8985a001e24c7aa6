"""KVCache.compact: gather-copy of a tree path into consecutive positions, in every layer."""
import pytest
import torch

from specdec.cache.kv_cache import KVCache
from tiny_models import tiny_config


def filled_cache():
    cache = KVCache(tiny_config("qwen2"), num_slots=2, max_len=16)
    generator = torch.Generator().manual_seed(0)
    for tensor in cache.keys + cache.values:
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    return cache


def test_compact_moves_a_path_in_every_layer_and_nothing_else():
    cache = filled_cache()
    before = [tensor.clone() for tensor in cache.keys + cache.values]
    cache.compact(1, [9, 11, 12], [6, 7, 8])  # overlapping: 8 is written, 9.. read
    for tensor, old in zip(cache.keys + cache.values, before):
        expected = old.clone()
        expected[1, :, [6, 7, 8]] = old[1, :, [9, 11, 12]]
        assert torch.equal(tensor, expected)


def test_compact_with_overlapping_source_and_destination_reads_first():
    cache = filled_cache()
    old = cache.keys[0].clone()
    cache.compact(0, [5, 6], [4, 5])
    assert torch.equal(cache.keys[0][0, :, 4], old[0, :, 5]) and torch.equal(cache.keys[0][0, :, 5], old[0, :, 6])


@pytest.mark.parametrize("src,dst,message", [
    ([1, 2], [3], "2 source but 1 destination"),
    ([16], [3], r"positions \[16\] outside \[0, 16\)"),
])
def test_bad_compact_arguments_are_rejected(src, dst, message):
    with pytest.raises(ValueError, match=message):
        filled_cache().compact(0, src, dst)
