"""The KV cache's dtype: fp16 beside q8 weights by default, fp32 beside fp32 weights, either on request."""
import pytest
import torch

from specdec.cache.kv_cache import KVCache, kv_cache_dtype
from specdec.config import SamplingParams
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.engine.engine import Engine
from specdec.llm import LLM
from tiny_models import tiny_config

PROMPTS = [[5, 17, 42, 5, 17, 42, 5, 17], [99, 3, 250, 77, 12, 8, 130, 64, 201, 99, 3, 250, 77], [33, 34],
           [7, 180, 91, 45, 2, 160, 222, 1, 2, 3, 4, 5, 6, 7, 180, 91, 45, 2, 160]]


def test_write_rounds_to_the_cache_dtype_and_fp16_halves_the_memory():
    config = tiny_config("qwen2")
    half, full = KVCache(config, 2, 16, dtype=torch.float16), KVCache(config, 2, 16)
    keys = torch.randn(3, config.num_kv_heads, config.head_dim) * 3  # [tokens, kv_heads, head_dim]
    values = torch.randn(3, config.num_kv_heads, config.head_dim)
    slots, positions = torch.tensor([0, 0, 1]), torch.tensor([4, 5, 0])
    for cache in (half, full):
        cache.write(1, slots, positions, keys, values)
    assert half.keys[1].dtype == torch.float16 and full.keys[1].dtype == torch.float32
    assert torch.equal(half.keys[1][slots, :, positions], keys.half())
    assert torch.equal(half.values[1][slots, :, positions], values.half())
    assert torch.equal(full.keys[1][slots, :, positions], keys)
    assert half.nbytes() * 2 == full.nbytes()


def test_model_defaults_follow_the_weight_format(make_tiny_model):
    assert make_tiny_model("llama").kv_cache_dtype == torch.float16
    assert make_tiny_model("llama", weight_format="fp32").kv_cache_dtype == torch.float32


@pytest.mark.parametrize(
    "name,expected", [("auto", torch.float16), ("float16", torch.float16), ("float32", torch.float32)]
)
def test_option_names(name, expected):
    assert kv_cache_dtype(name, torch.float16) == expected


def test_unknown_dtypes_are_rejected_with_the_choices():
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'bf16'; choose one of auto, float32, float16"):
        kv_cache_dtype("bf16", torch.float16)
    with pytest.raises(ValueError, match="must be torch.float32 or torch.float16, got torch.bfloat16"):
        KVCache(tiny_config("llama"), 1, 8, dtype=torch.bfloat16)


def test_llm_rejects_an_unknown_dtype_before_loading_anything(tmp_path):
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int4'"):
        LLM(model=str(tmp_path / "missing.gguf"), kv_cache_dtype="int4")


@pytest.mark.parametrize("name,expected", [("auto", torch.float16), ("float32", torch.float32)])
def test_llm_builds_its_cache_with_the_chosen_dtype(make_tiny_model, tiny_tokenizer, name, expected):
    llm = LLM(loaded=(make_tiny_model("gemma3"), tiny_tokenizer), kv_cache_dtype=name)
    assert llm.engine.cache.dtype == expected
    assert all(tensor.dtype == expected for tensor in llm.engine.cache.keys + llm.engine.cache.values)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_speculation_is_lossless_with_an_fp32_cache_beside_q8_weights(make_tiny_model, tiny_tokenizer, method):
    """The non-default combination: every output of a batch of 4 mixed-length prompts equals plain decoding's."""
    model = make_tiny_model("gemma3")
    drafter = (NgramDrafter(prompt_lookup_max=3, prompt_lookup_min=1) if method == "ngram"
               else DraftModelDrafter(make_tiny_model("gemma3", seed=1), max_num_seqs=4, max_model_len=256))
    params = SamplingParams(max_tokens=40)
    outputs, accepted = [], 0
    for engine in (Engine(model, tiny_tokenizer, max_num_seqs=4, max_model_len=256, kv_cache_dtype=torch.float32),
                   Engine(model, tiny_tokenizer, max_num_seqs=4, max_model_len=256, drafter=drafter,
                          num_speculative_tokens=4, kv_cache_dtype=torch.float32)):
        assert engine.cache.dtype == torch.float32
        seqs = [engine.add_request(prompt, params) for prompt in PROMPTS]
        while engine.has_unfinished():
            engine.step()
        outputs.append([seq.output_token_ids for seq in seqs])
        accepted = sum(seq.metrics.accepted_tokens for seq in seqs)
    assert outputs[1] == outputs[0]
    assert accepted > 0
