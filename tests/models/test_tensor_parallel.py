"""Tensor parallelism with 2 processes on this machine (gloo): greedy speculation equals plain decoding at TP = 2,
a row's logits are bitwise the same alone, in a verify block and beside another sequence, TP = 2 logits are close
to TP = 1, and the fixed-order all-reduce gives the same bits whatever the message size and on every rank.

Each model's group of processes is started once for the module (a start costs a few seconds: a spawned process
imports torch)."""
import functools
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing

from specdec.cache.kv_cache import KVCache
from specdec.config import SamplingParams
from specdec.drafters.ngram import NgramDrafter
from specdec.engine.engine import Engine
from specdec.engine.tensor_parallel import launch, mirrored_caches
from specdec.kernels import q5
from specdec.llm import LLM
from specdec.models.batch import ForwardBatch
from specdec.models.layers import Linear, TensorStorage
from specdec.models.parallel import ShardPlan, TensorParallel
from specdec.models.transformer import Transformer
from specdec.runtime import load_model
from tiny_models import random_int8_blocks, tiny_config, tiny_tensors

# name -> (architecture, weight format, config overrides); q4 needs inputs in multiples of 256, per rank too
MODELS = {
    "gemma3-q8": ("gemma3", "q8", {}),
    "llama-q4": ("llama", "q4", {"hidden_size": 256, "intermediate_size": 512, "head_dim": 128}),
    "gemma3-fp32": ("gemma3", "fp32", {}),  # torch's matmul: not row invariant, for the closeness to TP = 1 only
}
PROMPTS = [
    [5, 17, 42, 5, 17, 42, 5, 17],
    [99, 3, 250, 77, 12, 8, 130, 64, 201, 99, 3, 250, 77],
    [1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 5, 9, 1, 2],
    [7, 180, 91, 45, 2, 160, 222, 1, 2, 3, 4, 5, 6, 7, 180, 91, 45, 2, 160],
]
LONG_PROMPT = [(7 * i + 3) % 250 for i in range(40)]
# TP = 2 against TP = 1, max |difference| over max |logit|. The ranks' partial sums add up in another order than
# one process's: a difference of fp32 rounding (measured 6.4e-6 at fp32 weights; 4.1e-6 on the tiny Qwen2 at q8).
# The q8 and q4 kernels quantize their activations to int8 per block of 32: where that rounding difference moves an
# activation across a rounding boundary, its row, and the later rows that attend to its keys/values, differ by one
# quantization step's effect (measured 9.2e-3 on the tiny Gemma 3 from its 8th row on, whose random weights amplify
# it, 1 row in 40 with another argmax; 1.6e-3 on the tiny Llama at q4).
FP32_TOLERANCE = 1e-4
QUANTIZED_TOLERANCE = 2e-2


def build_tiny(architecture: str, weight_format: str, overrides: dict, parallel: TensorParallel | None):
    """Every rank's model (spawned ranks import this module to run it)."""
    config = tiny_config(architecture, **overrides)
    return Transformer(config, tiny_tensors(config), weight_format=weight_format, parallel=parallel), None


def build_failing_on_rank_1(parallel: TensorParallel):
    if parallel.rank == 1:
        raise ValueError("rank 1 cannot build its shard")
    return build_tiny("llama", "q8", {}, parallel)


@pytest.fixture(scope="module")
def tp_llm(tiny_model_dir):
    """A tiny Qwen2 checkpoint directory loaded by path at tensor_parallel_size 2 (the user's way)."""
    llm = LLM(str(tiny_model_dir), weight_format="q8", tensor_parallel_size=2, max_num_seqs=4, max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3}, draft_policy="fixed")
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def tp_models(tp_llm, tiny_model_dir):
    """name -> (TP = 2 leader model, TP = 1 model of the same weights)."""
    groups = []
    models = {"qwen2-q8": (tp_llm.model, load_model(str(tiny_model_dir), "q8")[0])}
    for name, (architecture, weight_format, overrides) in MODELS.items():
        leader, _, group = launch(2, functools.partial(build_tiny, architecture, weight_format, overrides))
        groups.append(group)
        models[name] = (leader, build_tiny(architecture, weight_format, overrides, None)[0])
    yield models
    for group in groups:
        group.close()


ALL_MODELS = ["qwen2-q8", *MODELS]
EXACT_MODELS = [name for name in ALL_MODELS if not name.endswith("fp32")]


def run(model, tokenizer, prompts, drafter=None, max_tokens=32):
    engine = Engine(model, tokenizer, max_num_seqs=4, max_model_len=256, drafter=drafter,
                    num_speculative_tokens=4 if drafter else 0)
    seqs = [engine.add_request(prompt, SamplingParams(max_tokens=max_tokens)) for prompt in prompts]
    while engine.has_unfinished():
        engine.step()
    return [seq.output_token_ids for seq in seqs], engine


@pytest.mark.parametrize("name", EXACT_MODELS)
@pytest.mark.parametrize("branches", [1, 4])
def test_greedy_speculation_equals_plain_decoding_at_tp2(tp_models, tiny_tokenizer, name, branches):
    model, _ = tp_models[name]
    plain, _ = run(model, tiny_tokenizer, PROMPTS)
    drafter = NgramDrafter(prompt_lookup_max=3, prompt_lookup_min=1, num_branches=branches)  # 4: token trees
    speculative, engine = run(model, tiny_tokenizer, PROMPTS, drafter)
    assert speculative == plain
    assert engine.metrics.accepted_tokens > 0  # drafts were verified in blocks, and some accepted


def test_llm_speculative_equals_plain_and_the_prefix_cache_is_mirrored(tp_llm, tp_models, tiny_tokenizer):
    params = SamplingParams(max_tokens=24)
    plain = tp_llm.generate(PROMPTS, params, speculative=False)
    speculative = tp_llm.generate(PROMPTS, params)
    assert [r.token_ids for r in speculative] == [r.token_ids for r in plain]
    assert sum(r.metrics.accepted_tokens for r in speculative) > 0
    model, _ = tp_models["qwen2-q8"]
    cached = Engine(model, tiny_tokenizer, max_num_seqs=2, max_model_len=256, prefix_cache_tokens=4096)
    generate(cached, LONG_PROMPT[:24])
    second_prompt = LONG_PROMPT[:24] + [21, 22, 23]
    reused = generate(cached, second_prompt)
    assert cached.prefix_cache.hit_tokens == 24  # the workers load their heads' keys/values from their stores
    assert reused == generate(Engine(model, tiny_tokenizer, max_num_seqs=2, max_model_len=256), second_prompt)


def generate(engine, prompt):
    seq = engine.add_request(prompt, SamplingParams(max_tokens=16))
    while engine.has_unfinished():
        engine.step()
    return seq.output_token_ids


def prefilled(model, prompts):
    """A cache (this rank's heads, mirrored on the workers) with each prompt but its last token in slot i."""
    cache, _ = mirrored_caches(model, len(prompts), 128, torch.float16, 0)
    model.forward(ForwardBatch.build([p[:-1] for p in prompts], [0] * len(prompts), list(range(len(prompts))),
                                     all_logits=False), cache)
    return cache


@pytest.mark.parametrize("name", EXACT_MODELS)
def test_a_rows_logits_are_the_same_alone_in_a_verify_block_and_beside_another_sequence(tp_models, name):
    model, _ = tp_models[name]
    first, other = LONG_PROMPT[:30], PROMPTS[3]
    cache = prefilled(model, [first, other])
    start = len(first) - 1
    alone = model.forward(ForwardBatch.build([first[-1:]], [start], [0], all_logits=True), cache)  # [1, vocab]
    block = model.forward(ForwardBatch.build([[first[-1], 4, 5, 6]], [start], [0], all_logits=True), cache)
    beside = model.forward(ForwardBatch.build([[first[-1], 4], other[-1:]], [start, len(other) - 1], [0, 1],
                                              all_logits=True), cache)
    assert torch.equal(block[:1], alone)
    assert torch.equal(beside[:1], alone)
    assert not torch.equal(beside[2:], alone)  # the other sequence's row is its own


@pytest.mark.parametrize("name", ALL_MODELS)
def test_tp2_logits_are_close_to_tp1(tp_models, name):
    tp2, tp1 = tp_models[name]
    batch = ForwardBatch.build([LONG_PROMPT], [0], [0], all_logits=True)
    cache_tp2, _ = mirrored_caches(tp2, 1, 64, torch.float16, 0)
    logits_tp2 = tp2.forward(batch, cache_tp2)  # [40, vocab]
    logits_tp1 = tp1.forward(batch, KVCache(tp1.config, 1, 64, dtype=torch.float16))
    row_diff = (logits_tp2 - logits_tp1).abs().amax(dim=-1) / logits_tp1.abs().max()  # [40] relative
    same_argmax = float((logits_tp2.argmax(-1) == logits_tp1.argmax(-1)).float().mean())
    print(f"{name}: TP=2 vs TP=1 relative |diff| max {float(row_diff.max()):.3g}, median row "
          f"{float(row_diff.median()):.3g}; max abs {float((logits_tp2 - logits_tp1).abs().max()):.3g}; "
          f"same argmax in {same_argmax:.0%} of rows")
    assert float(row_diff.max()) <= (FP32_TOLERANCE if name.endswith("fp32") else QUANTIZED_TOLERANCE)
    assert same_argmax >= 0.95


# ---- the all-reduce -------------------------------------------------------------------------------------------------
ALL_REDUCE_RANKS = 3  # with 2 ranks a + b = b + a: 3 ranks make the order visible
ALL_REDUCE_SHAPE = (1024, 512)  # the largest message: 2 MiB per rank
SLICES = [(0, 1), (5, 6), (3, 10), (0, 64), (100, 1024), (0, 1024)]


def rank_partial(rank: int) -> torch.Tensor:
    """Rank r's partial sums [1024, 512]: magnitudes 1e-4 .. 1e4 mixed, so that the order of additions shows."""
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(ALL_REDUCE_SHAPE, generator=generator) * 10 ** (8 * torch.rand(ALL_REDUCE_SHAPE,
                                                                                      generator=generator) - 4)


def all_reduce_rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    parallel = TensorParallel.connect(world_size, rank, port)
    partial = rank_partial(rank)
    results = [parallel.all_reduce(partial[start:end]) for start, end in SLICES]
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def test_the_all_reduce_adds_in_rank_order_whatever_the_message_size_on_every_rank(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.multiprocessing.spawn(all_reduce_rank, (ALL_REDUCE_RANKS, port, str(tmp_path)), nprocs=ALL_REDUCE_RANKS)
    partials = [rank_partial(rank) for rank in range(ALL_REDUCE_RANKS)]
    in_rank_order = (partials[0] + partials[1]) + partials[2]
    assert not torch.equal(in_rank_order, partials[0] + (partials[1] + partials[2]))  # the order shows in the bits
    for rank in range(ALL_REDUCE_RANKS):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for (start, end), result in zip(SLICES, results):
            assert torch.equal(result, in_rank_order[start:end]), (rank, start, end)


# ---- sharding -------------------------------------------------------------------------------------------------------
def test_shard_plans_refuse_splits_that_break_heads_or_blocks():
    with pytest.raises(ValueError, match="must divide the attention heads \\(4\\) and the key/value heads \\(2\\)"):
        ShardPlan.build(tiny_config("llama"), 4, 0, TensorStorage(), "q8")
    config = tiny_config("llama", hidden_size=256, intermediate_size=512, head_dim=64)  # o_proj: 128 inputs per rank
    with pytest.raises(ValueError, match="128 of the 256 inputs of layers.0.o_proj, not a multiple of 256"):
        ShardPlan.build(config, 2, 0, TensorStorage(), "q4")
    assert ShardPlan.build(config, 2, 1, TensorStorage(), "q8").head_start == 2


def test_the_intermediate_dimension_splits_at_whole_blocks():
    config = tiny_config("llama", hidden_size=256, intermediate_size=256 * 3, head_dim=128)
    q4 = [ShardPlan.build(config, 2, rank, TensorStorage(), "q4").intermediate[0] for rank in range(2)]
    assert q4 == [(0, 256), (256, 768)]  # 3 super-blocks: the later rank gets the odd one
    q8 = [ShardPlan.build(config, 2, rank, TensorStorage(), "q8").intermediate[0] for rank in range(2)]
    assert q8 == [(0, 384), (384, 768)]


@pytest.mark.parametrize("weight_format,unit", [("q8", 32), ("q4", 256)])
def test_a_shard_holds_the_same_quantized_weights_as_the_whole_layer(weight_format, unit):
    weight = torch.randn(8, 4 * unit, generator=torch.Generator().manual_seed(0))  # [out, in]
    whole = Linear.build(weight, None, weight_format)
    inputs = torch.randn(3, 4 * unit, generator=torch.Generator().manual_seed(1))
    for start, end in [(0, unit), (unit, 4 * unit)]:
        shard = Linear.build(weight[:, start:end].contiguous(), None, weight_format)
        padded = torch.zeros_like(inputs)
        padded[:, start:end] = inputs[:, start:end]
        # the shard's product equals the whole layer's over inputs that are zero outside the shard's columns
        assert torch.allclose(shard(inputs[:, start:end]), whole(padded), rtol=0, atol=1e-3)
    quantized = whole.quantized.dequantize() if weight_format == "q8" else whole.q4.dequantize()
    shard = Linear.build(weight[:, unit:].contiguous(), None, weight_format)
    shard_quantized = shard.quantized.dequantize() if weight_format == "q8" else shard.q4.dequantize()
    assert torch.equal(shard_quantized, quantized[:, unit:])


def test_a_rank_that_fails_to_build_its_shard_fails_the_launch():
    with pytest.raises(RuntimeError, match="a worker of the tensor-parallel group \\(size 2\\) failed"):
        launch(2, build_failing_on_rank_1)


def test_a_loaded_model_is_not_split_again(tiny_tokenizer):
    model = build_tiny("llama", "q8", {}, None)[0]
    with pytest.raises(ValueError, match="a loaded model is split already"):
        LLM(loaded=(model, tiny_tokenizer), tensor_parallel_size=2)


def test_a_q5_shard_holds_the_files_q5_0_blocks_of_its_columns():
    """A row-parallel layer stored as Q5_0 (blocks of 32 inputs, 22 bytes each): each rank's bytes are whole blocks of
    its columns, the very values of the whole layer there."""
    config = tiny_config("llama", hidden_size=256, intermediate_size=512, head_dim=64)
    name, out_features, in_features = "layers.0.o_proj", 256, 256
    raw = torch.from_numpy(random_int8_blocks("Q5_0", out_features, in_features))
    whole = q5.q5_from_q5_0_blocks(raw, out_features, in_features).dequantize()
    storage = TensorStorage(types={name: "Q5_0"}, block_bytes={name: raw})
    for rank in range(2):
        plan = ShardPlan.build(config, 2, rank, storage, "q5")
        columns = plan.columns_of(name)
        shard = plan.storage(storage).block_bytes[name]
        held = q5.q5_from_q5_0_blocks(shard, out_features, columns.stop - columns.start).dequantize()
        assert torch.equal(held, whole[:, columns])
