"""verify_exact and verify_exact_tree on hand-made logits: every emitted token is the target's seeded draw at its
position (sample_token with that position's uniform number), drafts only decide how far one step goes."""
import pytest
import torch

from specdec.config import SamplingParams
from specdec.drafters.tree import DraftTree
from specdec.verify import exact
from specdec.verify.exact import verify_exact, verify_exact_tree
from specdec.verify.rejection import VerifyResult
from specdec.verify.sampling import sample_token

VOCAB = 6
PARAMS = SamplingParams(temperature=0.8, top_k=4)


def random_logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2  # [rows, vocab]


def draws(logits: torch.Tensor, uniforms: list[float]) -> list[int]:
    """The target's draw at every row, as plain decoding draws it (one row at a time)."""
    return [sample_token(logits[i : i + 1], PARAMS, u) for i, u in enumerate(uniforms)]


UNIFORMS = [0.13, 0.71, 0.42, 0.95]


def test_drafts_equal_to_the_draws_are_accepted_then_the_bonus_is_the_next_draw():
    logits = random_logits(4, seed=1)
    target = draws(logits, UNIFORMS)
    result = verify_exact(target[:3], logits, PARAMS, UNIFORMS)
    assert result == VerifyResult(accepted_count=3, num_drafted=3, token_ids=tuple(target)) and result.bonus


def test_the_first_mismatch_emits_the_draw_at_its_position():
    logits = random_logits(4, seed=2)
    target = draws(logits, UNIFORMS)
    wrong = (target[1] + 1) % VOCAB
    result = verify_exact([target[0], wrong, target[2]], logits, PARAMS, UNIFORMS)
    assert result == VerifyResult(accepted_count=1, num_drafted=3, token_ids=(target[0], target[1]))


def test_an_empty_draft_is_plain_sampling():
    logits = random_logits(1, seed=3)
    assert verify_exact([], logits, PARAMS, [0.5]).token_ids == (sample_token(logits, PARAMS, 0.5),)


def test_rows_after_the_first_mismatch_are_never_drawn(monkeypatch):
    logits = random_logits(5, seed=4)
    target = draws(logits, UNIFORMS + [0.3])
    rows = []
    monkeypatch.setattr(exact, "sample_token", lambda row, params, u: rows.append(u) or sample_token(row, params, u))
    verify_exact([(target[0] + 1) % VOCAB, *target[1:4]], logits, PARAMS, UNIFORMS + [0.3])
    assert rows == [UNIFORMS[0]]


def test_shapes_are_checked():
    with pytest.raises(ValueError, match=r"target_logits \[k\+1, vocab\] and k\+1 uniforms for 2 draft tokens"):
        verify_exact([1, 2], random_logits(3, seed=0), PARAMS, [0.1, 0.2])
    with pytest.raises(ValueError, match=r"\[nodes \+ 1, vocab\] = \[3, vocab\] and 3 uniforms"):
        verify_exact_tree(DraftTree((1, 2), (-1, 0)), random_logits(3, seed=0), PARAMS, [0.1, 0.2])


# root -> a -> b ; root -> c -> d (two branches whose first tokens differ)
def two_branch_tree(first: int, second: int, other_first: int, other_second: int) -> DraftTree:
    return DraftTree((first, second, other_first, other_second), (-1, 0, -1, 2))


def test_a_tree_walk_follows_the_draws_into_the_second_branch():
    uniforms = [0.37, 0.81, 0.05]
    root_logits = random_logits(1, seed=5)
    root_draw = sample_token(root_logits, PARAMS, uniforms[0])
    node_logits = random_logits(4, seed=6)  # rows after nodes 0..3
    draw_after_node_2 = sample_token(node_logits[2:3], PARAMS, uniforms[1])  # logits row 3
    wrong = (root_draw + 1) % VOCAB
    tree = two_branch_tree(wrong, 0, root_draw, draw_after_node_2)
    logits = torch.cat([root_logits, node_logits])  # [nodes + 1, vocab]
    result = verify_exact_tree(tree, logits, PARAMS, uniforms)
    bonus = sample_token(logits[4:5], PARAMS, uniforms[2])
    assert result.accepted_nodes == (2, 3) and result.token_ids == (root_draw, draw_after_node_2, bonus)
    assert result.bonus and result.logits_rows() == [0, 3, 4]


def test_a_tree_walk_that_matches_no_root_child_emits_the_root_draw():
    uniforms = [0.37, 0.81, 0.05]
    logits = random_logits(5, seed=7)
    root_draw = sample_token(logits[:1], PARAMS, uniforms[0])
    others = [t for t in range(VOCAB) if t != root_draw]
    result = verify_exact_tree(two_branch_tree(others[0], 1, others[1], 2), logits, PARAMS, uniforms)
    assert result.accepted_nodes == () and result.token_ids == (root_draw,) and not result.bonus
