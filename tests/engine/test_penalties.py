"""Penalties, biases, min_tokens, min_p and stop_token_ids under speculation, end to end on tiny models.

Each verify row is processed with the tokens before it (verify/penalties.py), so greedy speculative output equals
plain greedy output and seeded exact acceptance equals plain seeded sampling, for every drafter (chains and trees)
at batch 1 and 4; rejection sampling follows the penalized target distribution (chi-square), and a verifier that
penalizes every row with the committed output only (the draft prefix left out) is caught."""
import pytest
import torch

from specdec.config import SamplingParams
from specdec.drafters.base import Draft, Drafter
from specdec.engine import engine as engine_module
from specdec.engine.engine import Engine
from specdec.verify.penalties import process_logits
from test_seeded_exact import generate, method_drafter
from test_speculative import (CHI_PROMPT, PROMPTS, SMALL_VOCAB, chi_square_drafter, chi_square_p_value, make_drafter,
                              sampled_counts)
from test_trees import TREE_PROMPTS, tree_drafter

PENALTIES = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.8),
    "repetition": dict(repetition_penalty=1.15),
    "logit_bias": dict(logit_bias={5: 4.0, 17: -3.0, 42: 2.5}),
    "min_tokens": dict(min_tokens=12),  # with stop_token_ids: the token plain decoding emits third
    "all": dict(presence_penalty=0.2, frequency_penalty=0.1, repetition_penalty=1.1, logit_bias={3: 1.5}, min_tokens=6),
}
METHODS = ("ngram", "suffix", "draft_model", "draft_model_same", "ngram_tree", "suffix_tree", "draft_model_tree")


def drafter_for(method, make_tiny_model):
    if method == "draft_model_tree":
        return tree_drafter("draft_model", num_branches=4, draft_model=make_tiny_model("qwen2", seed=1))
    if method.endswith("_tree"):
        return tree_drafter(method.removesuffix("_tree"), num_branches=4)
    return make_drafter(method, make_tiny_model, "qwen2")


def penalty_params(name, model, tokenizer, prompts, **base):
    params = dict(PENALTIES[name], **base)
    if name == "min_tokens":  # a stop token that plain decoding would emit early, banned until min_tokens
        seqs, _ = generate(model, tokenizer, [(prompts[0], SamplingParams(max_tokens=6, ignore_eos=True))])
        params["stop_token_ids"] = (seqs[0].output_token_ids[2],)
    return params


def outputs(model, tokenizer, requests, drafter=None, k=0):
    seqs, engine = generate(model, tokenizer, requests, drafter, k)
    return [(seq.output_token_ids, seq.finish_reason) for seq in seqs], engine


@pytest.mark.parametrize("name", PENALTIES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculative_with_penalties_equals_plain(make_tiny_model, tiny_tokenizer, name, method, batch):
    model = make_tiny_model("qwen2")
    prompts = TREE_PROMPTS if method.endswith("_tree") else PROMPTS
    prompts = prompts[:batch] if batch > 1 else [prompts[1]]
    params = SamplingParams(max_tokens=32, **penalty_params(name, model, tiny_tokenizer, prompts))
    plain, _ = outputs(model, tiny_tokenizer, [(p, params) for p in prompts])
    unpenalized, _ = outputs(model, tiny_tokenizer, [(p, SamplingParams(max_tokens=32)) for p in prompts])
    assert plain != unpenalized  # the penalty changes the output
    speculative, engine = outputs(model, tiny_tokenizer, [(p, params) for p in prompts],
                                  drafter_for(method, make_tiny_model), 4)
    assert speculative == plain
    assert engine.metrics.drafted_tokens > 0


SAMPLED = [dict(temperature=0.8, presence_penalty=0.7, min_p=0.05),
           dict(temperature=1.0, frequency_penalty=0.5, top_k=40, logit_bias={7: 3.0}),
           dict(temperature=1.2, repetition_penalty=1.4, min_p=0.1, top_p=0.9),
           dict(temperature=0.7, min_tokens=10, presence_penalty=0.3, frequency_penalty=0.3)]


@pytest.mark.parametrize("method", ("ngram", "suffix", "draft_model_same", "ngram_tree", "suffix_tree"))
@pytest.mark.parametrize("batch", [1, 4])
def test_seeded_exact_with_penalties_equals_plain_seeded(make_tiny_model, tiny_tokenizer, method, batch):
    model = make_tiny_model("qwen2")
    prompts = TREE_PROMPTS if method.endswith("_tree") else PROMPTS
    requests = [(prompts[i % len(prompts)], SamplingParams(seed=i, max_tokens=24, **SAMPLED[i % 4])) for i in range(8)]
    plain, _ = outputs(model, tiny_tokenizer, requests)
    speculative, accepted = [], 0
    for start in range(0, len(requests), batch):
        group, engine = outputs(model, tiny_tokenizer, requests[start : start + batch],
                                method_drafter(method, make_tiny_model), 3)
        speculative += group
        accepted += engine.metrics.accepted_tokens
    assert speculative == plain
    assert accepted > 0


# ---- rejection sampling: chi-square against the penalized target ------------------------------------------------
CHI_PENALTIES = dict(temperature=1.0, max_tokens=4, presence_penalty=1.5, frequency_penalty=0.5,
                     repetition_penalty=1.2, logit_bias={1: 2.5}, min_p=0.02)


class RepeatDrafter(Drafter):
    """Point-mass drafts of one token repeated: the bias makes the first accepted often, the penalties make the
    next ones depend on the draft prefix, so a verifier that leaves the prefix out accepts them too often."""

    def add_request(self, request_id, prompt_token_ids, params, noise):
        pass

    def propose(self, request_ids, max_draft_tokens):
        return [Draft(token_ids=(1,) * budget) for budget in max_draft_tokens]

    def observe(self, request_id, token_ids):
        pass

    def remove_request(self, request_id):
        pass


def penalty_drafter(kind, draft):
    return RepeatDrafter() if kind == "repeat" else chi_square_drafter(kind, draft)


def penalized_joint(model, params):
    """P(t2, t3) of the penalized target, enumerated: each position processed with the output before it."""
    from specdec.cache.kv_cache import KVCache
    from specdec.models.batch import ForwardBatch
    from specdec.verify.sampling import logits_to_probs

    def probs(output):
        cache = KVCache(model.config, 1, 64, dtype=model.kv_cache_dtype)
        logits = model.forward(ForwardBatch.build([CHI_PROMPT + output], [0], [0], all_logits=False), cache)
        return logits_to_probs(process_logits(logits, params, CHI_PROMPT, output, [()]), params)[0].double()

    first = probs([])
    joint = torch.zeros(SMALL_VOCAB, SMALL_VOCAB, dtype=torch.float64)
    for t1 in range(SMALL_VOCAB):
        second = probs([t1])
        for t2 in range(SMALL_VOCAB):
            joint[t2] += first[t1] * second[t2] * probs([t1, t2])
    return joint


@pytest.fixture(scope="module")
def penalized_models(make_tiny_model):
    target = make_tiny_model("qwen2", seed=3, vocab_size=SMALL_VOCAB)
    draft = make_tiny_model("qwen2", seed=4, vocab_size=SMALL_VOCAB)
    return target, draft, penalized_joint(target, SamplingParams(**CHI_PENALTIES))


@pytest.mark.parametrize("drafter_kind", ["draft_model", "repeat"])
def test_rejection_sampling_with_penalties_matches_penalized_target(penalized_models, tiny_tokenizer, drafter_kind):
    target, draft, joint = penalized_models
    counts = sampled_counts(target, tiny_tokenizer, penalty_drafter(drafter_kind, draft), CHI_PENALTIES)
    assert chi_square_p_value(counts, joint) > 1e-3


@pytest.mark.parametrize("drafter_kind", ["repeat"])
def test_chi_square_detects_penalties_without_the_draft_prefix(penalized_models, tiny_tokenizer, monkeypatch,
                                                               drafter_kind):
    target, draft, joint = penalized_models
    monkeypatch.setattr(engine_module, "chain_paths", lambda draft_ids: [()] * (len(draft_ids) + 1))
    counts = sampled_counts(target, tiny_tokenizer, penalty_drafter(drafter_kind, draft), CHI_PENALTIES)
    p_value = chi_square_p_value(counts, joint)
    assert p_value < 1e-6, p_value


def test_stop_token_ids_end_like_eos_and_wait_for_min_tokens(make_tiny_model, tiny_tokenizer):
    model = make_tiny_model("qwen2")
    free, _ = generate(model, tiny_tokenizer, [(PROMPTS[1], SamplingParams(max_tokens=12, ignore_eos=True))])
    stop_id = free[0].output_token_ids[2]
    stopped, _ = generate(
        model, tiny_tokenizer, [(PROMPTS[1], SamplingParams(max_tokens=12, stop_token_ids=(stop_id,)))]
    )
    assert stopped[0].output_token_ids == free[0].output_token_ids[: free[0].output_token_ids.index(stop_id) + 1]
    assert stopped[0].finish_reason == "stop"
    late, _ = generate(model, tiny_tokenizer, [(PROMPTS[1], SamplingParams(max_tokens=12, min_tokens=8,
                                                                           stop_token_ids=(stop_id,)))])
    assert stop_id not in late[0].output_token_ids[:8]


def test_engine_refuses_token_ids_outside_the_vocabulary(make_tiny_model, tiny_tokenizer):
    engine = Engine(make_tiny_model("qwen2"), tiny_tokenizer, max_num_seqs=1, max_model_len=64)
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request([1, 2], SamplingParams(logit_bias={10**7: 1.0}))
