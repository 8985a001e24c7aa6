from collections import defaultdict

import torch

import specdec.models.transformer as transformer_module
from specdec.bench.forward_breakdown import REST, format_breakdown, forward_breakdown, timed_kernels
from specdec.cache.kv_cache import KVCache
from specdec.models.batch import ForwardBatch
from specdec.models.layers import Linear


def test_breakdown_times_every_kernel_and_restores_them(make_tiny_model):
    model = make_tiny_model("gemma3")
    kernels_before = {name: getattr(transformer_module, name) for name in ("attention", "rms_norm", "gated_activation")}
    linear_call = Linear.__call__
    cache = KVCache(model.config, num_slots=1, max_len=64)
    result = forward_breakdown(model, cache, cache.allocate(), context=20, rows=[1, 4], forwards=2, rounds=2)

    config = model.config
    qkv = f"linear {config.hidden_size}x{(config.num_heads + 2 * config.num_kv_heads) * config.head_dim}"
    assert {"attention", "rms_norm", "qk_norm_rope", "gated_activation", qkv, REST} <= set(result.parts)
    for rows in (1, 4):
        timed = sum(values[rows] for part, values in result.parts.items() if part != REST)
        assert 0 < timed <= result.total[rows]
    # the wrappers are gone: the model calls its kernels directly again
    assert {name: getattr(transformer_module, name) for name in kernels_before} == kernels_before
    assert Linear.__call__ is linear_call
    table = format_breakdown(result, [1, 4])
    assert table.splitlines()[2].startswith("| whole forward |") and table.splitlines()[-1].startswith(f"| {REST} |")


def test_breakdown_labels_q4_linears(make_tiny_model):
    """A q4 layer (no dense or int8 weight) is timed under its own label: 'linear INxOUT q4'."""
    model = make_tiny_model("llama", weight_format="q4", hidden_size=256, intermediate_size=512, num_heads=4,
                            num_kv_heads=2, head_dim=64)
    cache = KVCache(model.config, num_slots=1, max_len=64)
    result = forward_breakdown(model, cache, cache.allocate(), context=8, rows=[1, 2], forwards=1, rounds=1)
    assert {"linear 256x512 q4", "linear 256x1024 q4", "linear 512x256 q4"} <= set(result.parts)


def test_timed_kernels_leaves_the_logits_unchanged(make_tiny_model):
    model = make_tiny_model("llama")
    cache = KVCache(model.config, num_slots=1, max_len=32)
    slot = cache.allocate()
    batch = ForwardBatch.build([[3, 5, 7, 9]], [0], [slot], all_logits=True, device=model.device)
    plain = model.forward(batch, cache)
    seconds = defaultdict(float)
    with timed_kernels(seconds):
        timed = model.forward(batch, cache)
    assert torch.equal(plain, timed)
    assert seconds["attention"] > 0 and seconds["rms_norm"] > 0
