"""verify_greedy_tree on hand-made trees: the path follows the target's argmax, then one more token."""
import pytest
import torch

from specdec.drafters.tree import DraftTree
from specdec.verify.tree import verify_greedy_tree

VOCAB = 10
# root -> 1 -> 2 -> 3 ; 1 -> 4 ; root -> 5 -> 6
TREE = DraftTree(token_ids=(1, 2, 3, 4, 5, 6), parents=(-1, 0, 1, 0, -1, 4))


def logits_choosing(tokens):
    """[len(tokens), VOCAB] whose row i has its argmax at tokens[i]."""
    logits = torch.zeros(len(tokens), VOCAB)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return logits


def test_follows_the_second_child_and_ends_with_the_recovered_token():
    # rows: root, after node 0 (1), node 1 (1 2), node 2, node 3 (1 4), node 4 (5), node 5 (5 6)
    result = verify_greedy_tree(TREE, logits_choosing([1, 4, 0, 0, 9, 0, 0]))
    assert result.accepted_nodes == (0, 3) and result.token_ids == (1, 4, 9)
    assert result.accepted_count == 2 and result.num_drafted == 3 and result.bonus  # node 3 is a leaf
    assert result.logits_rows() == [0, 1, 4]


def test_whole_branch_accepted_gives_the_bonus_token():
    result = verify_greedy_tree(TREE, logits_choosing([5, 0, 0, 0, 0, 6, 8]))
    assert result.accepted_nodes == (4, 5) and result.token_ids == (5, 6, 8) and result.bonus


def test_stop_inside_the_tree_is_a_recovered_token():
    result = verify_greedy_tree(TREE, logits_choosing([1, 7, 0, 0, 0, 0, 0]))
    assert result.accepted_nodes == (0,) and result.token_ids == (1, 7) and not result.bonus


def test_nothing_accepted_at_the_root():
    result = verify_greedy_tree(TREE, logits_choosing([8, 2, 3, 0, 0, 6, 0]))
    assert result.accepted_nodes == () and result.token_ids == (8,) and not result.bonus


def test_ties_take_the_first_index_like_plain_greedy():
    logits = logits_choosing([1, 4, 0, 0, 9, 0, 0])
    logits[0, 5] = 1.0  # token 5 ties token 1 at the root: argmax picks 1
    assert verify_greedy_tree(TREE, logits).accepted_nodes == (0, 3)


def test_wrong_number_of_rows_is_rejected():
    with pytest.raises(ValueError, match=r"\[nodes \+ 1, vocab\] = \[7, vocab\], got \(6, 10\)"):
        verify_greedy_tree(TREE, torch.zeros(6, VOCAB))
