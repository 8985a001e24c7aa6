"""Draft-model token trees: the top first tokens, each followed by exactly the greedy chain the draft model
decodes from it alone (branch j > 0 is computed at scratch positions with tree keys)."""
import pytest
import torch

from specdec.cache.kv_cache import KVCache
from specdec.config import SamplingParams
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.engine.batch import ForwardBatch

PROMPT = [5, 17, 42, 99, 3, 250, 77, 12]


def chain(model, prompt, k):
    drafter = DraftModelDrafter(model, max_num_seqs=1, max_model_len=64)
    drafter.add_request("r", prompt, SamplingParams(), None)
    return drafter.propose(["r"], [k])[0].token_ids


@pytest.mark.parametrize("architecture,overrides", [("llama", {}), ("gemma3", {"sliding_window": 3})])
def test_tree_branches_are_the_chains_of_the_top_first_tokens(make_tiny_model, architecture, overrides):
    model = make_tiny_model(architecture, **overrides)
    drafter = DraftModelDrafter(model, max_num_seqs=2, max_model_len=64, num_branches=3)
    drafter.add_request("r", PROMPT, SamplingParams(), None)
    (draft,) = drafter.propose(["r"], [5])
    cache = KVCache(model.config, 1, 64)
    logits = model.forward(ForwardBatch.build([PROMPT], [0], [0], all_logits=False), cache)  # [1, vocab]
    first_tokens = logits[0].topk(3).indices.tolist()
    branches = [[draft.tree.token_ids[n] for n in draft.tree.path(leaf)]
                for leaf in range(draft.tree.num_nodes) if not draft.tree.children(leaf)]
    assert draft.token_ids == chain(model, PROMPT, 5)
    assert [branch[0] for branch in branches] == first_tokens
    for branch in branches:
        assert tuple(branch[1:]) == chain(model, PROMPT + branch[:1], 4)


def test_sampled_requests_draft_chains(make_tiny_model):
    drafter = DraftModelDrafter(make_tiny_model("qwen2"), max_num_seqs=2, max_model_len=64, num_branches=3)
    drafter.add_request("r", PROMPT, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    (draft,) = drafter.propose(["r"], [4])
    assert draft.tree is None and len(draft.token_ids) == 4 and draft.draft_probs.shape[0] == 4
