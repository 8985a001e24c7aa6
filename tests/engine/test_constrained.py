"""Constrained decoding under speculation, end to end on tiny models (verify/grammar.py).

Greedy speculative output equals plain constrained output for every drafter at batch 1 and 3, and every finished
output parses and validates against its schema; rejection sampling follows the masked target distribution
(chi-square); seeded exact acceptance equals plain seeded constrained sampling."""
import json
from collections import Counter

import jsonschema
import pytest
import torch

from specdec.config import GuidedDecoding, SamplingParams
from specdec.engine import engine as engine_module
from specdec.engine.engine import Engine
from specdec.verify.grammar import GrammarMatcher, mask_logits
from test_seeded_exact import generate, method_drafter
from test_speculative import CHI_PROMPT, SMALL_VOCAB, chi_square_drafter, chi_square_p_value, make_drafter

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "b": {"enum": ["x", "yy", "zzz"]}, "c": {"type": "boolean"}},
          "required": ["a", "b", "c"], "additionalProperties": False}
# no free whitespace: a random model would fill it for ever (llguidance's JSON option)
COMPACT = {"x-guidance": {"whitespace_flexible": False}}
CONSTRAINTS = {
    "schema": GuidedDecoding(json_schema=dict(SCHEMA, **COMPACT)),
    "object": GuidedDecoding(json_object=True),
    "regex": GuidedDecoding(regex=r"(ab|cd)+e"),
}
PROMPTS = [[5, 17, 42, 5, 17, 42, 5, 17], [99, 3, 250, 77, 12, 8, 130, 64, 201, 99, 3, 250, 77], [33, 34]]
METHODS = ("ngram", "suffix", "draft_model", "draft_model_same", "ngram_tree", "suffix_tree")  # trees: chains verified


def texts(tokenizer, seqs):
    return [tokenizer.decode([t for t in seq.output_token_ids if t not in tokenizer.eos_token_ids]) for seq in seqs]


@pytest.mark.parametrize("name", CONSTRAINTS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_speculative_constrained_equals_plain(make_tiny_model, tiny_tokenizer, name, method, batch):
    model = make_tiny_model("qwen2")
    prompts = PROMPTS[:batch] if batch > 1 else [PROMPTS[1]]
    params = SamplingParams(max_tokens=40, guided=CONSTRAINTS[name])
    plain, _ = generate(model, tiny_tokenizer, [(p, params) for p in prompts])
    speculative, engine = generate(model, tiny_tokenizer, [(p, params) for p in prompts],
                                   method_drafter(method, make_tiny_model), 4)
    assert [s.output_token_ids for s in speculative] == [s.output_token_ids for s in plain]
    if method == "draft_model_same" and name == "object":  # the target as its own draft: valid JSON, accepted
        assert engine.metrics.accepted_tokens > 0
    if method == "draft_model" and name == "schema":  # a random draft's tokens are forbidden; the forced keys are not
        assert engine.metrics.accepted_tokens > 0
    for seq, text in zip(plain, texts(tiny_tokenizer, plain)):
        if seq.finish_reason == "stop":
            if name == "regex":
                assert text.endswith("e") and set(text) <= set("abcde")
            else:
                value = json.loads(text)
                assert isinstance(value, dict)
                if name == "schema":
                    jsonschema.validate(value, SCHEMA)


@pytest.mark.parametrize("name", ["schema", "object"])
def test_constrained_outputs_parse_and_validate(make_tiny_model, tiny_tokenizer, name):
    model = make_tiny_model("qwen2")
    requests = [(PROMPTS[i % 3], SamplingParams(temperature=0.9, seed=i, max_tokens=64, guided=CONSTRAINTS[name]))
                for i in range(6)]
    seqs, _ = generate(model, tiny_tokenizer, requests, make_drafter("ngram", make_tiny_model, "qwen2"), 3)
    finished = [(seq, text) for seq, text in zip(seqs, texts(tiny_tokenizer, seqs)) if seq.finish_reason == "stop"]
    assert len(finished) >= (6 if name == "schema" else 1)
    for _, text in finished:
        value = json.loads(text)
        if name == "schema":
            jsonschema.validate(value, SCHEMA)


def test_seeded_exact_constrained_equals_plain_seeded(make_tiny_model, tiny_tokenizer):
    model = make_tiny_model("qwen2")
    requests = [(PROMPTS[i % 3], SamplingParams(temperature=1.0, seed=i, max_tokens=32, guided=CONSTRAINTS["schema"]))
                for i in range(4)]
    plain, _ = generate(model, tiny_tokenizer, requests)
    for method in METHODS:
        speculative, _ = generate(model, tiny_tokenizer, requests, method_drafter(method, make_tiny_model), 3)
        assert [s.output_token_ids for s in speculative] == [s.output_token_ids for s in plain], method


def test_invalid_constraint_refused_at_request(make_tiny_model, tiny_tokenizer):
    engine = Engine(make_tiny_model("qwen2"), tiny_tokenizer, max_num_seqs=1, max_model_len=64)
    with pytest.raises(ValueError, match="invalid regex constraint"):
        engine.add_request([1, 2], SamplingParams(guided=GuidedDecoding(regex="a(b")))
    assert not engine.has_unfinished()


# ---- rejection sampling: chi-square against the masked target ---------------------------------------------------
# ids 0..7 of the tiny tokenizer are the bytes ! " # $ % & ' (; the grammar repeats ! then one of # %, then a forced
# &, so the mask at a draft position depends on the draft before it, and forced tokens fill cut drafts
CHI_GUIDED = GuidedDecoding(regex=r"(!(#|%)&)*!?")
CHI_PARAMS = dict(temperature=1.0, max_tokens=4, guided=CHI_GUIDED)
CHI_SAMPLES = 6000


def masked_joint(model, tokenizer):
    """P(t2, t3) of the masked target, enumerated."""
    from specdec.cache.kv_cache import KVCache
    from specdec.models.batch import ForwardBatch
    from specdec.verify.sampling import logits_to_probs

    params = SamplingParams(**CHI_PARAMS)
    matcher = GrammarMatcher(CHI_GUIDED, tokenizer, SMALL_VOCAB, tokenizer.eos_token_ids)

    def probs(output):
        cache = KVCache(model.config, 1, 64, dtype=model.kv_cache_dtype)
        logits = model.forward(ForwardBatch.build([CHI_PROMPT + output], [0], [0], all_logits=False), cache)
        for token in output:
            matcher.advance(token)
        masked = mask_logits(logits, matcher.masks_along((), 1))
        matcher._matcher.rollback(len(output))
        return logits_to_probs(masked, params)[0].double()

    joint = torch.zeros(SMALL_VOCAB, SMALL_VOCAB, dtype=torch.float64)
    first = probs([])
    for t1 in range(SMALL_VOCAB):
        if first[t1] == 0:
            continue
        second = probs([t1])
        for t2 in range(SMALL_VOCAB):
            if second[t2] > 0:
                joint[t2] += first[t1] * second[t2] * probs([t1, t2])
    return joint


def sampled_counts(model, tokenizer, drafter, acceptance="rejection", k=3):
    counts = Counter()
    for start in range(0, CHI_SAMPLES, 32):
        engine = Engine(model, tokenizer, max_num_seqs=32, max_model_len=64, drafter=drafter, num_speculative_tokens=k,
                        max_verify_tokens=4096, acceptance=acceptance)
        seqs = [engine.add_request(CHI_PROMPT, SamplingParams(seed=seed, **CHI_PARAMS))
                for seed in range(start, start + 32)]
        while engine.has_unfinished():
            engine.step()
        counts.update(tuple(seq.output_token_ids[1:3]) for seq in seqs)
    return counts


@pytest.fixture(scope="module")
def constrained_models(make_tiny_model, tiny_tokenizer):
    target = make_tiny_model("qwen2", seed=3, vocab_size=SMALL_VOCAB)
    draft = make_tiny_model("qwen2", seed=4, vocab_size=SMALL_VOCAB)
    return target, draft, masked_joint(target, tiny_tokenizer)


@pytest.mark.parametrize("acceptance,drafter_kind", [("rejection", "draft_model"), ("rejection", "point_mass")])
def test_constrained_sampling_matches_masked_target(constrained_models, tiny_tokenizer, acceptance, drafter_kind):
    target, draft, joint = constrained_models
    counts = sampled_counts(target, tiny_tokenizer, chi_square_drafter(drafter_kind, draft), acceptance)
    assert chi_square_p_value(counts, joint) > 1e-3


def test_forced_tokens_fill_a_cut_draft(make_tiny_model, tiny_tokenizer):
    from specdec.drafters.base import Draft

    engine = Engine(make_tiny_model("qwen2"), tiny_tokenizer, max_num_seqs=1, max_model_len=64)
    seq = engine.add_request([1, 2], SamplingParams(guided=CONSTRAINTS["schema"]))
    encode = lambda text: tuple(tiny_tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    cut = engine_module._within_grammar(seq, Draft(encode("{x   ")))
    assert cut.token_ids == encode('{"a":')  # the valid "{", then the key the schema forces
    probs = torch.full((5, 300), 1 / 300)
    sampled = engine_module._within_grammar(seq, Draft(encode("{x   "), probs))
    assert sampled.token_ids == encode('{"a":') and sampled.draft_probs[1:].max(dim=1).values.eq(1).all()


def test_sampled_draft_keeps_its_forbidden_token_under_rejection(make_tiny_model, tiny_tokenizer):
    """A sampled draft cut at a forbidden token would bias rejection sampling; it keeps the token (rejected for
    sure), while point-mass drafts and exact acceptance cut before it."""
    from specdec.drafters.base import Draft

    engine = Engine(make_tiny_model("qwen2", seed=3, vocab_size=SMALL_VOCAB), tiny_tokenizer, max_num_seqs=2,
                    max_model_len=64, acceptance="rejection")
    seq = engine.add_request(CHI_PROMPT, SamplingParams(seed=0, **CHI_PARAMS))
    forbidden_second = (0, 0, 2)  # ! then ! again: the second is forbidden (after "!" comes "#" or "%")
    probs = torch.full((3, SMALL_VOCAB), 1 / SMALL_VOCAB)
    assert engine_module._within_grammar(seq, Draft(forbidden_second, probs)).token_ids == (0, 0)
    assert engine_module._within_grammar(seq, Draft(forbidden_second)).token_ids == (0,)
    assert engine_module._within_grammar(seq, Draft((0, 2, 5), probs)).token_ids == (0, 2, 5)
    assert engine_module._within_grammar(seq, Draft((0, 2, 0))).token_ids == (0, 2, 5)  # "&" forced after "!#"
