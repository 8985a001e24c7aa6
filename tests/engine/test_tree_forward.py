"""Tree forward passes on tiny models: each tree node's logits are bitwise those of its path run as a chain
(the tree mask, RoPE positions and scratch cache positions), and a compacted path decodes on exactly."""
import pytest
import torch

from specdec.cache.kv_cache import KVCache
from specdec.drafters.tree import DraftTree
from specdec.models.batch import ForwardBatch

PREFIX = [5, 17, 42, 99, 3, 250, 77, 12, 8, 130, 64, 201]  # 12 committed tokens; the last one is the tree root
BRANCHES = [(17, 42, 99, 3), (17, 250, 77), (8, 130, 64, 201), (17, 42, 5, 6, 7), (9,)]
TREE = DraftTree.from_branches(BRANCHES)  # 14 nodes, depth 5
OTHER = [9, 8, 7, 6, 5, 4, 3, 2, 1]
MODELS = [
    ("llama", {}),
    ("qwen2", {}),
    ("gemma3", {}),
    ("gemma3", {"sliding_window": 2}),
]  # window 2: starts inside tree paths


def tree_parents(tree):
    return [-1, *(parent + 1 for parent in tree.parents)]


def chain_logits(model, tokens, start):
    """Prefill tokens[:start] alone, then all rows of tokens[start:] as one chain block."""
    cache = KVCache(model.config, 1, 64, dtype=model.kv_cache_dtype)
    model.forward(ForwardBatch.build([tokens[:start]], [0], [0], all_logits=False), cache)
    return model.forward(ForwardBatch.build([tokens[start:]], [start], [0], all_logits=True), cache)


def prefilled(model, num_slots=2):
    cache = KVCache(model.config, num_slots, 64, dtype=model.kv_cache_dtype)
    model.forward(ForwardBatch.build([PREFIX[:-1], OTHER], [0, 0], [0, 1], all_logits=False), cache)
    return cache


def tree_forward(model, cache):
    """The tree of slot 0 beside a 3-token chain of slot 1 in one batch; returns the tree's logits rows."""
    batch = ForwardBatch.build([[PREFIX[-1], *TREE.token_ids], [1, 2, 3]], [len(PREFIX) - 1, len(OTHER)], [0, 1],
                               all_logits=True, parents=[tree_parents(TREE), None])
    logits = model.forward(batch, cache)
    return logits[: TREE.num_nodes + 1], logits[TREE.num_nodes + 1 :]


@pytest.mark.parametrize("architecture,overrides", MODELS)
def test_tree_rows_bitwise_equal_their_paths_as_chains(make_tiny_model, architecture, overrides):
    model = make_tiny_model(architecture, **overrides)
    tree_logits, other_logits = tree_forward(model, prefilled(model))
    start = len(PREFIX) - 1
    for node in range(TREE.num_nodes):
        path_tokens = [TREE.token_ids[n] for n in TREE.path(node)]
        reference = chain_logits(model, PREFIX + path_tokens, start)  # [1 + depth + 1, vocab]
        assert torch.equal(tree_logits[1 + node], reference[-1]), f"node {node}"
        assert torch.equal(tree_logits[0], reference[0])
    assert torch.equal(other_logits, chain_logits(model, OTHER + [1, 2, 3], len(OTHER)))


@pytest.mark.parametrize("architecture,overrides", MODELS)
def test_compacted_off_branch_path_decodes_like_a_fresh_run(make_tiny_model, architecture, overrides):
    model = make_tiny_model(architecture, **overrides)
    cache = prefilled(model)
    tree_forward(model, cache)
    path = TREE.path(TREE.token_ids.index(5))  # 17 42 5: nodes 0 1 7, node 7 sits at scratch offset 7, depth 2
    start = len(PREFIX)
    cache.compact(0, [start + node for node in path], [start + depth for depth in range(len(path))])
    accepted = [TREE.token_ids[n] for n in path]
    continuation = [33, 7, 180]
    logits = model.forward(ForwardBatch.build([continuation], [start + len(path)], [0], all_logits=True), cache)
    reference = chain_logits(model, PREFIX + accepted + continuation, start + len(path))
    assert torch.equal(logits, reference)


def test_tree_batch_positions_and_keys():
    batch = ForwardBatch.build([[50, 1, 2, 3, 4]], [10], [0], all_logits=True, parents=[[-1, 0, 1, 0, 3]])
    assert batch.positions.tolist() == [10, 11, 12, 11, 12]  # RoPE: start + depth
    assert batch.cache_positions.tolist() == [10, 11, 12, 13, 14]  # scratch: start + row
    assert batch.prefix_ends.tolist() == [11, 12, 13, 11, 11]
    assert batch.tree_keys.tolist() == [[-1, -1], [-1, -1], [-1, -1], [13, -1], [13, 14]]


def test_chain_batch_has_no_tree_keys():
    batch = ForwardBatch.build([[1, 2, 3]], [4], [0], all_logits=True)
    assert batch.tree_keys is None and torch.equal(batch.positions, batch.cache_positions)


def test_bad_tree_parents_are_rejected():
    with pytest.raises(ValueError, match=r"tree parents must be \[-1, then 0 <= parents\[j\] < j\] for 3 rows"):
        ForwardBatch.build([[1, 2, 3]], [4], [0], all_logits=True, parents=[[-1, 2, 0]])
