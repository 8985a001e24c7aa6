"""DraftTree: merging branches by shared prefixes, structure queries, validation; Draft with a tree."""
import pytest

from specdec.drafters.base import Draft
from specdec.drafters.tree import DraftTree


def test_from_branches_merges_shared_prefixes_first_branch_first():
    tree = DraftTree.from_branches([(1, 2, 3), (1, 4), (5,), (1, 2, 6), (1, 2)])
    assert tree.token_ids == (1, 2, 3, 4, 5, 6)
    assert tree.parents == (-1, 0, 1, 0, -1, 1)
    assert tree.depths() == [0, 1, 2, 1, 0, 2]
    assert tree.first_branch() == (1, 2, 3)
    assert tree.path(5) == [0, 1, 5] and tree.children(-1) == [0, 4] and tree.children(1) == [2, 5]
    assert not tree.is_chain()


def test_from_branches_node_budget_and_truncation():
    tree = DraftTree.from_branches([(1, 2, 3), (1, 4, 7), (5,)], max_nodes=4)
    assert tree.token_ids == (1, 2, 3, 4) and tree.parents == (-1, 0, 1, 0)
    assert tree.truncated(3).is_chain() and tree.truncated(3).token_ids == (1, 2, 3)


def test_accepted_path_follows_the_target_tokens_from_the_root():
    tree = DraftTree.from_branches([(1, 2, 3), (1, 4, 7), (5,)])  # nodes: 1 2 3 | 4 7 | 5
    answer = [1, 4, 7, 9]
    assert tree.accepted_path(lambda node, depth: answer[depth]) == [0, 3, 4]
    assert tree.accepted_path(lambda node, depth: 5 if node == -1 else 8) == [5]
    assert tree.accepted_path(lambda node, depth: None) == []  # the target's tokens end here
    assert tree.accepted_path(lambda node, depth: [1, 2][depth] if depth < 2 else None) == [0, 1]


def test_chain_is_a_tree_of_one_branch():
    tree = DraftTree.from_branches([(7, 8, 9)])
    assert tree.is_chain() and tree.first_branch() == (7, 8, 9)
    assert DraftTree.from_branches([]).num_nodes == 0


@pytest.mark.parametrize("token_ids,parents,message", [
    ((1, 2), (-1,), "2 tokens but 1 parents"),
    ((1, 2), (-1, 1), r"parents\[i\] < i, got \(node, parent\) \[\(1, 1\)\]"),
    ((1, 2), (-1, -2), r"\(1, -2\)"),
    ((1, 1), (-1, -1), "node 1 repeats token 1 under parent -1"),
])
def test_invalid_trees_are_rejected(token_ids, parents, message):
    with pytest.raises(ValueError, match=message):
        DraftTree(token_ids, parents)


def test_draft_from_branches_keeps_the_chain_in_token_ids():
    draft = Draft.from_branches([(1, 2, 3), (1, 4)])
    assert draft.token_ids == (1, 2, 3) and draft.tree.token_ids == (1, 2, 3, 4)
    chain = Draft.from_branches([(1, 2, 3), (1, 2)])  # the second branch adds nothing
    assert chain.token_ids == (1, 2, 3) and chain.tree is None


def test_capped_draft_keeps_the_first_branch_and_cuts_the_other_nodes():
    draft = Draft.from_branches([(1, 2, 3), (1, 4), (5, 6)])  # nodes 1 2 3 | 4 | 5 6
    assert draft.capped(6) is draft and draft.capped(5).tree.token_ids == (1, 2, 3, 4, 5)
    assert draft.capped(4).tree.token_ids == (1, 2, 3, 4)
    for max_nodes in (3, 1, 0):  # never below the chain: a budget under k cuts trees, not the chain itself
        assert draft.capped(max_nodes).tree is None and draft.capped(max_nodes).token_ids == (1, 2, 3)


def test_draft_token_ids_must_be_the_tree_first_branch():
    with pytest.raises(ValueError, match=r"must be the first branch of Draft.tree, \(1, 2\)"):
        Draft(token_ids=(1, 4), tree=DraftTree((1, 2, 4), (-1, 0, 0)))


def test_drafters_refuse_zero_branches():
    from specdec.drafters.ngram import NgramDrafter
    from specdec.drafters.suffix import SuffixDrafter

    for make in (lambda: NgramDrafter(3, 1, 0), lambda: SuffixDrafter(8, 0.1, 4, num_branches=0)):
        with pytest.raises(ValueError, match="num_branches must be >= 1, got 0"):
            make()


def test_tree_settings_are_checked_once_for_every_drafter():
    from specdec.drafters.tree import check_tree_args

    check_tree_args(1)
    check_tree_args(8, 0.0)
    check_tree_args(2, 1.0)
    with pytest.raises(ValueError, match="num_branches must be >= 1, got 0"):
        check_tree_args(0)
    with pytest.raises(ValueError, match=r"min_branch_prob must be in \[0, 1\], got 1.5"):
        check_tree_args(2, 1.5)
