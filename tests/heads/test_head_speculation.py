"""EAGLE and Medusa heads in the engine: greedy output identical to plain decoding (batch 1 and 4, every
architecture) and sampling that reproduces the target's distribution (chi-square), the heads' draft
probabilities feeding rejection sampling — also when they draft over a reduced vocabulary."""
import pytest
import torch

from engine.test_speculative import (CHI_PARAMS, CHI_PROMPT, PROMPTS, SMALL_VOCAB, chi_square_p_value,
                                     exact_distribution_of_tokens_2_and_3, run, sampled_counts)
from specdec.config import SamplingParams
from specdec.engine.sequence import TokenKind
from specdec.verify import rejection
from test_draft_heads import ARCHITECTURES, METHODS, make_head_drafter, train, training_sequences


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_output_with_a_head_identical_to_plain(make_tiny_model, tiny_tokenizer, trained_heads, architecture,
                                                      method, batch):
    model = make_tiny_model(architecture)
    params = SamplingParams(max_tokens=40)
    prompts = PROMPTS[:batch] if batch > 1 else [PROMPTS[1]]
    plain, _ = run(model, tiny_tokenizer, prompts, params)
    drafter = make_head_drafter(trained_heads(architecture, method), model)
    spec, engine = run(model, tiny_tokenizer, prompts, params, drafter, k=4)
    assert [s.output_token_ids for s in spec] == [s.output_token_ids for s in plain]
    assert [s.finish_reason for s in spec] == [s.finish_reason for s in plain]
    assert engine.metrics.drafted_tokens > 0 and engine.metrics.accepted_tokens > 0  # the trained head gets accepted
    assert any(kind == TokenKind.ACCEPTED for seq in spec for kind in seq.token_kinds)
    assert not drafter.states  # every request removed


@pytest.mark.parametrize("method", METHODS)
def test_trained_head_gets_more_drafts_accepted_than_an_untrained_one(make_tiny_model, tiny_tokenizer, trained_heads,
                                                                     method):
    model = make_tiny_model("qwen2")
    trained = trained_heads("qwen2", method)
    untrained = train(model, tiny_tokenizer, method, steps=0)

    def accepted_length(trainer):
        drafter = make_head_drafter(trainer, model)
        return run(model, tiny_tokenizer, PROMPTS, SamplingParams(max_tokens=40), drafter, k=4)[1].metrics.mean_accepted_length

    assert accepted_length(trained) > accepted_length(untrained)


# ---- sampling: chi-square against the target's exact distribution ------------------------------------------
@pytest.fixture(scope="module")
def small_vocab_target(make_tiny_model, tiny_tokenizer):
    target = make_tiny_model("qwen2", seed=3, vocab_size=SMALL_VOCAB)
    prompts = [CHI_PROMPT] + [[(3 * i + j) % SMALL_VOCAB for j in range(4 + i % 7)] for i in range(16)]
    sequences = training_sequences(target, tiny_tokenizer, prompts, new_tokens=24)
    return target, sequences, exact_distribution_of_tokens_2_and_3(target, SamplingParams(**CHI_PARAMS))


@pytest.mark.parametrize("method, draft_vocab", [("eagle", 5), ("medusa", 5)])  # 5 of 8 tokens: reduced head
def test_sampling_with_a_head_matches_target_distribution(small_vocab_target, tiny_tokenizer, method, draft_vocab):
    target, sequences, joint = small_vocab_target
    trainer = train(target, tiny_tokenizer, method, steps=15, draft_vocab_size=draft_vocab, sequences=sequences)
    drafter = make_head_drafter(trainer, target, max_num_seqs=32, max_model_len=64)
    assert chi_square_p_value(sampled_counts(target, tiny_tokenizer, drafter), joint) > 1e-3


def test_chi_square_detects_a_wrong_residual_with_a_head(small_vocab_target, tiny_tokenizer, monkeypatch):
    target, sequences, joint = small_vocab_target
    trainer = train(target, tiny_tokenizer, "eagle", steps=15, draft_vocab_size=5, sequences=sequences)
    monkeypatch.setattr(rejection, "residual_probs", lambda target_probs, draft_probs: target_probs)
    drafter = make_head_drafter(trainer, target, max_num_seqs=32, max_model_len=64)
    assert chi_square_p_value(sampled_counts(target, tiny_tokenizer, drafter), joint) < 1e-6


def test_head_requests_prefill_their_whole_prompt_beside_a_prefix_cache(make_tiny_model, tiny_tokenizer, trained_heads):
    """The EAGLE head needs the target's hidden state at every prompt position, so its requests never copy a
    prefix; requests without speculation in the same engine do. Outputs equal plain decoding either way."""
    from specdec.engine.engine import Engine

    model = make_tiny_model("qwen2")
    prompt = PROMPTS[3]  # 19 tokens: above the store's 16-token minimum match
    params = SamplingParams(max_tokens=20)
    (plain,), _ = run(model, tiny_tokenizer, [prompt], params)
    engine = Engine(model, tiny_tokenizer, max_num_seqs=2, max_model_len=256, num_speculative_tokens=4,
                    drafter=make_head_drafter(trained_heads("qwen2", "eagle"), model), prefix_cache_tokens=4096)
    outputs = []
    for speculative in (True, True, False):
        seq = engine.add_request(prompt, params, speculative=speculative)
        while engine.has_unfinished():
            engine.step()
        outputs.append(seq)
    assert [seq.cached_prompt_tokens for seq in outputs] == [0, 0, len(prompt) - 1]
    assert all(seq.output_token_ids == plain.output_token_ids for seq in outputs)


# ---- EAGLE token trees: the chain plus runner-up leaves where the head is unsure ---------------------------
@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_output_with_an_eagle_tree_identical_to_plain(make_tiny_model, tiny_tokenizer, trained_heads,
                                                            architecture, batch):
    from specdec.drafters.heads import EagleDrafter

    model = make_tiny_model(architecture)
    trainer = trained_heads(architecture, "eagle")
    params = SamplingParams(max_tokens=40)
    prompts = PROMPTS[:batch] if batch > 1 else [PROMPTS[1]]
    plain, _ = run(model, tiny_tokenizer, prompts, params)
    chain, chain_engine = run(model, tiny_tokenizer, prompts, params, make_head_drafter(trainer, model), k=4)
    tree_drafter = EagleDrafter(trainer.head, trainer.parts, model.config.vocab_size, 4, 256, num_branches=4,
                                min_branch_prob=0.0)
    tree, tree_engine = run(model, tiny_tokenizer, prompts, params, tree_drafter, k=4)
    assert [s.output_token_ids for s in tree] == [s.output_token_ids for s in plain]
    assert [s.output_token_ids for s in chain] == [s.output_token_ids for s in plain]
    # a fork is accepted where the chain's token was rejected: never fewer tokens per verify step, and on 4
    # requests always more (on one request, the tiny llama target never takes a runner-up)
    tree_length, chain_length = (e.metrics.mean_accepted_length for e in (tree_engine, chain_engine))
    assert tree_length > chain_length if batch == 4 else tree_length >= chain_length


def test_eagle_forks_are_the_best_runner_ups_of_the_chain():
    from specdec.drafters.heads import _Forks

    draft_token_ids = torch.tensor([10, 11, 12, 13])
    forks = _Forks()
    depth_logits = [torch.tensor([0.6, 0.3, 0.1, 0.0]).log(),  # chain 10 (0.6), runner-up 11 worth 0.3
                    torch.tensor([0.1, 0.1, 0.45, 0.35]).log(),  # chain 12 (0.45), runner-up 13 worth 0.6 * 0.35
                    torch.tensor([0.06, 0.9, 0.04, 0.0]).log()]  # chain 11 (0.9), runner-up 10 worth 0.27 * 0.06
    for depth, (logits, chosen) in enumerate(zip(depth_logits, [10, 12, 11])):
        forks.offer(logits, chosen, depth, draft_token_ids)
    assert [(round(w, 4), d, t) for w, d, t in forks.offers] == [(0.3, 0, 11), (0.21, 1, 13), (0.0162, 2, 10)]
    assert forks.chain_prob == pytest.approx(0.6 * 0.45 * 0.9)
    draft = forks.tree([10, 12, 11], max_forks=2, min_prob=0.05)
    assert draft.token_ids == (10, 12, 11) and draft.draft_probs is None
    assert draft.tree.token_ids == (10, 12, 11, 11, 13) and draft.tree.parents == (-1, 0, 1, -1, 0)
    assert forks.tree([10, 12, 11], max_forks=3, min_prob=0.25).tree.token_ids == (10, 12, 11, 11)
    assert forks.tree([10, 12, 11], max_forks=3, min_prob=0.5).tree is None  # no fork worth it: the chain


def test_sampled_requests_draft_eagle_chains_and_medusa_refuses_trees(make_tiny_model, tiny_tokenizer, trained_heads):
    from specdec.config import SpeculativeConfig
    from specdec.drafters.heads import EagleDrafter

    model = make_tiny_model("qwen2")
    trainer = trained_heads("qwen2", "eagle")
    drafter = EagleDrafter(trainer.head, trainer.parts, model.config.vocab_size, 4, 256, num_branches=4,
                           min_branch_prob=0.0)
    seqs, engine = run(model, tiny_tokenizer, PROMPTS[:2], SamplingParams(max_tokens=20, temperature=1.0, seed=1),
                       drafter, k=4)
    assert engine.metrics.drafted_tokens > 0
    assert drafter.propose([], []) == []
    with pytest.raises(ValueError, match="num_draft_branches > 1 .* not available for method 'medusa'"):
        SpeculativeConfig.from_dict({"method": "medusa", "model": "x.safetensors", "num_speculative_tokens": 3,
                                     "num_draft_branches": 2})
