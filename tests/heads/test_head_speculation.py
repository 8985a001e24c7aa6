"""EAGLE and Medusa heads in the engine: greedy output identical to plain decoding (batch 1 and 4, every
architecture) and sampling that reproduces the target's distribution (chi-square), the heads' draft
probabilities feeding rejection sampling — also when they draft over a reduced vocabulary."""
import pytest

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
        return run(model, tiny_tokenizer, PROMPTS, SamplingParams(max_tokens=40), drafter, k=4)[
            1
        ].metrics.mean_accepted_length

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


def test_growing_tree_expands_and_keeps_the_likeliest_paths():
    """EAGLE-2's dynamic tree on hand-made distributions: which nodes are expanded, where their rows sit in the
    cache and what they attend, and which nodes the draft keeps (chain first, then by path probability)."""
    from specdec.drafters.tree_growth import GrowingTree

    def grown(max_nodes):
        tree = GrowingTree(base=10, max_depth=3, width=2, min_prob=0.05, max_nodes=max_nodes, cache_len=100)
        tree.add_children(-1, 10, 0.6, [10, 11], [0.6, 0.3])  # nodes 0 (chain, 0.6), 1 (0.3)
        assert tree.to_expand(0) == [0, 1]
        rows = tree.rows([0, 1])
        assert rows.positions == (10, 10) and rows.cache_positions == (10, 13)  # 13: the first scratch position
        assert rows.prefix_ends == (11, 10) and rows.tree_keys == ((), (13,))
        tree.add_children(0, 12, 0.45, [12, 13], [0.45, 0.35])  # nodes 2 (chain, 0.27), 3 (0.21)
        tree.add_children(1, 10, 0.9, [10, 11], [0.9, 0.05])  # nodes 4 (0.27), 5 (0.015: below min_prob)
        assert tree.to_expand(1) == [2, 4]  # the chain's node, then the likeliest other (4 before 3)
        rows = tree.rows([2, 4])
        assert rows.positions == (11, 11) and rows.cache_positions == (11, 14)
        assert rows.prefix_ends == (12, 10) and rows.tree_keys == ((), (13, 14))  # node 4's path: 1 then itself
        assert tree.to_expand(2) == []  # the last depth
        tree.add_children(2, 11, 0.9, [11, 10], [0.9, 0.06])  # nodes 6 (chain, 0.243), 7 (0.0162)
        tree.add_children(4, 12, 0.5, [13, 12], [0.5, 0.5])  # the argmax comes first: nodes 8 (12), 9 (13), 0.135 each
        return tree

    chain, tree = grown(max_nodes=6).draft()
    assert chain == (10, 12, 11)
    assert tree.token_ids == (10, 12, 11, 11, 10, 13) and tree.parents == (-1, 0, 1, -1, 3, 0)
    chain, tree = grown(max_nodes=20).draft()  # every node reaching min_prob, ties by depth then order
    assert tree.token_ids == (10, 12, 11, 11, 10, 13, 12, 13) and tree.parents == (-1, 0, 1, -1, 3, 0, 4, 4)
    assert [round(node.path_prob, 4) for node in grown(6).nodes] == [0.6, 0.3, 0.27, 0.21, 0.27, 0.015, 0.243,
                                                                     0.0162, 0.135, 0.135]
    sure = GrowingTree(base=0, max_depth=1, width=3, min_prob=0.05, max_nodes=3, cache_len=8)
    sure.add_children(-1, 7, 0.97, [7, 8, 9], [0.97, 0.02, 0.01])
    assert sure.draft() == ((7,), None)  # nothing else reaches it: the chain alone
    cramped = GrowingTree(base=4, max_depth=3, width=3, min_prob=0.0, max_nodes=9, cache_len=8)
    cramped.add_children(-1, 1, 0.5, [1, 2, 3], [0.5, 0.3, 0.2])
    assert cramped.to_expand(0) == [0, 1]  # one scratch position left (7): one node besides the chain's
    with pytest.raises(ValueError, match="width >= 2"):
        GrowingTree(base=0, max_depth=2, width=1, min_prob=0.0, max_nodes=4, cache_len=8)


@pytest.mark.parametrize("architecture", ["qwen2", "gemma3"])
def test_eagle_tree_first_branch_is_the_chain_draft(make_tiny_model, tiny_tokenizer, trained_heads, architecture):
    """A chain drafter fed exactly what the tree drafter is fed proposes, at every step, the tree's first branch:
    the tree's extra rows (scratch positions, other nodes in the same head forwards) leave the chain untouched."""
    from specdec.drafters.base import HiddenStateDrafter
    from specdec.drafters.heads import EagleDrafter

    model = make_tiny_model(architecture)
    trainer = trained_heads(architecture, "eagle")
    make = lambda branches: EagleDrafter(trainer.head, trainer.parts, model.config.vocab_size, 4, 256,  # noqa: E731
                                         num_branches=branches, min_branch_prob=0.0)
    tree_drafter, chain_drafter = make(3), make(1)
    trees = []

    class Mirror(HiddenStateDrafter):
        def add_request(self, *args):
            tree_drafter.add_request(*args), chain_drafter.add_request(*args)

        def observe(self, *args):
            tree_drafter.observe(*args), chain_drafter.observe(*args)

        def observe_target_hidden(self, *args):
            tree_drafter.observe_target_hidden(*args), chain_drafter.observe_target_hidden(*args)

        def remove_request(self, *args):
            tree_drafter.remove_request(*args), chain_drafter.remove_request(*args)

        def propose(self, request_ids, max_draft_tokens):
            drafts = tree_drafter.propose(request_ids, max_draft_tokens)
            chains = chain_drafter.propose(request_ids, max_draft_tokens)
            assert [d.token_ids for d in drafts] == [c.token_ids for c in chains]
            trees.extend(d.tree for d in drafts if d.tree is not None)
            return drafts

    params = SamplingParams(max_tokens=30)
    plain, _ = run(model, tiny_tokenizer, PROMPTS[:3], params)
    mirrored, _ = run(model, tiny_tokenizer, PROMPTS[:3], params, Mirror(), k=4)
    assert [s.output_token_ids for s in mirrored] == [s.output_token_ids for s in plain]
    assert trees and max(tree.num_nodes for tree in trees) > 4  # trees were grown beyond a chain of 4


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


def test_engine_cuts_eagle_trees_to_what_the_policy_keeps(make_tiny_model, tiny_tokenizer, trained_heads):
    """The draft policy decides how many of an EAGLE tree's extra nodes a step verifies: with none kept the trees
    are verified as their chains (same tokens per step as the chain drafter), with all kept they are larger."""
    from specdec.drafters.heads import EagleDrafter
    from specdec.engine.draft_length.policy import BatchDraftPolicy

    class Keep(BatchDraftPolicy):
        def __init__(self, keep):
            super().__init__(4, 32)
            object.__setattr__(self, "keep", keep)

        def tree_nodes(self, seqs, draft_lengths, verified_nodes, extra_acceptance_probs, batch_size):
            assert all(list(p) == sorted(p, reverse=True) for p in extra_acceptance_probs)  # likeliest first
            return [min(self.keep, len(p)) for p in extra_acceptance_probs]

    model = make_tiny_model("qwen2")
    trainer = trained_heads("qwen2", "eagle")
    params = SamplingParams(max_tokens=30)
    rows_per_policy = {}
    for keep in (0, 100):
        drafter = EagleDrafter(trainer.head, trainer.parts, model.config.vocab_size, 4, 256, num_branches=3,
                               min_branch_prob=0.0)
        engine_rows = []
        original = model.forward_hidden
        model.forward_hidden = lambda batch, cache: (engine_rows.append(max(batch.row_counts)), original(batch, cache))[
            1
        ]
        try:
            seqs, engine = run(model, tiny_tokenizer, PROMPTS[:2], params, drafter, k=4, draft_policy=Keep(keep))
        finally:
            del model.forward_hidden
        rows_per_policy[keep] = (max(engine_rows[1:]), engine.metrics.mean_accepted_length)
    chain_seqs, chain_engine = run(model, tiny_tokenizer, PROMPTS[:2], params, make_head_drafter(trainer, model), k=4)
    assert rows_per_policy[0] == (5, chain_engine.metrics.mean_accepted_length)  # last token + a chain of 4
    assert rows_per_policy[100][0] > 5
