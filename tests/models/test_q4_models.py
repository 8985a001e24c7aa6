"""Models in the q4 weight format: which layers are q4, bitwise row invariance (alone / in a verify block /
beside other sequences), and greedy speculation identical to plain decoding for every drafter, batch 1 and > 1.
The tiny models here have widths that are multiples of 256 (one test pads others); the real Q4_K files are
covered by tests/real (the default format, auto, runs their Q4_K layers as q4)."""
import pytest
import torch

from specdec.cache.kv_cache import KVCache
from specdec.config import SamplingParams
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.suffix import SuffixDrafter
from specdec.engine.engine import Engine
from specdec.models.batch import ForwardBatch
from specdec.models.layers import TensorStorage, check_weight_format

ARCHITECTURES = ("llama", "qwen2", "gemma3")
Q4_WIDTHS = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64)
TOKENS = [5, 17, 42, 99, 3, 250, 77, 12, 8, 130, 64, 201, 33, 7, 180, 91, 45, 2, 160, 222]
PROMPTS = [
    [5, 17, 42, 5, 17, 42, 5, 17],
    [99, 3, 250, 77, 12, 8, 130, 64, 201, 99, 3, 250, 77],
    [33, 34],
]


def q4_model(make_tiny_model, architecture, seed=0):
    overrides = dict(Q4_WIDTHS, attention_scale=64**-0.5) if architecture == "gemma3" else Q4_WIDTHS
    return make_tiny_model(architecture, seed=seed, weight_format="q4", **overrides)


def forward(model, cache, token_lists, starts, slots, all_logits=True):
    return model.forward(ForwardBatch.build(token_lists, starts, slots, all_logits=all_logits), cache)


def test_linear_format_rules():
    storage = TensorStorage(types={"a": "Q4_K", "b": "Q4_K", "c": "Q6_K", "d": "F16", "e": "Q5_0", "f": "Q8_0",
                                   "g": "Q6_K"},
                            block_bytes={name: torch.zeros(1) for name in "abcg"})
    assert storage.linear_format(["a", "b"], 512, "auto") == "q4"  # Q4_K: lossless
    assert storage.linear_format(["c", "g"], 512, "auto") == "q6"  # Q6_K: lossless
    assert storage.linear_format(["c"], 512, "q4") == "q6"  # q4 keeps Q6_K layers at 6 bits too
    assert storage.linear_format(["c"], 640, "auto") == "q8"  # a Q6_K tensor of a width Q6_K cannot have
    assert storage.linear_format(["a", "c"], 512, "auto") == "q8"  # mixed Q4_K / Q6_K parts: q8
    assert storage.linear_format(["d"], 512, "auto") == "q8"  # auto never quantizes to 4 bits at load
    assert storage.linear_format(["d"], 512, "q4") == "q4"  # q4 does (fp16)
    assert storage.linear_format(["e"], 896, "q4") == "q4"  # Q5_0 (Q4_K_M's type for widths that are no multiple
    assert storage.linear_format(["e"], 896, "auto") == "q8"  # of 256) is quantized to q4, padded, under q4 only
    assert storage.linear_format(["f"], 512, "q4") == "q8"  # Q8_0 layers stay q8 under q4
    assert TensorStorage(types={"c": "Q6_K"}).linear_format(["c"], 512, "auto") == "q8"  # no bytes kept: q8
    # the bytes a format loads losslessly: Q4_K's for q4, Q6_K's for q6, none for a format that requantizes
    assert storage.lossless_bytes(["a", "b"], "q4").shape == (2,) and storage.lossless_bytes(["c"], "q6").shape == (1,)
    for names, linear_format in ((["c"], "q4"), (["a", "c"], "q4"), (["a"], "q6"), (["a"], "q8"), (["d"], "q4")):
        assert storage.lossless_bytes(names, linear_format) is None, (names, linear_format)
    assert storage.linear_format(["d"], 640, "q4") == "q4"  # any width quantizes at load (padded to 768)
    assert storage.linear_format(["a"], 640, "auto") == "q8"  # a Q4_K tensor of a width Q4_K cannot have
    for names in (["a", "b"], ["a", "c"], ["c"], ["d"], ["e"], ["f"]):  # q4-all: every storage, any width
        assert storage.linear_format(names, 640, "q4-all") == "q4"
    assert storage.linear_format(["a"], 512, "q8") == "q8"
    # parts: a linear whose names the file stores in different lossless block types keeps each run lossless
    assert storage.linear_parts(["a", "b", "c"], 512, "auto") == [(["a", "b"], "q4"), (["c"], "q6")]
    assert storage.linear_parts(["c", "a", "b", "g"], 512, "q4") == [(["c"], "q6"), (["a", "b"], "q4"), (["g"], "q6")]
    assert storage.linear_parts(["a", "b"], 512, "auto") == [(["a", "b"], "q4")]  # one format: one part
    assert storage.linear_parts(["a", "c"], 640, "auto") == [(["a", "c"], "q8")]  # no lossless width
    # d (F16) has no lossless format: a stays lossless, d is q8 beside it
    assert storage.linear_parts(["a", "d"], 512, "auto") == [(["a"], "q4"), (["d"], "q8")]
    assert storage.linear_parts(["a", "f"], 512, "q4") == [(["a"], "q4"), (["f"], "q8")]  # nor f (Q8_0)
    for weight_format in ("q8", "fp32"):
        assert storage.linear_parts(["a", "c"], 512, weight_format) == [(["a", "c"], weight_format)]
    assert storage.linear_parts(["a", "c"], 512, "q4-all") == [(["a", "c"], "q4")]  # all of it requantized
    assert storage.linear_format(["a"], 512, "fp32") == "fp32"
    with pytest.raises(ValueError, match="unknown weight format 'q3'; choose one of auto, q4, q4-all, q5, q8, fp32"):
        check_weight_format("q3")


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_every_layer_linear_is_q4_and_embeddings_q8(make_tiny_model, architecture):
    model = q4_model(make_tiny_model, architecture)
    for layer in model.layers:
        assert {layer.qkv_proj.format, layer.o_proj.format, layer.gate_up_proj.format, layer.down_proj.format} == {"q4"}
    assert model.embed_tokens.format == "q8"
    assert model.lm_head.format == ("q8" if model.config.tie_word_embeddings else "q4")
    assert set(model.linear_bytes()) == {"q4", "q8"}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("block", [2, 5, 8, 16])
def test_q4_block_logits_bitwise_equal_token_by_token(make_tiny_model, architecture, block):
    model = q4_model(make_tiny_model, architecture)
    cache = KVCache(model.config, 1, 64, dtype=model.kv_cache_dtype)
    reference = torch.cat([forward(model, cache, [[token]], [i], [0]) for i, token in enumerate(TOKENS)])
    cache = KVCache(model.config, 1, 64, dtype=model.kv_cache_dtype)
    prefix = len(TOKENS) - block
    forward(model, cache, [TOKENS[:prefix]], [0], [0], all_logits=False)
    assert torch.equal(forward(model, cache, [TOKENS[prefix:]], [prefix], [0]), reference[prefix:])


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_q4_logits_bitwise_equal_beside_other_sequences(make_tiny_model, architecture):
    model = q4_model(make_tiny_model, architecture)
    cache = KVCache(model.config, 1, 64, dtype=model.kv_cache_dtype)
    reference = torch.cat([forward(model, cache, [[token]], [i], [0]) for i, token in enumerate(TOKENS)])
    other = [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12, 13]
    cache = KVCache(model.config, 3, 64, dtype=model.kv_cache_dtype)
    forward(model, cache, [TOKENS[:12], other[:5], other], [0, 0, 0], [1, 0, 2], all_logits=False)
    logits = forward(model, cache, [other[5:8], TOKENS[12:16], [77]], [5, 12, 12], [0, 1, 2])
    assert torch.equal(logits[3:7], reference[12:16])


def _drafter(method, make_tiny_model, architecture):
    if method == "ngram":
        return NgramDrafter(prompt_lookup_max=3, prompt_lookup_min=1)
    if method == "suffix":
        return SuffixDrafter(max_depth=16, min_token_prob=0.05, cache_requests=8)
    draft = q4_model(make_tiny_model, architecture, seed=0 if method == "draft_model_same" else 1)
    return DraftModelDrafter(draft, max_num_seqs=4, max_model_len=256)


def _run(model, tokenizer, prompts, drafter=None):
    engine = Engine(model, tokenizer, max_num_seqs=4, max_model_len=256, drafter=drafter,
                    num_speculative_tokens=4 if drafter else 0)
    seqs = [engine.add_request(prompt, SamplingParams(max_tokens=40)) for prompt in prompts]
    while engine.has_unfinished():
        engine.step()
    return [seq.output_token_ids for seq in seqs], engine.metrics


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "draft_model_same"])
@pytest.mark.parametrize("batch", [1, 3])
def test_q4_greedy_speculation_identical_to_plain(make_tiny_model, tiny_tokenizer, architecture, method, batch):
    model = q4_model(make_tiny_model, architecture)
    prompts = PROMPTS[:batch] if batch > 1 else [PROMPTS[1]]
    plain, _ = _run(model, tiny_tokenizer, prompts)
    speculative, metrics = _run(model, tiny_tokenizer, prompts, _drafter(method, make_tiny_model, architecture))
    assert speculative == plain
    assert metrics.drafted_tokens > 0
    if method == "draft_model_same":
        assert metrics.acceptance_rate == 1.0


def _assert_row_invariant_and_lossless(model, tokenizer):
    """A verify block's logits equal token-by-token decoding's, and greedy n-gram speculation (batch 3) equals plain
    decoding with drafts made."""
    cache = KVCache(model.config, 1, 64, dtype=model.kv_cache_dtype)
    reference = torch.cat([forward(model, cache, [[token]], [i], [0]) for i, token in enumerate(TOKENS)])
    cache = KVCache(model.config, 1, 64, dtype=model.kv_cache_dtype)
    forward(model, cache, [TOKENS[:12]], [0], [0], all_logits=False)
    assert torch.equal(forward(model, cache, [TOKENS[12:]], [12], [0]), reference[12:])
    plain, _ = _run(model, tokenizer, PROMPTS)
    speculative, metrics = _run(model, tokenizer, PROMPTS, NgramDrafter(prompt_lookup_max=3, prompt_lookup_min=1))
    assert speculative == plain and metrics.drafted_tokens > 0


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_q4_pads_widths_that_are_no_multiple_of_256(make_tiny_model, tiny_tokenizer, architecture):
    """hidden 320, intermediate 448: every layer linear is q4 on padded widths, logits stay row invariant and
    greedy speculation stays identical to plain decoding."""
    widths = dict(hidden_size=320, intermediate_size=448, num_heads=5, num_kv_heads=1, head_dim=64)
    if architecture == "gemma3":
        widths["attention_scale"] = 64**-0.5
    model = make_tiny_model(architecture, seed=0, weight_format="q4", **widths)
    layer = model.layers[0]
    assert {layer.qkv_proj.format, layer.o_proj.format, layer.gate_up_proj.format, layer.down_proj.format} == {"q4"}
    assert (layer.qkv_proj.q4.padded_in_features, layer.down_proj.q4.padded_in_features) == (512, 512)
    _assert_row_invariant_and_lossless(model, tiny_tokenizer)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_q4_all_runs_the_output_layer_as_q4(make_tiny_model, tiny_tokenizer, architecture):
    """q4-all: the output layer is q4 too (a q4 copy where it is tied to the q8 embedding table); logits stay row
    invariant and greedy speculation identical to plain decoding."""
    overrides = dict(Q4_WIDTHS, attention_scale=64**-0.5) if architecture == "gemma3" else Q4_WIDTHS
    model = make_tiny_model(architecture, seed=0, weight_format="q4-all", **overrides)
    assert model.embed_tokens.format == "q8" and model.lm_head.format == "q4"
    assert model.lm_head is not model.embed_tokens
    tied = make_tiny_model(architecture, seed=0, weight_format="q4", **overrides)
    if tied.config.tie_word_embeddings:  # the copy is the same table, quantized once more
        dense = tied.embed_tokens.quantized.dequantize()
        assert (model.lm_head.q4.dequantize() - dense).norm() / dense.norm() < 0.1
    _assert_row_invariant_and_lossless(model, tiny_tokenizer)
