"""Constrained decoding under speculation, end to end on tiny models (verify/grammar.py).

Greedy speculative output equals plain constrained output for every drafter at batch 1 and 3, and every finished
output parses and validates against its schema; rejection sampling follows the masked target distribution
(chi-square), and the same chi-square rejects, with a stated power, samplers that are subtly wrong; seeded exact
acceptance equals plain seeded constrained sampling."""
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
from test_speculative import (CHI_PROMPT, SMALL_VOCAB, chi_square_drafter, chi_square_p_value,
                              exact_distribution_of_tokens_2_and_3, make_drafter, next_probs)

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


def sampled_counts(model, tokenizer, drafter, acceptance="rejection", k=3, params=CHI_PARAMS, samples=CHI_SAMPLES):
    counts = Counter()
    for start in range(0, samples, 32):
        engine = Engine(model, tokenizer, max_num_seqs=32, max_model_len=64, drafter=drafter, num_speculative_tokens=k,
                        max_verify_tokens=4096, acceptance=acceptance)
        seqs = [engine.add_request(CHI_PROMPT, SamplingParams(seed=seed, **params))
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


# ---- the chi-square's power: a grammar whose masked distribution is spread, and the bugs it must catch -----------
# Under CHI_GUIDED the masked target is nearly a point mass (after the forced "!", "%" has 0.998 of the mass), so a
# subtly wrong sampler passes its chi-square: against the one below its power is 0.001 even at 6000 samples. Here
# each pair of tokens is a first token and one of three seconds that depend on it (ids 0..7 are ! " # $ % & ' ();
# at temperature 2 the masked pairs (t2, t3) fill 13 cells of expected count >= 5 at 1024 samples.
#
# The bug: a sampled draft cut before its first forbidden token, as point-mass drafts are, instead of kept for
# rejection sampling to reject (engine._within_grammar). The output stays grammatical; its distribution does not:
# when the draft is cut, the target samples from its masked distribution q instead of the residual max(0, q - p).
# With k = 1 that sampler's joint of (t2, t3) is enumerated below (buggy_joint); against it the chi-square at
# alpha = 1e-3 with 1024 samples has power 0.995 (noncentral chi-square, 13 degrees of freedom, noncentrality 57),
# and test_chi_square_power_against_the_bugs measures >= 0.99 by simulating the test on draws from that joint.
# Against the unmasked target the power is 1 - (1 - 0.90) ** 1024 = 1: 90 % of its mass is on forbidden pairs.
POWER_GUIDED = GuidedDecoding(regex=r"(![#%&]|\"[$&(]|[#$][!\"'])*")
POWER_PARAMS = dict(temperature=2.0, max_tokens=4, guided=POWER_GUIDED)
POWER_SAMPLES = 1024
ALPHA = 1e-3  # every chi-square test here accepts at p > ALPHA
SIMULATED_TESTS = 1000


def masked_next_probs(model, tokenizer, prefix):
    """[vocab] the masked target's next-token distribution after CHI_PROMPT + prefix, and the grammar's mask."""
    matcher = GrammarMatcher(POWER_GUIDED, tokenizer, SMALL_VOCAB, tokenizer.eos_token_ids)
    for token in prefix:
        assert matcher.advance(token)
    mask = matcher.allowed()
    probs = next_probs(model, CHI_PROMPT + prefix, SamplingParams(**POWER_PARAMS)).masked_fill(~mask, 0)
    return probs / probs.sum(), mask


def rejection_step(target, draft, tokenizer, prefix, cut_sampled_drafts):
    """One k = 1 step after prefix: ([vocab] P(emitted token), [vocab] P(the draft token, accepted))."""
    target_probs, mask = masked_next_probs(target, tokenizer, prefix)
    draft_probs = next_probs(draft, CHI_PROMPT + prefix, SamplingParams(**POWER_PARAMS))
    accept = torch.clamp(target_probs / draft_probs, max=1.0)
    accepted = draft_probs * accept  # 0 on forbidden tokens
    residual = torch.clamp(target_probs - draft_probs, min=0)
    residual = residual / residual.sum()
    if cut_sampled_drafts:  # a forbidden draft leaves no draft: the target samples alone
        rejected_allowed = (draft_probs * (1 - accept))[mask].sum()
        return accepted + rejected_allowed * residual + draft_probs[~mask].sum() * target_probs, accepted
    return accepted + (1 - accepted.sum()) * residual, accepted


def k1_joint(target, draft, tokenizer, cut_sampled_drafts):
    """P(t2, t3) of rejection sampling with k = 1: t1 from the prefill, t2 from the first step; t3 is that step's
    bonus when t2 was the accepted draft, else the second step's token."""
    joint = torch.zeros(SMALL_VOCAB, SMALL_VOCAB, dtype=torch.float64)
    first, _ = masked_next_probs(target, tokenizer, [])
    for t1 in torch.nonzero(first).flatten().tolist():
        emitted, accepted = rejection_step(target, draft, tokenizer, [t1], cut_sampled_drafts)
        for t2 in torch.nonzero(emitted).flatten().tolist():
            bonus, _ = masked_next_probs(target, tokenizer, [t1, t2])
            after, _ = rejection_step(target, draft, tokenizer, [t1, t2], cut_sampled_drafts)
            joint[t2] += first[t1] * (accepted[t2] * bonus + (emitted[t2] - accepted[t2]) * after)
    return joint


def rejection_rate(null_joint, sampled_joint, samples, seed=0):
    """The share of SIMULATED_TESTS chi-square tests against null_joint, each on `samples` pairs drawn from
    sampled_joint, that reject (p <= ALPHA): the test's power, or its size when sampled_joint is null_joint."""
    generator = torch.Generator().manual_seed(seed)
    cells = torch.multinomial(sampled_joint.flatten().float(), samples * SIMULATED_TESTS, replacement=True,
                              generator=generator).view(SIMULATED_TESTS, samples)
    rejected = 0
    for draws in cells:
        counts = Counter((cell // SMALL_VOCAB, cell % SMALL_VOCAB) for cell in draws.tolist())
        rejected += chi_square_p_value(counts, null_joint) <= ALPHA
    return rejected / SIMULATED_TESTS


@pytest.fixture(scope="module")
def power_joints(constrained_models, tiny_tokenizer):
    target, draft, _ = constrained_models
    masked = k1_joint(target, draft, tiny_tokenizer, cut_sampled_drafts=False)
    buggy = k1_joint(target, draft, tiny_tokenizer, cut_sampled_drafts=True)
    unmasked = exact_distribution_of_tokens_2_and_3(target, SamplingParams(temperature=2.0, max_tokens=4))
    return masked, buggy, unmasked


def test_chi_square_power_against_the_bugs(power_joints, constrained_models, tiny_tokenizer):
    masked, buggy, unmasked = power_joints
    target, _, _ = constrained_models
    # the enumeration of correct rejection sampling is the masked target's chain rule
    chain = torch.zeros(SMALL_VOCAB, SMALL_VOCAB, dtype=torch.float64)
    first, _ = masked_next_probs(target, tiny_tokenizer, [])
    for t1 in torch.nonzero(first).flatten().tolist():
        second, _ = masked_next_probs(target, tiny_tokenizer, [t1])
        for t2 in torch.nonzero(second).flatten().tolist():
            chain[t2] += first[t1] * second[t2] * masked_next_probs(target, tiny_tokenizer, [t1, t2])[0]
    assert torch.allclose(masked, chain, atol=1e-9)
    assert int((masked * POWER_SAMPLES >= 5).sum()) >= 12  # spread: the chi-square has cells to compare
    assert 0.5 * float((buggy - masked).abs().sum()) > 0.05  # total variation of the bug
    assert rejection_rate(masked, masked, POWER_SAMPLES) <= 0.01  # size: a right sampler passes
    assert rejection_rate(masked, buggy, POWER_SAMPLES) >= 0.99  # power against cut sampled drafts
    assert rejection_rate(masked, unmasked, POWER_SAMPLES) == 1.0  # power against an unmasked target


def cut_sampled_drafts(original):
    """engine._within_grammar with the bug: a sampled draft is cut before its first forbidden token."""
    from specdec.drafters.base import Draft

    def within_grammar(seq, draft):
        if seq.grammar is None or draft.draft_probs is None or not draft.token_ids:
            return original(seq, draft)
        keep = seq.grammar.valid_prefix(draft.token_ids)
        return Draft(draft.token_ids[:keep], draft.draft_probs[:keep] if keep else None)

    return within_grammar


@pytest.mark.parametrize("bug", [None, "cut_sampled_drafts"])
def test_powered_chi_square_passes_the_engine_and_rejects_its_bug(power_joints, constrained_models, tiny_tokenizer,
                                                                  monkeypatch, bug):
    """The engine's rejection sampling (draft model, k = 1) passes; with sampled drafts cut it is rejected, and its
    counts fit the enumerated buggy joint (so the enumeration that gives the power is the bug's distribution).
    The draft model drafts without the grammar here (as a drafter that ignores `constrain` does), so that its
    drafts hit forbidden tokens: the case the engine must handle."""
    from specdec.drafters.base import Drafter
    from specdec.drafters.draft_model import DraftModelDrafter

    masked, buggy, _ = power_joints
    target, draft, _ = constrained_models
    monkeypatch.setattr(DraftModelDrafter, "constrain", Drafter.constrain)
    if bug:
        monkeypatch.setattr(engine_module, "_within_grammar", cut_sampled_drafts(engine_module._within_grammar))
    counts = sampled_counts(target, tiny_tokenizer, chi_square_drafter("draft_model", draft), k=1,
                            params=POWER_PARAMS, samples=POWER_SAMPLES)
    if bug:
        assert chi_square_p_value(counts, masked) <= ALPHA
        assert chi_square_p_value(counts, buggy) > ALPHA
    else:
        assert chi_square_p_value(counts, masked) > ALPHA


def test_an_off_by_one_grammar_state_is_stopped_at_emission(constrained_models, tiny_tokenizer, monkeypatch):
    """Verify rows masked with the state one draft token behind let the target emit a token the grammar forbids;
    the sequence refuses it (Sequence.append), so that bug never reaches the chi-square."""
    target, draft, _ = constrained_models
    masks_along = GrammarMatcher.masks_along

    def one_behind(self, token_ids, rows):
        masks = masks_along(self, token_ids, rows)
        return torch.cat([masks[:1], masks[:-1]])

    monkeypatch.setattr(GrammarMatcher, "masks_along", one_behind)
    with pytest.raises(RuntimeError, match="emitted against the request's grammar"):
        sampled_counts(target, tiny_tokenizer, chi_square_drafter("draft_model", draft), k=3,
                       params=dict(POWER_PARAMS, max_tokens=16), samples=32)
