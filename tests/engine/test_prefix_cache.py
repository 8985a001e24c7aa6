"""The target's prefix cache: a request whose prompt starts with an earlier request's tokens copies their keys and
values instead of prefilling them, and generates exactly what it generates without the cache."""
import pytest

from specdec.config import SamplingParams
from specdec.drafters.ngram import NgramDrafter
from specdec.engine.engine import Engine
from specdec.llm import LLM

ARCHITECTURES = ("llama", "qwen2", "gemma3")
SYSTEM = [5, 17, 42, 99, 3, 250, 77, 12, 8, 130, 64, 201, 33, 7, 180, 91, 45, 2, 160, 222]  # a shared 20-token turn
QUESTION = [11, 12, 13, 14, 15, 11, 12, 13, 14, 15]
FOLLOW_UP = [21, 22, 23, 24, 21, 22]
TOKENIZER_VOCAB = 258  # the tiny tokenizer's 256 bytes + <bos>, <eos>


def make_engine(model, tokenizer, prefix_cache_tokens, speculative=False, max_num_seqs=2):
    drafter = NgramDrafter(prompt_lookup_max=3, prompt_lookup_min=1) if speculative else None
    return Engine(model, tokenizer, max_num_seqs=max_num_seqs, max_model_len=256, drafter=drafter,
                  num_speculative_tokens=4 if speculative else 0, prefix_cache_tokens=prefix_cache_tokens)


def run(engine, prompt, max_tokens=24):
    seq = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
    while engine.has_unfinished():
        engine.step()
    return seq


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("speculative", [False, True])
def test_a_second_turn_reuses_the_first_and_generates_what_a_fresh_engine_does(make_tiny_model, tiny_tokenizer,
                                                                                architecture, speculative):
    model = make_tiny_model(architecture, vocab_size=TOKENIZER_VOCAB)  # its outputs are valid prompt ids
    cached = make_engine(model, tiny_tokenizer, 4096, speculative)
    first = run(cached, SYSTEM + QUESTION)
    assert first.cached_prompt_tokens == 0
    # the conversation so far (prompt + answer) plus a new turn: everything but the new turn is in the store
    second_prompt = SYSTEM + QUESTION + first.output_token_ids + FOLLOW_UP
    second = run(cached, second_prompt)
    committed = len(SYSTEM + QUESTION + first.output_token_ids) - 1  # the answer's last token was never fed back
    assert second.cached_prompt_tokens == committed
    fresh = run(make_engine(model, tiny_tokenizer, 0, speculative), second_prompt)
    assert fresh.cached_prompt_tokens == 0
    assert second.output_token_ids == fresh.output_token_ids
    assert cached.prefix_cache.hit_tokens == committed
    assert cached.prefix_cache.queried_tokens == len(SYSTEM + QUESTION) + len(second_prompt)


def test_a_repeated_prompt_still_computes_its_last_token(make_tiny_model, tiny_tokenizer):
    model = make_tiny_model("gemma3")
    engine = make_engine(model, tiny_tokenizer, 4096)
    first = run(engine, SYSTEM + QUESTION)
    again = run(engine, SYSTEM + QUESTION)
    assert again.cached_prompt_tokens == len(SYSTEM + QUESTION) - 1  # its logits give the first token
    assert again.output_token_ids == first.output_token_ids


def test_a_prompt_is_shared_once_prefilled_while_its_request_still_runs(make_tiny_model, tiny_tokenizer):
    model = make_tiny_model("qwen2")
    engine = make_engine(model, tiny_tokenizer, 4096)
    params = SamplingParams(max_tokens=24)
    first = engine.add_request(SYSTEM + QUESTION, params)
    engine.step()  # prefills the first prompt (one chunk) and samples its first token
    assert not first.finished
    second = engine.add_request(SYSTEM + FOLLOW_UP, params)
    while engine.has_unfinished():
        engine.step()
    assert second.cached_prompt_tokens == len(SYSTEM)
    assert second.output_token_ids == run(make_engine(model, tiny_tokenizer, 0), SYSTEM + FOLLOW_UP).output_token_ids


def test_short_matches_and_a_disabled_cache_copy_nothing(make_tiny_model, tiny_tokenizer):
    model = make_tiny_model("llama")
    engine = make_engine(model, tiny_tokenizer, 4096)
    run(engine, SYSTEM + QUESTION)
    assert run(engine, SYSTEM[:10] + FOLLOW_UP).cached_prompt_tokens == 0  # 10 shared tokens: below min_match
    disabled = make_engine(model, tiny_tokenizer, 0)
    run(disabled, SYSTEM + QUESTION)
    assert run(disabled, SYSTEM + QUESTION).cached_prompt_tokens == 0
    assert disabled.prefix_cache is None


def test_the_store_stays_within_its_token_budget(make_tiny_model, tiny_tokenizer):
    model = make_tiny_model("llama")
    engine = make_engine(model, tiny_tokenizer, 60)
    for offset in range(4):
        run(engine, [offset + 1] * 5 + SYSTEM + QUESTION, max_tokens=8)
        assert engine.prefix_cache.store.num_tokens <= 60


def test_llm_passes_the_budget_and_rejects_a_negative_one(make_tiny_model, tiny_tokenizer):
    llm = LLM(loaded=(make_tiny_model("llama"), tiny_tokenizer), prefix_cache_tokens=1000)
    assert llm.engine.prefix_cache.store.max_tokens == 1000
    assert LLM(loaded=(make_tiny_model("llama"), tiny_tokenizer)).engine.prefix_cache is None
    with pytest.raises(ValueError, match="prefix_cache_tokens must be >= 0, got -1"):
        LLM(loaded=(make_tiny_model("llama"), tiny_tokenizer), prefix_cache_tokens=-1)
