"""PrefixStore: longest shared prefix, copies that are the cache's own values, LRU bounded by tokens."""
import pytest
import torch

from specdec.cache.kv_cache import KVCache
from specdec.cache.prefix_store import PrefixStore


def filled_cache(make_tiny_model, length=40):
    cache = KVCache(make_tiny_model("llama").config, 3, 64)
    for layer in range(len(cache.keys)):
        cache.keys[layer].normal_()
        cache.values[layer].normal_()
    return cache


def test_longest_match_loads_the_saved_positions_bit_for_bit(make_tiny_model):
    cache = filled_cache(make_tiny_model)
    store = PrefixStore(max_tokens=100, min_match=4)
    short, long = list(range(10)), list(range(20))
    store.save(cache, 0, short)
    store.save(cache, 1, [*range(6), 99, 98])
    entry, length = store.longest_match(long)
    assert (entry.token_ids, length) == (tuple(short), 10)
    store.load(cache, 2, entry, length)
    for layer in range(len(cache.keys)):
        assert torch.equal(cache.keys[layer][2, :, :10], cache.keys[layer][0, :, :10])
        assert torch.equal(cache.values[layer][2, :, :10], cache.values[layer][0, :, :10])
        assert not torch.equal(cache.keys[layer][2, :, 10:12], cache.keys[layer][0, :, 10:12])  # only the match
    assert store.longest_match([*range(6), 99, 5]) == (store.longest_match([*range(6), 99])[0], 7)
    assert store.longest_match([0, 1, 2, 7]) == (None, 0)  # shorter than min_match


def test_entries_are_bounded_by_tokens_least_recently_used_first(make_tiny_model):
    cache = filled_cache(make_tiny_model)
    store = PrefixStore(max_tokens=25, min_match=4)
    store.save(cache, 0, [1] * 10)
    store.save(cache, 1, [2] * 10)
    store.longest_match([1] * 10)  # touches the first entry
    store.save(cache, 2, [3] * 10)  # 30 tokens > 25: the least recently used ([2] * 10) goes
    assert store.num_tokens == 20 and len(store) == 2
    assert store.longest_match([2] * 10) == (None, 0)
    assert store.longest_match([1] * 10)[1] == 10 and store.longest_match([3] * 10)[1] == 10


def test_an_extension_replaces_its_prefix_and_a_prefix_adds_nothing(make_tiny_model):
    cache = filled_cache(make_tiny_model)
    store = PrefixStore(max_tokens=100, min_match=4)
    store.save(cache, 0, list(range(8)))
    store.save(cache, 0, list(range(12)))
    assert len(store) == 1 and store.num_tokens == 12
    store.save(cache, 0, list(range(6)))
    assert len(store) == 1 and store.num_tokens == 12
    store.save(cache, 0, [1, 2])  # below min_match: not kept
    assert len(store) == 1
    with pytest.raises(ValueError, match="max_tokens >= 0 and min_match >= 1"):
        PrefixStore(max_tokens=-1)
