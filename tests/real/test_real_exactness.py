"""Real models in the default weight format: bitwise row invariance and lossless greedy speculation."""
import gc

import pytest
import torch

from specdec.cache.kv_cache import KVCache
from specdec.config import SamplingParams
from specdec.models.batch import ForwardBatch
from specdec.llm import LLM
from specdec.runtime import load_model
from real_models import real_model_path

MODELS = ["gemma-3-270m", "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]
TEXT = "Speculative decoding drafts several tokens and verifies them in a single forward pass of the target model."
SUMMARY_PROMPT = (
    "Summarize the following article in two sentences.\n\nThe city council met on Tuesday to discuss the new park. "
    "The new park will have a playground, a pond and a garden. The council said the new park will open next spring, "
    "and the playground will be built first. Residents asked whether the pond will be safe for children; the council "
    "said the pond will have a fence."
)
PROMPTS = [
    SUMMARY_PROMPT,
    "Write a Python function that returns the sum of the squares of a list of numbers.",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "List the days of the week.",
]


@pytest.fixture(scope="module")
def loaded_models():
    cache = {}

    def get(name):
        if name not in cache:
            cache.clear()
            gc.collect()
            real_model_path(name)
            cache[name] = load_model(name)
        return cache[name]

    yield get
    cache.clear()
    gc.collect()


def logits_of(model, cache, token_lists, starts, slots, all_logits=True):
    return model.forward(ForwardBatch.build(token_lists, starts, slots, all_logits=all_logits), cache)


@pytest.mark.real
@pytest.mark.parametrize("name", MODELS)
def test_row_invariance_token_block_and_batch(loaded_models, name):
    model, tokenizer = loaded_models(name)
    tokens = tokenizer.encode(TEXT)[:24]
    other = tokenizer.encode("A different sequence that shares the batch.")
    cache = KVCache(model.config, 3, 64, dtype=model.kv_cache_dtype)  # the default: fp16 beside q8 weights
    alone = torch.cat([logits_of(model, cache, [[t]], [i], [0]) for i, t in enumerate(tokens)])  # [24, vocab]
    for block in (2, 5, 8, 16):
        prefix = len(tokens) - block
        logits_of(model, cache, [tokens[:prefix]], [0], [1], all_logits=False)
        assert torch.equal(logits_of(model, cache, [tokens[prefix:]], [prefix], [1]), alone[prefix:]), block
    logits_of(model, cache, [tokens[:8], other], [0, 0], [1, 2], all_logits=False)
    batched = logits_of(model, cache, [other[:1], tokens[8:12], [tokens[0]]], [len(other), 8, len(other)], [2, 1, 2])
    assert torch.equal(batched[1:5], alone[8:12])


def assert_lossless(llm, prompts, max_tokens=64):
    """Speculative output equals plain decoding, and drafts were accepted (the LLM must draft at a fixed k: the
    adaptive policy rightly drafts nothing where rows cost what they save, e.g. on the scalar kernels)."""
    params = SamplingParams(max_tokens=max_tokens)
    plain = llm.generate(prompts, params, chat=True, speculative=False)
    spec = llm.generate(prompts, params, chat=True)
    for plain_output, spec_output in zip(plain, spec):
        assert spec_output.token_ids == plain_output.token_ids, spec_output.text
    assert sum(output.metrics.accepted_tokens for output in spec) > 0


@pytest.mark.real
@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("batch", [1, 4])
def test_gemma_greedy_speculation_is_lossless(loaded_models, method, batch):
    loaded = loaded_models("gemma-3-270m")
    llm = LLM(loaded=loaded, speculative_config={"method": method, "num_speculative_tokens": 5}, max_num_seqs=4,
              max_model_len=1024, draft_policy="fixed")
    assert_lossless(llm, PROMPTS[:batch])


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("batch,draft_vocab_size", [(1, None), (4, None), (4, 65536)])
def test_qwen_pair_draft_model_is_lossless(loaded_models, batch, draft_vocab_size):
    loaded = loaded_models("qwen2.5-coder-1.5b-instruct")
    # a fixed k: drafts in every step, whatever the adaptive policy would decide from this machine's costs
    config = {"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 4,
              "draft_vocab_size": draft_vocab_size}
    llm = LLM(loaded=loaded, speculative_config=config, max_num_seqs=4, max_model_len=1024, draft_policy="fixed")
    assert_lossless(llm, PROMPTS[1:1 + batch] if batch == 1 else PROMPTS, max_tokens=48)
