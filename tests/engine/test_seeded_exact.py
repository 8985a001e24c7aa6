"""Exact acceptance end to end on tiny models: seeded speculative sampling emits plain seeded sampling's tokens,
token for token, for every drafter (chains and token trees), at batch 1 and 4, whatever the draft length (fixed
k = 3 and 6, and a k drawn at random every step), beside greedy and non-speculative requests. Rejection
sampling, the other option, reproduces itself for a fixed draft length whatever the batch."""
import random

import pytest

from specdec.config import SamplingParams, SpeculativeConfig
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.engine.draft_length.policy import BatchDraftPolicy, DraftLengthPolicy
from specdec.engine.engine import Engine
from specdec.llm import LLM
from test_speculative import PROMPTS, make_drafter
from test_trees import TREE_PROMPTS, tree_drafter

SAMPLED = [dict(temperature=0.6), dict(temperature=1.0, top_k=20), dict(temperature=0.8, top_p=0.9),
           dict(temperature=1.3, top_k=50, top_p=0.95)]
NUM_SEEDS = 16
METHODS = ("ngram", "suffix", "draft_model", "draft_model_same", "draft_model_reduced", "ngram_tree", "suffix_tree")


def seeded_requests(prompts, max_tokens=24, first_seed=0):
    """NUM_SEEDS (prompt, params) pairs: the prompts and the sampling parameter sets in turn, one seed each."""
    return [(prompts[i % len(prompts)], SamplingParams(seed=first_seed + i, max_tokens=max_tokens, **SAMPLED[i % 4]))
            for i in range(NUM_SEEDS)]


def generate(model, tokenizer, requests, drafter=None, k=0, acceptance="exact", policy=None, speculative=True):
    """Runs the requests together in one engine; returns their sequences and the engine."""
    engine = Engine(model, tokenizer, max_num_seqs=len(requests), max_model_len=256, drafter=drafter,
                    num_speculative_tokens=k, acceptance=acceptance,
                    draft_policy=policy or (BatchDraftPolicy(k, max_verify_tokens=64) if drafter else None))
    seqs = [engine.add_request(prompt, params, speculative=speculative) for prompt, params in requests]
    while engine.has_unfinished():
        engine.step()
    return seqs, engine


def plain_outputs(model, tokenizer, requests):
    return [seq.output_token_ids for seq in generate(model, tokenizer, requests)[0]]


def method_drafter(method, make_tiny_model):
    if method.endswith("_tree"):
        return tree_drafter(method.removesuffix("_tree"), num_branches=4)
    return make_drafter(method, make_tiny_model, "qwen2")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("batch", [1, 4])
def test_exact_speculative_sampling_equals_plain_seeded_sampling(make_tiny_model, tiny_tokenizer, method, batch):
    model = make_tiny_model("qwen2")
    requests = seeded_requests(TREE_PROMPTS if method.endswith("_tree") else PROMPTS)
    plain = plain_outputs(model, tiny_tokenizer, requests)
    speculative, accepted, drafted = [], 0, 0
    for group, start in enumerate(range(0, NUM_SEEDS, batch)):
        k = 3 if group % 2 == 0 else 6
        seqs, engine = generate(model, tiny_tokenizer, requests[start : start + batch],
                                method_drafter(method, make_tiny_model), k)
        speculative += [seq.output_token_ids for seq in seqs]
        accepted, drafted = accepted + engine.metrics.accepted_tokens, drafted + engine.metrics.drafted_tokens
    assert speculative == plain
    assert accepted > 0  # drafts were accepted, so speculation did shape the steps
    if method == "draft_model_same":  # the target as draft model, drawing with the target's numbers: all accepted
        assert accepted == drafted


class RandomDraftLengths(DraftLengthPolicy):
    """A draft length drawn at random (0 .. maximum) for every sequence and step."""

    def __init__(self, maximum: int, seed: int) -> None:
        self.maximum = maximum
        self.random = random.Random(seed)

    def draft_lengths(self, seqs, batch_size, catch_up_tokens=None):
        return [self.random.randint(0, self.maximum) for _ in seqs]


@pytest.mark.parametrize("method", ["ngram", "draft_model", "suffix_tree"])
def test_exact_output_does_not_depend_on_the_draft_lengths(make_tiny_model, tiny_tokenizer, method):
    model = make_tiny_model("gemma3", sliding_window=3)  # drafts and trees cross the sliding window
    requests = seeded_requests(TREE_PROMPTS if method.endswith("_tree") else PROMPTS, max_tokens=30)[:4]
    plain = plain_outputs(model, tiny_tokenizer, requests)
    drafter = (tree_drafter("suffix", 4) if method == "suffix_tree"
               else make_drafter(method, make_tiny_model, "gemma3", sliding_window=3))
    seqs, engine = generate(model, tiny_tokenizer, requests, drafter, k=6, policy=RandomDraftLengths(6, seed=1))
    assert [seq.output_token_ids for seq in seqs] == plain
    assert engine.metrics.drafted_tokens > 0


def test_exact_requests_beside_greedy_and_non_speculative_ones(make_tiny_model, tiny_tokenizer):
    model = make_tiny_model("llama")
    sampled = seeded_requests(PROMPTS)[:4]
    greedy = [(prompt, SamplingParams(max_tokens=24)) for prompt in PROMPTS]
    plain = plain_outputs(model, tiny_tokenizer, sampled + greedy)
    engine = Engine(model, tiny_tokenizer, max_num_seqs=12, max_model_len=256,
                    drafter=DraftModelDrafter(make_tiny_model("llama", seed=1), max_num_seqs=12, max_model_len=256),
                    num_speculative_tokens=4,
                    draft_policy=BatchDraftPolicy(4, max_verify_tokens=128))
    seqs = [engine.add_request(prompt, params, speculative=i % 3 != 2)
            for i, (prompt, params) in enumerate(sampled + greedy)]
    while engine.has_unfinished():
        engine.step()
    assert [seq.output_token_ids for seq in seqs] == plain
    assert engine.metrics.accepted_tokens > 0


def test_rejection_sampling_reproduces_itself_for_a_fixed_draft_length_whatever_the_batch(make_tiny_model,
                                                                                        tiny_tokenizer):
    """The random numbers of a request depend only on its seed and output positions, so under rejection sampling
    too a request gives the same tokens alone and beside others when every step drafts the same k; a request
    that does not speculate gives plain sampling's tokens."""
    model = make_tiny_model("qwen2")
    requests = seeded_requests(PROMPTS)[:4]
    drafter = lambda: make_drafter("draft_model", make_tiny_model, "qwen2")  # noqa: E731
    together, engine = generate(model, tiny_tokenizer, requests, drafter(), k=4, acceptance="rejection")
    alone = [generate(model, tiny_tokenizer, [request], drafter(), k=4, acceptance="rejection")[0][0]
             for request in requests]
    assert [seq.output_token_ids for seq in together] == [seq.output_token_ids for seq in alone]
    assert engine.metrics.accepted_tokens > 0
    not_speculating, _ = generate(model, tiny_tokenizer, requests, drafter(), k=4, acceptance="rejection",
                                  speculative=False)
    assert [seq.output_token_ids for seq in not_speculating] == plain_outputs(model, tiny_tokenizer, requests)


def test_unseeded_requests_get_their_own_random_seeds(make_tiny_model, tiny_tokenizer):
    model = make_tiny_model("qwen2")
    request = (PROMPTS[1], SamplingParams(temperature=1.0, max_tokens=24))
    seqs, _ = generate(model, tiny_tokenizer, [request] * 3, make_drafter("ngram", make_tiny_model, "qwen2"), k=4)
    assert len({tuple(seq.output_token_ids) for seq in seqs}) == 3
    assert len({seq.noise.seed for seq in seqs}) == 3


def test_the_acceptance_key_is_validated_and_reaches_the_engine(make_tiny_model, tiny_tokenizer):
    config = {"method": "ngram", "num_speculative_tokens": 4}
    assert SpeculativeConfig.from_dict(config).acceptance == "exact"
    with pytest.raises(ValueError, match="SpeculativeConfig.acceptance must be one of 'exact', 'rejection', "
                                         "got 'lossless'"):
        SpeculativeConfig.from_dict({**config, "acceptance": "lossless"})
    with pytest.raises(ValueError, match="acceptance must be one of 'exact', 'rejection', got 'typical'"):
        Engine(make_tiny_model("llama"), tiny_tokenizer, acceptance="typical")
    loaded = (make_tiny_model("llama"), tiny_tokenizer)
    llm = LLM(loaded=loaded, speculative_config={**config, "acceptance": "rejection"}, draft_policy="fixed")
    assert llm.engine.acceptance == "rejection"
    assert LLM(loaded=loaded, speculative_config=config, draft_policy="fixed").engine.acceptance == "exact"
    seq = llm.engine.add_request([1, 2, 3], SamplingParams(temperature=1.0, seed=7))
    assert seq.noise.seed == 7 and not seq.noise.exact
