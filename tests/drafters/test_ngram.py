from __future__ import annotations

import random

import pytest

from specdec.config import SamplingParams
from specdec.drafters.base import Draft, DrafterCostDescription
from specdec.drafters.ngram import NgramDrafter

PARAMS = SamplingParams()


def drafter_with(prompt: list[int], prompt_lookup_max: int = 3, prompt_lookup_min: int = 1) -> NgramDrafter:
    drafter = NgramDrafter(prompt_lookup_max=prompt_lookup_max, prompt_lookup_min=prompt_lookup_min)
    drafter.add_request("r", prompt, PARAMS, None)
    return drafter


def propose_one(drafter: NgramDrafter, budget: int, request_id: str = "r") -> tuple[int, ...]:
    return drafter.propose([request_id], [budget])[0].token_ids


def test_proposes_what_followed_the_last_ngram() -> None:
    drafter = drafter_with([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert drafter.propose(["r"], [3]) == [Draft(token_ids=(4, 5, 9), draft_probs=None)]


def test_a_lookup_describes_no_model_forward_to_the_draft_policy() -> None:
    assert drafter_with([1, 2, 3]).cost_description() == DrafterCostDescription(forward_weight_nbytes=0)


def test_budget_is_respected_and_zero_budget_gives_empty() -> None:
    drafter = drafter_with([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert propose_one(drafter, 2) == (4, 5)
    assert propose_one(drafter, 0) == ()


def test_longest_match_wins_over_more_recent_shorter_one() -> None:
    # "7 8" occurred followed by 1; the more recent "8" alone was followed by 5.
    drafter = drafter_with([7, 8, 1, 2, 8, 5, 6, 7, 8], prompt_lookup_max=2, prompt_lookup_min=1)
    assert propose_one(drafter, 1) == (1,)


def test_most_recent_occurrence_of_same_ngram_wins() -> None:
    drafter = drafter_with([4, 5, 1, 4, 5, 2, 4, 5], prompt_lookup_max=2, prompt_lookup_min=2)
    assert propose_one(drafter, 3) == (2, 4, 5)


def test_no_match_below_prompt_lookup_min() -> None:
    drafter = drafter_with([1, 2, 3, 9, 3], prompt_lookup_max=3, prompt_lookup_min=2)
    assert propose_one(drafter, 3) == ()


def test_continuation_may_run_into_the_suffix_itself() -> None:
    drafter = drafter_with([6, 6, 6], prompt_lookup_max=2, prompt_lookup_min=2)
    assert propose_one(drafter, 5) == (6,)  # "6 6" last seen ending at 2, followed only by one 6


def test_observe_extends_the_sequence() -> None:
    drafter = drafter_with([1, 2, 3, 4, 1])
    assert propose_one(drafter, 3) == (2, 3, 4)
    drafter.observe("r", [2, 3])
    assert propose_one(drafter, 3) == (4, 1, 2)


def test_incremental_observe_equals_building_from_scratch() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(8) for _ in range(600)]
    incremental = drafter_with(tokens[:50], prompt_lookup_max=4, prompt_lookup_min=2)
    for start in range(50, len(tokens), 7):
        incremental.observe("r", tokens[start : start + 7])
        end = min(start + 7, len(tokens))
        from_scratch = drafter_with(tokens[:end], prompt_lookup_max=4, prompt_lookup_min=2)
        assert propose_one(incremental, 5) == propose_one(from_scratch, 5) == naive_prompt_lookup(tokens[:end], 4, 2, 5)


def naive_prompt_lookup(tokens: list[int], longest: int, shortest: int, budget: int) -> tuple[int, ...]:
    for n in range(min(longest, len(tokens)), shortest - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                return tuple(tokens[end : end + budget])
    return ()


def test_requests_are_independent_and_batched() -> None:
    drafter = drafter_with([1, 2, 3, 1, 2])
    drafter.add_request("s", [5, 6, 5], PARAMS, None)
    drafts = drafter.propose(["s", "r"], [2, 2])
    assert [draft.token_ids for draft in drafts] == [(6, 5), (3, 1)]


def test_errors() -> None:
    drafter = drafter_with([1, 2])
    with pytest.raises(ValueError, match="already tracked"):
        drafter.add_request("r", [1], PARAMS, None)
    with pytest.raises(KeyError, match="unknown request id 'x'"):
        drafter.observe("x", [1])
    with pytest.raises(ValueError, match="2 request ids but 1 max_draft_tokens"):
        drafter.propose(["r", "r"], [1])
    drafter.remove_request("r")
    with pytest.raises(KeyError, match="unknown request id 'r'"):
        drafter.propose(["r"], [1])
    with pytest.raises(ValueError, match="need 1 <= prompt_lookup_min <= prompt_lookup_max"):
        NgramDrafter(prompt_lookup_max=2, prompt_lookup_min=3)


# ---- token trees (num_branches > 1) --------------------------------------------------------------------
BRANCHING = [1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 5, 9, 1, 2]  # "1 2" went on with 3, 4 and 5


def test_branches_are_distinct_continuations_chain_first():
    drafter = NgramDrafter(prompt_lookup_max=3, prompt_lookup_min=1, num_branches=3)
    drafter.add_request("r", BRANCHING, SamplingParams(), None)
    (draft,) = drafter.propose(["r"], [3])
    assert draft.token_ids == (5, 9, 1)  # what the chain drafter proposes
    assert draft.tree.token_ids == (5, 9, 1, 4, 9, 1, 3, 9, 1)
    assert draft.tree.parents == (-1, 0, 1, -1, 3, 4, -1, 6, 7)


def test_one_branch_is_the_chain_drafter():
    chain = NgramDrafter(prompt_lookup_max=3, prompt_lookup_min=1)
    chain.add_request("r", BRANCHING, SamplingParams(), None)
    (draft,) = chain.propose(["r"], [3])
    assert draft.token_ids == (5, 9, 1) and draft.tree is None


def test_sampled_requests_get_chains_from_a_tree_drafter():
    drafter = NgramDrafter(prompt_lookup_max=3, prompt_lookup_min=1, num_branches=3)
    drafter.add_request("r", BRANCHING, SamplingParams(temperature=0.7), None)
    (draft,) = drafter.propose(["r"], [3])
    assert draft.token_ids == (5, 9, 1) and draft.tree is None


def test_branches_leave_the_chain_where_a_later_n_gram_went_on_differently():
    drafter = NgramDrafter(prompt_lookup_max=2, prompt_lookup_min=1, num_branches=4)
    drafter.add_request("r", [1, 2, 3, 4, 9, 8, 2, 3, 5, 9, 1, 2], SamplingParams(), None)
    (draft,) = drafter.propose(["r"], [3])
    assert draft.token_ids == (3, 4, 9)  # "1 2" went on with "3 4 9"
    # after "1 2 3", the bigram "2 3" last went on with "5 9": a branch at depth 1
    assert draft.tree.token_ids == (3, 4, 9, 5, 9) and draft.tree.parents == (-1, 0, 1, 0, 3)
