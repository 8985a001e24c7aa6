"""Row invariance, rollback and batching on tiny random-weight models in the default weight format (q8), with
the KV cache in fp16 (q8's default) and in fp32."""
import pytest
import torch

from specdec.cache.kv_cache import KVCache
from specdec.config import SamplingParams
from specdec.models.batch import ForwardBatch
from specdec.engine.engine import Engine

ARCHITECTURES = ("llama", "qwen2", "gemma3")
TOKENS = [5, 17, 42, 99, 3, 250, 77, 12, 8, 130, 64, 201, 33, 7, 180, 91, 45, 2, 160, 222]  # 20 tokens


@pytest.fixture(params=[torch.float16, torch.float32], ids=["fp16-cache", "fp32-cache"])
def cache_dtype(request):
    return request.param


def forward(model, cache, token_lists, starts, slots, all_logits=True):
    return model.forward(ForwardBatch.build(token_lists, starts, slots, all_logits=all_logits), cache)


def token_by_token_logits(model, tokens, cache_dtype):
    cache = KVCache(model.config, 1, 64, dtype=cache_dtype)
    return torch.cat([forward(model, cache, [[token]], [i], [0]) for i, token in enumerate(tokens)])  # [len, vocab]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("block", [2, 3, 5, 8, 16])
def test_block_logits_bitwise_equal_token_by_token(make_tiny_model, architecture, block, cache_dtype):
    model = make_tiny_model(architecture)
    reference = token_by_token_logits(model, TOKENS, cache_dtype)
    cache = KVCache(model.config, 1, 64, dtype=cache_dtype)
    prefix = len(TOKENS) - block
    forward(model, cache, [TOKENS[:prefix]], [0], [0], all_logits=False)
    block_logits = forward(model, cache, [TOKENS[prefix:]], [prefix], [0])
    assert torch.equal(block_logits, reference[prefix:])


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_logits_bitwise_equal_beside_other_sequences(make_tiny_model, architecture, cache_dtype):
    model = make_tiny_model(architecture)
    reference = token_by_token_logits(model, TOKENS, cache_dtype)
    other = [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12, 13]
    cache = KVCache(model.config, 3, 64, dtype=cache_dtype)
    forward(model, cache, [TOKENS[:12], other[:5], other], [0, 0, 0], [1, 0, 2], all_logits=False)
    # ragged verify-like batch: 4 rows of ours between 3 and 1 rows of two other sequences
    logits = forward(model, cache, [other[5:8], TOKENS[12:16], [77]], [5, 12, 12], [0, 1, 2])
    assert torch.equal(logits[3:7], reference[12:16])


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_rollback_then_decode_equals_fresh_run(make_tiny_model, architecture, cache_dtype):
    model = make_tiny_model(architecture)
    cache = KVCache(model.config, 1, 64, dtype=cache_dtype)
    forward(model, cache, [TOKENS[:10]], [0], [0], all_logits=False)
    forward(model, cache, [[1, 2, 3, 4, 5, 6]], [10], [0])  # 6 tokens that get rejected
    # roll back to length 10 (nothing to do but reuse positions) and decode other tokens
    rolled_back = forward(model, cache, [TOKENS[10:14]], [10], [0])
    assert torch.equal(rolled_back, token_by_token_logits(model, TOKENS[:14], cache_dtype)[10:])


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_sliding_window_and_long_prefill_chunks_are_exact(make_tiny_model, architecture, cache_dtype):
    model = make_tiny_model(architecture)
    tokens = (TOKENS * 3)[:50]
    reference = token_by_token_logits(model, tokens, cache_dtype)
    cache = KVCache(model.config, 1, 64, dtype=cache_dtype)
    chunks = [forward(model, cache, [tokens[i : i + 7]], [i], [0]) for i in range(0, 50, 7)]
    assert torch.equal(torch.cat(chunks), reference)


def generate(model, tokenizer, prompts, params, max_num_seqs=4):
    engine = Engine(model, tokenizer, max_num_seqs=max_num_seqs, max_model_len=256)
    seqs = [engine.add_request(prompt, params) for prompt in prompts]
    while engine.has_unfinished():
        engine.step()
    return [seq.output_token_ids for seq in seqs]


PROMPTS = [[5, 17, 42], [99, 3, 250, 77, 12, 8, 130, 64, 201], [33], [7, 180, 91, 45, 2, 160, 222, 1, 2, 3, 4, 5, 6]]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_batch_generates_what_each_prompt_generates_alone(make_tiny_model, tiny_tokenizer, architecture):
    model = make_tiny_model(architecture)
    params = SamplingParams(max_tokens=24)
    alone = [generate(model, tiny_tokenizer, [prompt], params)[0] for prompt in PROMPTS]
    assert generate(model, tiny_tokenizer, PROMPTS, params) == alone
    assert generate(model, tiny_tokenizer, PROMPTS, params, max_num_seqs=2) == alone  # queueing, slots reused


def test_seeded_sampling_is_reproducible_and_batch_independent(make_tiny_model, tiny_tokenizer):
    model = make_tiny_model("qwen2")
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    alone = generate(model, tiny_tokenizer, [PROMPTS[1]], params)[0]
    assert generate(model, tiny_tokenizer, [PROMPTS[0], PROMPTS[1]], params)[1] == alone
    other_seed = generate(model, tiny_tokenizer, [PROMPTS[1]], SamplingParams(temperature=1.0, seed=99, max_tokens=16))[
        0
    ]
    assert other_seed != alone


def test_prompt_longer_than_context_is_rejected_with_both_lengths(make_tiny_model, tiny_tokenizer):
    engine = Engine(make_tiny_model("llama"), tiny_tokenizer, max_num_seqs=1, max_model_len=16)
    with pytest.raises(ValueError, match=r"prompt has 20 tokens but the context is 16 tokens"):
        engine.add_request(TOKENS, SamplingParams())


def test_generation_stops_at_context_end(make_tiny_model, tiny_tokenizer):
    engine = Engine(make_tiny_model("llama"), tiny_tokenizer, max_num_seqs=1, max_model_len=24)
    seq = engine.add_request(TOKENS, SamplingParams(max_tokens=100, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert seq.finish_reason == "length" and len(seq.all_token_ids) == 24


def test_chunked_prefill_interleaves_with_decoding_and_changes_nothing(make_tiny_model, tiny_tokenizer):
    model = make_tiny_model("gemma3")
    params = SamplingParams(max_tokens=12)
    expected = generate(model, tiny_tokenizer, PROMPTS, params)
    engine = Engine(model, tiny_tokenizer, max_num_seqs=4, max_model_len=256, prefill_chunk=4)
    first = engine.add_request(PROMPTS[0], params)
    engine.step()  # 3-token prompt fits in one chunk: first token out
    assert len(first.output_token_ids) == 1
    late = engine.add_request(PROMPTS[3], params)  # 13 tokens: 4 prefill steps of at most 4 tokens
    for _ in range(3):
        engine.step()
        assert late.prefilling and not late.output_token_ids
    assert len(first.output_token_ids) == 4  # the running stream kept decoding meanwhile
    others = [engine.add_request(prompt, params) for prompt in PROMPTS[1:3]]
    while engine.has_unfinished():
        engine.step()
    assert [
        first.output_token_ids,
        others[0].output_token_ids,
        others[1].output_token_ids,
        late.output_token_ids,
    ] == expected


def test_prompts_prefill_in_one_forward_while_nothing_decodes(make_tiny_model, tiny_tokenizer, monkeypatch):
    """With no stream to stall, a step prefills up to idle_prefill_chunk tokens; beside a decoding stream, at most
    prefill_chunk. The outputs are the same either way."""
    model = make_tiny_model("qwen2")
    params = SamplingParams(max_tokens=6)
    long_prompt = [(7 * i) % 250 + 1 for i in range(40)]
    expected = generate(model, tiny_tokenizer, [[5, 17, 42], long_prompt], params)
    engine = Engine(model, tiny_tokenizer, max_num_seqs=2, max_model_len=256, prefill_chunk=8, idle_prefill_chunk=64)
    prefill_sizes = []
    prefill_step = engine._prefill_step
    monkeypatch.setattr(engine, "_prefill_step", lambda budget: (prefill_sizes.append(budget), prefill_step(budget))[1])
    alone = engine.add_request(long_prompt, params)
    engine.step()
    assert len(alone.output_token_ids) == 1  # 40 tokens in one step
    first = engine.add_request([5, 17, 42], params)
    while engine.has_unfinished():
        engine.step()
    assert prefill_sizes[0] == 64 and set(prefill_sizes[1:3]) == {8}
    assert [first.output_token_ids, alone.output_token_ids] == expected


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_prefill_runs_the_last_layer_for_its_logit_rows_only(make_tiny_model, architecture, monkeypatch):
    """A prefill's rows that need no logits stop after writing the last layer's keys/values; the logit rows and
    the cache come out bit for bit as from a pass that computes every row."""
    model = make_tiny_model(architecture)
    prompts = [TOKENS[:9], TOKENS[3:15], TOKENS[:5]]
    full_cache, pruned_cache = KVCache(model.config, 3, 64), KVCache(model.config, 3, 64)
    full = model.forward_hidden(ForwardBatch.build(prompts, [0, 0, 0], [0, 1, 2], all_logits=False), full_cache)
    mlp_rows = []
    real_mlp = model._mlp
    monkeypatch.setattr(
        model, "_mlp", lambda layer, hidden: mlp_rows.append(hidden.shape[0]) or real_mlp(layer, hidden)
    )
    batch = ForwardBatch.build(prompts, [0, 0, 0], [0, 1, 2], all_logits=False, last_logits=[True, False, True])
    logits = model.forward(batch, pruned_cache)
    assert mlp_rows == [26] * (model.config.num_layers - 1) + [2]
    assert torch.equal(logits, full.logits[[0, 2]])
    assert all(
        torch.equal(a, b) for a, b in zip(full_cache.keys + full_cache.values, pruned_cache.keys + pruned_cache.values)
    )
    mlp_rows.clear()  # a chunk that ends no prompt: keys/values only, no logits
    assert model.forward(ForwardBatch.build([[1, 2, 3]], [9], [0], all_logits=False, last_logits=[False]),
                         pruned_cache).shape == (0, model.config.vocab_size)
    assert mlp_rows == [3] * (model.config.num_layers - 1)


def test_last_logits_needs_one_flag_per_sequence_and_no_all_logits():
    with pytest.raises(ValueError, match="one flag per sequence"):
        ForwardBatch.build([[1, 2], [3]], [0, 0], [0, 1], all_logits=False, last_logits=[True])
    with pytest.raises(ValueError, match="all_logits=False"):
        ForwardBatch.build([[1, 2]], [0], [0], all_logits=True, last_logits=[True])
