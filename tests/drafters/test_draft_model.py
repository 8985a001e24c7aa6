"""Draft-model token trees (EAGLE-2's dynamic tree): the first branch is the chain; the other nodes are the
likeliest next tokens of the likeliest paths, each computed exactly as the draft model decodes its path alone
(scratch positions with tree keys), its acceptance probability its path probability."""
import pytest
import torch

from specdec.cache.kv_cache import KVCache
from specdec.config import SamplingParams
from specdec.drafters.base import DrafterCostDescription
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.models.batch import ForwardBatch
from specdec.verify.noise import RequestNoise

PROMPT = [5, 17, 42, 99, 3, 250, 77, 12]


def chain(model, prompt, k):
    drafter = DraftModelDrafter(model, max_num_seqs=1, max_model_len=64)
    drafter.add_request("r", prompt, SamplingParams(), None)
    return drafter.propose(["r"], [k])[0].token_ids


def next_token_probs(model, tokens):
    """The draft model's next-token distribution after `tokens`, computed alone in a fresh cache."""
    cache = KVCache(model.config, 1, 64, dtype=model.kv_cache_dtype)
    logits = model.forward(ForwardBatch.build([list(tokens)], [0], [0], all_logits=False), cache)  # [1, vocab]
    return torch.softmax(logits[0].float(), dim=-1), int(logits[0].argmax())


def leaf_paths(tree):
    return [[tree.token_ids[n] for n in tree.path(leaf)] for leaf in range(tree.num_nodes) if not tree.children(leaf)]


@pytest.mark.parametrize("architecture,overrides", [("llama", {}), ("gemma3", {"sliding_window": 3})])
@pytest.mark.parametrize("num_branches", [2, 4])
def test_tree_nodes_are_the_likeliest_children_of_their_paths_decoded_alone(make_tiny_model, architecture, overrides,
                                                                            num_branches):
    """Every node of the dynamic tree is among the num_branches likeliest next tokens of its path run alone in a
    fresh cache (so the scratch rows attend exactly their own paths), its acceptance probability its path probability;
    the
    first branch is the chain draft and the other nodes come best first."""
    model = make_tiny_model(architecture, **overrides)
    k = 5
    drafter = DraftModelDrafter(model, max_num_seqs=2, max_model_len=64, num_branches=num_branches, min_branch_prob=0.0)
    drafter.add_request("r", PROMPT, SamplingParams(), None)
    (draft,) = drafter.propose(["r"], [k])
    tree = draft.tree
    assert draft.token_ids == chain(model, PROMPT, k)  # the first branch is the chain draft
    assert tree.num_nodes == num_branches * k and max(tree.depths()) == k - 1  # no threshold: every node slot used
    for node in range(tree.num_nodes):
        path = [tree.token_ids[n] for n in tree.path(node)]
        probs, best = next_token_probs(model, PROMPT + path[:-1])
        assert path[-1] in probs.topk(num_branches).indices.tolist(), (node, path)
        parent_prob = 1.0 if tree.parents[node] < 0 else tree.acceptance_probs[tree.parents[node]]
        assert tree.acceptance_probs[node] == pytest.approx(parent_prob * float(probs[path[-1]]), rel=1e-4)
    extra = tree.acceptance_probs[len(draft.token_ids):]
    assert list(extra) == sorted(extra, reverse=True)


def test_tree_nodes_respect_the_threshold(make_tiny_model):
    model = make_tiny_model("qwen2")
    k = 4
    # a node's acceptance probability is the draft probability of its path (< 1): a threshold of 1 allows none -> a
    # chain
    drafter = DraftModelDrafter(model, max_num_seqs=1, max_model_len=64, num_branches=3, min_branch_prob=1.0)
    drafter.add_request("r", PROMPT, SamplingParams(), None)
    (draft,) = drafter.propose(["r"], [k])
    assert draft.tree is None and draft.token_ids == chain(model, PROMPT, k)
    # a threshold keeps only nodes that reach it (and drops the rest of their subtrees with them)
    drafter = DraftModelDrafter(model, max_num_seqs=1, max_model_len=64, num_branches=3, min_branch_prob=0.02)
    drafter.add_request("r", PROMPT, SamplingParams(), None)
    (draft,) = drafter.propose(["r"], [k])
    extra = draft.tree.acceptance_probs[k:]
    assert extra and min(extra) >= 0.02 and draft.tree.num_nodes < 3 * k


def test_sampled_requests_draft_chains(make_tiny_model):
    drafter = DraftModelDrafter(make_tiny_model("qwen2"), max_num_seqs=2, max_model_len=64, num_branches=3)
    drafter.add_request("r", PROMPT, SamplingParams(temperature=1.0), RequestNoise(0))
    (draft,) = drafter.propose(["r"], [4])
    assert draft.tree is None and len(draft.token_ids) == 4 and draft.draft_probs.shape[0] == 4


SHARED = [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # 20 tokens, e.g. a system turn


@pytest.mark.parametrize("architecture,overrides", [("qwen2", {}), ("gemma3", {"sliding_window": 3})])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_prefix_store_skips_the_shared_prefill_and_drafts_do_not_change(make_tiny_model, architecture, overrides,
                                                                         temperature):
    model = make_tiny_model(architecture, **overrides)
    prompts = [SHARED + [40, 41, 42], SHARED + [50, 51], SHARED + [40, 41, 42], [60, 61, 62]]
    params = SamplingParams(temperature=temperature)

    def drafts(prefix_cache_tokens):
        drafter = DraftModelDrafter(model, max_num_seqs=2, max_model_len=64, prefix_cache_tokens=prefix_cache_tokens)
        out, reused = [], []
        for i, prompt in enumerate(prompts):  # one after another, each freeing its slot, as a server would
            noise = None if params.greedy else RequestNoise(i)
            drafter.add_request(str(i), prompt, params, noise)
            before = drafter.reused_prefix_tokens
            out.append(drafter.propose([str(i)], [4])[0])
            reused.append(drafter.reused_prefix_tokens - before)
            drafter.remove_request(str(i))
        return out, reused

    stored, reused = drafts(16384)
    fresh, none_reused = drafts(0)
    assert reused == [0, len(SHARED), len(prompts[2]) - 1, 0]  # the repeat reuses all but its last token
    assert none_reused == [0, 0, 0, 0]
    assert [d.token_ids for d in stored] == [d.token_ids for d in fresh]
    if temperature:
        assert all(torch.equal(a.draft_probs, b.draft_probs) for a, b in zip(stored, fresh))


# ---- a reduced draft vocabulary (draft_vocab_size) ------------------------------------------------------
@pytest.mark.parametrize("weight_format", ["q8", "fp32"])
def test_reduced_vocabulary_drafts_the_best_kept_token_with_the_same_logits(make_tiny_model, weight_format):
    model = make_tiny_model("qwen2", weight_format=weight_format)
    kept = [3, 17, 42, 99, 120, 250, 251, 299]
    drafter = DraftModelDrafter(model, max_num_seqs=1, max_model_len=64, draft_token_ids=reversed(kept))
    assert drafter.draft_token_ids.tolist() == kept
    drafter.add_request("r", PROMPT, SamplingParams(), None)
    (draft,) = drafter.propose(["r"], [3])
    tokens = list(PROMPT)
    for token_id in draft.token_ids:  # each draft token: the kept token the full output layer ranks highest
        cache = KVCache(model.config, 1, 64, dtype=model.kv_cache_dtype)
        full = model.forward(ForwardBatch.build([tokens], [0], [0], all_logits=False), cache)[0]  # [vocab]
        assert token_id == kept[int(full[kept].argmax())]
        tokens.append(token_id)
    # the draft head is the output layer's kept rows: bit for bit with our int8 kernel (each output is computed
    # alone), to rounding with fp32's F.linear (whose blocking depends on the width)
    normed = torch.randn(5, model.config.hidden_size)
    reduced, full = model.logits(normed, drafter.draft_head), model.logits(normed)[:, kept]
    if weight_format == "q8":
        assert torch.equal(reduced, full)
    else:
        torch.testing.assert_close(reduced, full)
    assert drafter.weight_nbytes < model.weight_nbytes
    # the draft policy prices one draft forward per draft position by the weight bytes it reads
    assert drafter.cost_description() == DrafterCostDescription(drafter.weight_nbytes, forward_per_draft_token=True)


def test_reduced_vocabulary_rejects_ids_outside_the_vocabulary(make_tiny_model):
    model = make_tiny_model("qwen2")
    with pytest.raises(ValueError, match=r"draft token ids must be a non-empty set of ids in \[0, 300\)"):
        DraftModelDrafter(model, max_num_seqs=1, max_model_len=64, draft_token_ids=[5, 300])
    with pytest.raises(ValueError, match="non-empty"):
        DraftModelDrafter(model, max_num_seqs=1, max_model_len=64, draft_token_ids=[])


# ---- catch-up: what a draft costs before its first draft token ----------------------------------------------
def test_catch_up_looks_the_prefix_store_up_again_only_when_the_answer_can_change(make_tiny_model, monkeypatch):
    model = make_tiny_model("qwen2")
    drafter = DraftModelDrafter(model, max_num_seqs=2, max_model_len=64, prefix_cache_tokens=16384)
    drafter.add_request("b", SHARED + [50, 51], SamplingParams(), None)
    assert drafter.catch_up_tokens("b") == len(SHARED)  # nothing stored yet: its whole prompt, less a steady step's 2
    lookups = []
    match_length = drafter.prefixes.match_length
    monkeypatch.setattr(drafter.prefixes, "match_length", lambda ids: lookups.append(len(ids)) or match_length(ids))
    for step, token in enumerate((60, 61, 62), start=1):  # steps at k = 0 while the store does not change
        drafter.observe("b", [token])
        assert drafter.catch_up_tokens("b") == len(SHARED) + step
    assert lookups == []
    drafter.add_request("a", SHARED + [40], SamplingParams(), None)
    drafter.propose(["a"], [2])  # a's first draft prefills its prompt and stores it: the store changed
    assert drafter.catch_up_tokens("b") == 5 - 2 and len(lookups) == 1  # copies SHARED, feeds its other 5 tokens


def test_catch_up_tokens_count_what_the_first_forward_feeds_beyond_a_steady_step(make_tiny_model):
    model = make_tiny_model("qwen2")
    prompt = SHARED + [40, 41, 42]  # 23 tokens
    drafter = DraftModelDrafter(model, max_num_seqs=2, max_model_len=64, prefix_cache_tokens=16384)
    drafter.add_request("a", prompt, SamplingParams(), None)
    assert drafter.catch_up_tokens("a") == len(prompt) - 2  # the prompt's prefill
    draft = drafter.propose(["a"], [3])[0]
    drafter.observe("a", [*draft.token_ids, 7])  # all accepted + a bonus token: a steady step feeds 2
    assert drafter.catch_up_tokens("a") == 0
    for token in (8, 9, 10, 11):  # four steps at k = 0
        drafter.observe("a", [token])
    assert drafter.catch_up_tokens("a") == 4
    drafter.propose(["a"], [1])
    assert drafter.catch_up_tokens("a") == 0
    # a later prompt sharing the stored prefix only catches up on the rest
    drafter.add_request("b", SHARED + [50, 51, 52, 53, 54], SamplingParams(), None)
    assert drafter.catch_up_tokens("b") == 5 - 2  # copies SHARED from the store, feeds its other 5 tokens


@pytest.mark.parametrize("num_branches", [1, 3])
def test_a_constrained_request_drafts_only_allowed_tokens(make_tiny_model, num_branches):
    """With a constraint, the draft model's chain is drawn from its logits masked by allowed_after(chain so far),
    which sees each prefix in turn; an unconstrained request of the same prompt drafts forbidden tokens."""
    model = make_tiny_model("llama")
    vocab = model.config.vocab_size
    prompt = [1, 5, 9, 2]
    free = DraftModelDrafter(model, max_num_seqs=1, max_model_len=64, num_branches=num_branches)
    free.add_request("r", prompt, SamplingParams(max_tokens=8), None)
    unconstrained = free.propose(["r"], [6])[0].token_ids
    forbidden = set(unconstrained)  # everything the unconstrained draft proposes is forbidden
    seen_prefixes = []

    def allowed_after(prefix):
        seen_prefixes.append(tuple(prefix))
        allowed = torch.ones(vocab, dtype=torch.bool)
        allowed[list(forbidden)] = False
        return allowed

    drafter = DraftModelDrafter(model, max_num_seqs=1, max_model_len=64, num_branches=num_branches)
    drafter.add_request("r", prompt, SamplingParams(max_tokens=8), None)
    drafter.constrain("r", allowed_after)
    draft = drafter.propose(["r"], [6])[0]
    assert len(draft.token_ids) == 6 and draft.tree is None  # a chain, whatever num_branches
    assert not forbidden & set(draft.token_ids)
    assert seen_prefixes == [tuple(draft.token_ids[:depth]) for depth in range(6)]


def test_a_constraint_that_allows_nothing_leaves_the_draft_as_it_was(make_tiny_model):
    model = make_tiny_model("llama")
    prompt = [1, 5, 9, 2]
    free = DraftModelDrafter(model, max_num_seqs=1, max_model_len=64)
    free.add_request("r", prompt, SamplingParams(max_tokens=8), None)
    drafter = DraftModelDrafter(model, max_num_seqs=1, max_model_len=64)
    drafter.add_request("r", prompt, SamplingParams(max_tokens=8), None)
    drafter.constrain("r", lambda prefix: torch.zeros(model.config.vocab_size, dtype=torch.bool))
    assert drafter.propose(["r"], [4])[0].token_ids == free.propose(["r"], [4])[0].token_ids
