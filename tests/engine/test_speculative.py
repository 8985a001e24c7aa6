"""Speculative decoding end to end on tiny models: greedy output identical to plain output for every
drafter (batch 1 and batch 4 of mixed lengths), and the sampled distribution equal to the target's (chi-square,
each with a negative control: rejection and exact acceptance, temperature != 1, top-k, top-p, the bonus token)."""
import itertools
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from specdec.cache.kv_cache import KVCache
from specdec.config import SamplingParams
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.suffix import SuffixDrafter
from specdec.models.batch import ForwardBatch
from specdec.engine.draft_length.policy import BatchDraftPolicy
from specdec.engine import engine as engine_module
from specdec.engine.engine import Engine
from specdec.engine.sequence import TokenKind
from specdec.verify import rejection
from specdec.verify.sampling import logits_to_probs

ARCHITECTURES = ("llama", "qwen2", "gemma3")
METHODS = ("ngram", "suffix", "draft_model", "draft_model_same", "draft_model_reduced")
# mixed lengths, with repetition so that n-gram and suffix drafts get accepted
PROMPTS = [
    [5, 17, 42, 5, 17, 42, 5, 17],
    [99, 3, 250, 77, 12, 8, 130, 64, 201, 99, 3, 250, 77],
    [33, 34],
    [7, 180, 91, 45, 2, 160, 222, 1, 2, 3, 4, 5, 6, 7, 180, 91, 45, 2, 160],
]


def make_drafter(method, make_tiny_model, architecture, k_max_len=256, **overrides):
    if method == "ngram":
        return NgramDrafter(prompt_lookup_max=3, prompt_lookup_min=1)
    if method == "suffix":
        return SuffixDrafter(max_depth=16, min_token_prob=0.05, cache_requests=8)
    draft_seed = 0 if method == "draft_model_same" else 1  # the target itself as draft: everything accepted
    # reduced: the draft vocabulary is half the tokens, so some target tokens can never be drafted
    draft_token_ids = range(0, 300, 2) if method == "draft_model_reduced" else None
    return DraftModelDrafter(make_tiny_model(architecture, seed=draft_seed, **overrides), max_num_seqs=4,
                             max_model_len=k_max_len, draft_token_ids=draft_token_ids)


def run(model, tokenizer, prompts, params, drafter=None, k=4, max_num_seqs=4, speculative=True, draft_policy=None):
    engine = Engine(model, tokenizer, max_num_seqs=max_num_seqs, max_model_len=256, drafter=drafter,
                    num_speculative_tokens=k if drafter else 0, draft_policy=draft_policy)
    seqs = [engine.add_request(prompt, params, speculative=speculative) for prompt in prompts]
    while engine.has_unfinished():
        engine.step()
    return seqs, engine


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculative_output_identical_to_plain(make_tiny_model, tiny_tokenizer, architecture, method, batch):
    model = make_tiny_model(architecture)
    params = SamplingParams(max_tokens=40)
    prompts = PROMPTS[:batch] if batch > 1 else [PROMPTS[1]]
    plain, _ = run(model, tiny_tokenizer, prompts, params)
    spec, engine = run(model, tiny_tokenizer, prompts, params, make_drafter(method, make_tiny_model, architecture))
    for plain_seq, spec_seq in zip(plain, spec):
        assert spec_seq.output_token_ids == plain_seq.output_token_ids
        assert spec_seq.finish_reason == plain_seq.finish_reason
    assert engine.metrics.verify_steps > 0 and engine.metrics.drafted_tokens > 0
    if method == "draft_model_same":
        assert engine.metrics.acceptance_rate == 1.0
        assert all(kind != TokenKind.RECOVERED for seq in spec for kind in seq.token_kinds)


def test_speculation_accepts_drafts_and_labels_tokens(make_tiny_model, tiny_tokenizer):
    model = make_tiny_model("qwen2")
    seqs, engine = run(model, tiny_tokenizer, PROMPTS, SamplingParams(max_tokens=40),
                       make_drafter("draft_model_same", make_tiny_model, "qwen2"), k=3)
    kinds = Counter(kind for seq in seqs for kind in seq.token_kinds)
    assert kinds[TokenKind.ACCEPTED] > 0 and kinds[TokenKind.BONUS] > 0
    assert engine.metrics.mean_accepted_length > 3.0  # k=3 with every draft accepted: close to 4 tokens per step


def test_speculation_opt_out_per_request(make_tiny_model, tiny_tokenizer):
    model = make_tiny_model("llama")
    seqs, engine = run(
        model, tiny_tokenizer, PROMPTS, SamplingParams(max_tokens=20), NgramDrafter(3, 1), speculative=False
    )
    assert engine.metrics.verify_steps == 0 and all(seq.output_token_ids for seq in seqs)


def test_stop_string_and_max_tokens_cut_exactly_like_plain(make_tiny_model, tiny_tokenizer):
    model = make_tiny_model("qwen2")
    plain, _ = run(model, tiny_tokenizer, PROMPTS, SamplingParams(max_tokens=30))
    stop_text = plain[1].text[5:7]
    params = SamplingParams(max_tokens=13, stop=(stop_text,))
    plain, _ = run(model, tiny_tokenizer, PROMPTS, params)
    spec, _ = run(
        model, tiny_tokenizer, PROMPTS, params, make_drafter("draft_model_same", make_tiny_model, "qwen2"), k=5
    )
    assert [s.output_token_ids for s in spec] == [s.output_token_ids for s in plain]
    assert [s.text for s in spec] == [s.text for s in plain]
    assert plain[1].finish_reason == "stop" and stop_text not in plain[1].text


# ---- sampling: chi-square against the target's exact distribution ---------------------------------------
SMALL_VOCAB = 8
CHI_PROMPT = [0, 1, 2, 3, 4, 5, 6, 7, 0, 2, 4, 6, 1, 3, 5, 7]  # every token recurs: n-gram drafts always exist
CHI_PARAMS = dict(temperature=1.0, max_tokens=4)
CHI_SAMPLES = 6000
# temperature != 1, top-k and top-p: the draft side and the target side must process their logits alike
# (temperatures above 1 flatten the tiny target, whose most likely pair of tokens has 70 % of the mass at 1.0, so
# that top-k and top-p cut tokens that still matter and a wrong verifier shows)
FILTERED_PARAMS = {"temperature-1.8": dict(temperature=1.8, max_tokens=4),
                   "top-k-3": dict(temperature=2.0, top_k=3, max_tokens=4),
                   "top-p-0.8": dict(temperature=2.5, top_p=0.8, max_tokens=4)}


def next_probs(model, tokens, params):
    cache = KVCache(model.config, 1, 64, dtype=model.kv_cache_dtype)
    logits = model.forward(ForwardBatch.build([tokens], [0], [0], all_logits=False), cache)
    return logits_to_probs(logits, params)[0].double()  # [vocab]


def exact_distribution_of_tokens_2_and_3(model, params):
    """P(t2, t3) = sum_t1 P(t1) P(t2 | t1) P(t3 | t1, t2), enumerated with the target itself."""
    first = next_probs(model, CHI_PROMPT, params)
    joint = torch.zeros(SMALL_VOCAB, SMALL_VOCAB, dtype=torch.float64)
    for t1 in range(SMALL_VOCAB):
        second = next_probs(model, CHI_PROMPT + [t1], params)
        for t2 in range(SMALL_VOCAB):
            joint[t2] += first[t1] * second[t2] * next_probs(model, CHI_PROMPT + [t1, t2], params)
    return joint


def sampled_counts(model, tokenizer, drafter, params=CHI_PARAMS, acceptance="rejection", k=3):
    """Counts of output tokens (2, 3) over CHI_SAMPLES seeded requests, in batches of 32 that draft k tokens."""
    counts = Counter()
    for start in range(0, CHI_SAMPLES, 32):
        request_params = [SamplingParams(seed=seed, **params) for seed in range(start, start + 32)]
        engine = Engine(model, tokenizer, max_num_seqs=32, max_model_len=64, drafter=drafter, num_speculative_tokens=k,
                        max_verify_tokens=4096, acceptance=acceptance)  # keep speculating at batch 32
        seqs = [engine.add_request(CHI_PROMPT, p) for p in request_params]
        while engine.has_unfinished():
            engine.step()
        counts.update(tuple(seq.output_token_ids[1:3]) for seq in seqs)
    return counts


def chi_square_p_value(counts, joint):
    """Pearson's chi-square of the sampled (t2, t3) pairs against joint; cells expecting fewer than 5 are pooled."""
    cells = list(itertools.product(range(SMALL_VOCAB), repeat=2))
    expected = torch.tensor([float(joint[c]) for c in cells]) * sum(counts.values())
    observed = torch.tensor([float(counts[c]) for c in cells])
    big = expected >= 5  # pool the rare cells into one
    expected_bins = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    observed_bins = torch.cat([observed[big], observed[~big].sum(0, keepdim=True)])
    if float(expected_bins[-1]) == 0:  # top-k / top-p: the rare cells are all impossible ones
        if float(observed_bins[-1]) > 0:
            return 0.0  # an impossible pair was sampled
        expected_bins, observed_bins = expected_bins[:-1], observed_bins[:-1]
    observed_bins = observed_bins * expected_bins.sum() / observed_bins.sum()
    return chisquare(observed_bins.numpy(), expected_bins.numpy()).pvalue


@pytest.fixture(scope="module")
def small_vocab_models(make_tiny_model):
    target = make_tiny_model("qwen2", seed=3, vocab_size=SMALL_VOCAB)
    draft = make_tiny_model("qwen2", seed=4, vocab_size=SMALL_VOCAB)
    return target, draft, exact_distribution_of_tokens_2_and_3(target, SamplingParams(**CHI_PARAMS))


def chi_square_drafter(kind, draft):
    if kind == "point_mass":
        return NgramDrafter(2, 1)
    # reduced: the draft distribution covers 5 of the 8 tokens (zero elsewhere)
    return DraftModelDrafter(draft, 32, 64, draft_token_ids=[0, 2, 3, 5, 7] if kind == "draft_model_reduced" else None)


@pytest.mark.parametrize("acceptance,drafter_kind", [("rejection", "draft_model"), ("rejection", "draft_model_reduced"),
                                                     ("rejection", "point_mass"), ("exact", "draft_model"),
                                                     ("exact", "point_mass")])
def test_speculative_sampling_matches_target_distribution(small_vocab_models, tiny_tokenizer, acceptance, drafter_kind):
    target, draft, joint = small_vocab_models
    drafter = chi_square_drafter(drafter_kind, draft)
    assert chi_square_p_value(sampled_counts(target, tiny_tokenizer, drafter, acceptance=acceptance), joint) > 1e-3


@pytest.mark.parametrize("drafter_kind", ["draft_model", "draft_model_reduced", "point_mass"])
def test_chi_square_detects_a_wrong_residual(small_vocab_models, tiny_tokenizer, monkeypatch, drafter_kind):
    target, draft, joint = small_vocab_models
    monkeypatch.setattr(rejection, "residual_probs", lambda target_probs, draft_probs: target_probs)
    drafter = chi_square_drafter(drafter_kind, draft)
    assert chi_square_p_value(sampled_counts(target, tiny_tokenizer, drafter), joint) < 1e-6


@pytest.fixture(scope="module")
def filtered_joints(small_vocab_models):
    target = small_vocab_models[0]
    return {name: exact_distribution_of_tokens_2_and_3(target, SamplingParams(**params))
            for name, params in FILTERED_PARAMS.items()}


@pytest.mark.parametrize("name", FILTERED_PARAMS)
def test_rejection_sampling_with_temperature_top_k_top_p_matches_target(small_vocab_models, filtered_joints,
                                                                       tiny_tokenizer, name):
    target, draft, _ = small_vocab_models
    counts = sampled_counts(target, tiny_tokenizer, chi_square_drafter("draft_model", draft), FILTERED_PARAMS[name])
    assert chi_square_p_value(counts, filtered_joints[name]) > 1e-3


@pytest.mark.parametrize("name", FILTERED_PARAMS)
def test_chi_square_with_temperature_top_k_top_p_detects_a_wrong_residual(small_vocab_models, filtered_joints,
                                                                          tiny_tokenizer, monkeypatch, name):
    target, draft, _ = small_vocab_models
    monkeypatch.setattr(rejection, "residual_probs", lambda target_probs, draft_probs: target_probs)
    counts = sampled_counts(target, tiny_tokenizer, chi_square_drafter("draft_model", draft), FILTERED_PARAMS[name])
    assert chi_square_p_value(counts, filtered_joints[name]) < 1e-6


# The bonus token: with the target itself as draft model and k = 1, every draft is accepted, so output token 1 is
# a draft and token 2 the step's bonus token, token 3 the next step's draft. Tokens 2 and 3 test the bonus.
def argmax_bonus(verifier, target_rows_argument):
    """`verifier` with a bonus token that is the argmax of the last target row (a known kind of bug)."""

    def wrong(*args):
        result = verifier(*args)
        if not result.bonus or result.num_drafted == 0:
            return result
        argmax = int(args[target_rows_argument][-1].argmax())
        return type(result)(result.accepted_count, result.num_drafted, (*result.token_ids[:-1], argmax))

    return wrong


@pytest.mark.parametrize("acceptance", ["rejection", "exact"])
def test_bonus_token_matches_target_distribution(small_vocab_models, tiny_tokenizer, acceptance):
    target, _, joint = small_vocab_models
    drafter = DraftModelDrafter(target, 32, 64)
    counts = sampled_counts(target, tiny_tokenizer, drafter, acceptance=acceptance, k=1)
    assert chi_square_p_value(counts, joint) > 1e-3


@pytest.mark.parametrize("acceptance", ["rejection", "exact"])
def test_chi_square_detects_an_argmax_bonus(small_vocab_models, tiny_tokenizer, monkeypatch, acceptance):
    target, _, joint = small_vocab_models
    if acceptance == "rejection":
        monkeypatch.setattr(engine_module, "verify_rejection", argmax_bonus(engine_module.verify_rejection, 2))
    else:
        monkeypatch.setattr(engine_module, "verify_exact", argmax_bonus(engine_module.verify_exact, 1))
    drafter = DraftModelDrafter(target, 32, 64)
    counts = sampled_counts(target, tiny_tokenizer, drafter, acceptance=acceptance, k=1)
    assert chi_square_p_value(counts, joint) < 1e-6


def test_logprobs_with_speculation_equal_plain(make_tiny_model, tiny_tokenizer):
    model = make_tiny_model("gemma3")
    params = SamplingParams(max_tokens=20, logprobs=3)

    def collect(drafter):
        engine = Engine(model, tiny_tokenizer, max_num_seqs=4, max_model_len=256, drafter=drafter,
                        num_speculative_tokens=4 if drafter else 0)
        for prompt in PROMPTS:
            engine.add_request(prompt, params)
        logprobs = {}
        while engine.has_unfinished():
            for output in engine.step():
                logprobs.setdefault(output.request_id, []).extend(output.new_logprobs)
        return logprobs

    plain = collect(None)
    spec = collect(make_drafter("draft_model_same", make_tiny_model, "gemma3"))
    assert spec == plain
    first = plain["0"][0]
    assert len(first.top) == 3 and first.top[0][1] >= first.logprob - 1e-6


def test_batch_draft_policy_shortens_then_switches_off_speculation():
    policy = BatchDraftPolicy(num_speculative_tokens=5, max_verify_tokens=32)
    assert [policy.draft_length(b) for b in (1, 4, 8, 15, 16, 17, 32)] == [5, 5, 3, 1, 1, 0, 0]


def test_large_batches_decode_without_drafts(make_tiny_model, tiny_tokenizer):
    model = make_tiny_model("llama")
    params = SamplingParams(max_tokens=10)
    engine = Engine(model, tiny_tokenizer, max_num_seqs=8, max_model_len=256, drafter=NgramDrafter(3, 1),
                    num_speculative_tokens=4, max_verify_tokens=8)  # 8 sequences x (1 + 1 draft) > 8 rows
    seqs = [engine.add_request(prompt, params) for prompt in PROMPTS * 2]
    while engine.has_unfinished():
        engine.step()
    assert engine.metrics.drafted_tokens == 0
    assert [seq.output_token_ids for seq in seqs] == [
        seq.output_token_ids for seq in run(model, tiny_tokenizer, PROMPTS * 2, params)[0]
    ]


class RecordingPolicy(BatchDraftPolicy):
    """A fixed policy that records the batch size the engine plans each step with."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "planned", [])
        object.__setattr__(self, "catch_ups", [])
        object.__setattr__(self, "costs", [])

    def draft_lengths(self, seqs, batch_size, catch_up_tokens=None):
        self.planned.append((len(seqs), batch_size))
        self.catch_ups.append(list(catch_up_tokens))
        return super().draft_lengths(seqs, batch_size, catch_up_tokens)

    def observe_step(self, cost):
        self.costs.append(cost)


def test_draft_policy_plans_for_the_requests_about_to_join(make_tiny_model, tiny_tokenizer):
    """While prompts are still prefilling or waiting for a slot, drafts must pay at the batch that is coming:
    the policy is asked with decoding + prefilling + (waiting up to the free slots) sequences."""
    model = make_tiny_model("llama")
    policy = RecordingPolicy(4, max_verify_tokens=32)
    engine = Engine(model, tiny_tokenizer, max_num_seqs=3, max_model_len=256, drafter=NgramDrafter(3, 1),
                    num_speculative_tokens=4, prefill_chunk=8, idle_prefill_chunk=8, draft_policy=policy)
    long_prompt = [(7 * i) % 250 + 1 for i in range(30)]  # 4 chunks of 8
    params = SamplingParams(max_tokens=6)
    engine.add_request([5, 17, 42], params)  # prefilled in the first step, decodes from the second
    for _ in range(3):
        engine.add_request(long_prompt, params)  # two get slots and prefill for several steps; one waits
    while engine.has_unfinished():
        engine.step()
    first_decoding, first_planned = policy.planned[0]
    assert first_decoding == 1 and first_planned == 3  # 1 decoding + 2 prefilling (the third waits: no free slot)
    assert all(planned >= decoding for decoding, planned in policy.planned)
    assert policy.planned[-1][1] == policy.planned[-1][0]  # nothing left to join at the end


def test_policy_sees_the_draft_models_catch_up_and_the_step_reports_it(make_tiny_model, tiny_tokenizer):
    """The first draft of each request prefills its prompt in the draft model: the policy is told so before it
    chooses k, and the step's cost names those tokens (the policy measures the catch-up's cost from them)."""
    model = make_tiny_model("qwen2")
    policy = RecordingPolicy(3, max_verify_tokens=32)
    engine = Engine(model, tiny_tokenizer, max_num_seqs=4, max_model_len=256,
                    drafter=make_drafter("draft_model_same", make_tiny_model, "qwen2"), num_speculative_tokens=3,
                    draft_policy=policy)
    prompts = PROMPTS[:2]
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=12))
    while engine.has_unfinished():
        engine.step()
    # the first token came from the prefill: 1 + prompt tokens to feed, 2 of which a steady step feeds too
    assert policy.catch_ups[0] == [len(prompt) + 1 - 2 for prompt in prompts]
    assert policy.costs[0].catch_up_tokens == sum(policy.catch_ups[0])
    assert all(catch_up == [0, 0] for catch_up in policy.catch_ups[1:])  # drafting every step: steady
    assert all(cost.catch_up_tokens == 0 for cost in policy.costs[1:])
