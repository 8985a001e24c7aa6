from __future__ import annotations

import random
from collections import Counter

import pytest

from specdec.config import SamplingParams
from specdec.drafters.suffix import SuffixDrafter

PARAMS = SamplingParams()


def make_drafter(max_depth: int = 16, min_token_prob: float = 0.0, cache_requests: int = 4) -> SuffixDrafter:
    return SuffixDrafter(max_depth=max_depth, min_token_prob=min_token_prob, cache_requests=cache_requests)


def propose_one(drafter: SuffixDrafter, request_id: str, budget: int) -> tuple[int, ...]:
    return drafter.propose([request_id], [budget])[0].token_ids


def naive_suffix_proposal(tokens: list[int], max_depth: int, min_token_prob: float, budget: int) -> tuple[int, ...]:
    """Reference: count continuations by scanning the sequence (no trie)."""

    def continuation_counts(pattern: list[int]) -> Counter[int]:
        length = len(pattern)
        return Counter(
            tokens[start + length]
            for start in range(len(tokens) - length)
            if tokens[start : start + length] == pattern
        )

    longest = min(max(1, max_depth - budget), len(tokens))
    for length in range(longest, 0, -1):
        pattern = tokens[len(tokens) - length :]
        if not continuation_counts(pattern):
            continue
        draft: list[int] = []
        running_prob = 1.0
        while len(draft) < budget and len(pattern) < max_depth:
            counts = continuation_counts(pattern)
            if not counts:
                break
            token_id = min(counts, key=lambda candidate: (-counts[candidate], candidate))
            running_prob *= counts[token_id] / sum(counts.values())
            if running_prob < min_token_prob:
                break
            draft.append(token_id)
            pattern = pattern + [token_id]
        return tuple(draft)
    return ()


def test_follows_the_repeated_pattern() -> None:
    drafter = make_drafter()
    drafter.add_request("r", [1, 2, 3, 9, 1, 2, 3, 9, 1, 2], PARAMS, None)
    assert propose_one(drafter, "r", 3) == (3, 9, 1)


def test_most_frequent_continuation_and_confidence_stop() -> None:
    tokens = [5, 1, 5, 1, 5, 2, 5]
    # after "5": 1 twice, 2 once -> 1 (p 2/3); after "5 1": 5 (p 1, running 2/3);
    # after "5 1 5": 1 or 2 once each -> tie to 1 (running 1/3).
    confident = make_drafter(min_token_prob=0.5)
    confident.add_request("r", tokens, PARAMS, None)
    assert propose_one(confident, "r", 8) == (1, 5)
    permissive = make_drafter(min_token_prob=0.3)
    permissive.add_request("r", tokens, PARAMS, None)
    assert propose_one(permissive, "r", 3) == (1, 5, 1)


def test_longest_suffix_match_wins() -> None:
    # "3 4" continued with 8; "4" alone is more often continued with 6.
    drafter = make_drafter()
    drafter.add_request("r", [3, 4, 8, 4, 6, 4, 6, 0, 3, 4], PARAMS, None)
    assert propose_one(drafter, "r", 1) == (8,)


def test_budget_is_respected_and_no_match_is_empty() -> None:
    drafter = make_drafter()
    drafter.add_request("r", [1, 2, 3, 1, 2, 3, 1, 2, 3], PARAMS, None)
    assert propose_one(drafter, "r", 2) == (1, 2)
    assert propose_one(drafter, "r", 0) == ()
    drafter.add_request("fresh", [7, 8, 9], PARAMS, None)
    assert propose_one(drafter, "fresh", 4) == ()


def test_depth_limit_bounds_match_plus_draft() -> None:
    drafter = make_drafter(max_depth=4)
    drafter.add_request("r", [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4], PARAMS, None)
    assert propose_one(drafter, "r", 10) == (5, 6, 7)  # match "4" (length 1), then depth 4 is reached


@pytest.mark.parametrize("min_token_prob", [0.0, 0.2, 0.5])
def test_incremental_observe_equals_from_scratch_and_reference(min_token_prob: float) -> None:
    rng = random.Random(1)
    tokens = [rng.choice([0, 1, 2, 3, 3, 3]) for _ in range(400)]
    incremental = make_drafter(max_depth=8, min_token_prob=min_token_prob)
    incremental.add_request("r", tokens[:20], PARAMS, None)
    for start in range(20, len(tokens), 5):
        incremental.observe("r", tokens[start : start + 5])
        prefix = tokens[: start + 5]
        from_scratch = make_drafter(max_depth=8, min_token_prob=min_token_prob)
        from_scratch.add_request("r", prefix, PARAMS, None)
        budget = 1 + start % 6
        expected = naive_suffix_proposal(prefix, 8, min_token_prob, budget)
        assert propose_one(incremental, "r", budget) == propose_one(from_scratch, "r", budget) == expected


def test_second_request_with_same_prompt_uses_first_output() -> None:
    drafter = make_drafter()
    prompt = [10, 11, 12, 13]
    drafter.add_request("first", prompt, PARAMS, None)
    assert propose_one(drafter, "first", 4) == ()
    drafter.observe("first", [20, 21, 22, 23, 24])
    drafter.remove_request("first")
    drafter.add_request("second", prompt, PARAMS, None)
    assert propose_one(drafter, "second", 4) == (20, 21, 22, 23)
    drafter.observe("second", [20, 21])
    assert propose_one(drafter, "second", 4) == (22, 23, 24)


def test_own_tree_preferred_unless_cache_scores_higher() -> None:
    drafter = make_drafter()
    drafter.add_request("old", [1, 2, 7, 7, 7], PARAMS, None)
    drafter.remove_request("old")
    drafter.add_request("r", [1, 2, 3, 1, 2], PARAMS, None)
    # own: "1 2" -> 3 (p 1), then "1 2 3" -> 1 ... cache: "1 2" -> 7, 7, 7; equal confidence per token,
    # but the own draft runs as long as the cache one, so the tie keeps the own tree.
    assert propose_one(drafter, "r", 3) == (3, 1, 2)
    drafter.add_request("s", [4, 1, 2], PARAMS, None)  # no own match at all: the cache wins
    assert propose_one(drafter, "s", 3) == (7, 7, 7)


def test_cache_is_bounded_and_evicts_oldest() -> None:
    drafter = make_drafter(cache_requests=1)
    drafter.add_request("a", [1, 2, 3, 4], PARAMS, None)
    drafter.remove_request("a")
    drafter.add_request("b", [5, 6, 7, 8], PARAMS, None)
    drafter.remove_request("b")
    assert drafter.num_cached_requests == 1
    drafter.add_request("c", [1, 2], PARAMS, None)
    assert propose_one(drafter, "c", 2) == ()  # "a" was evicted and its counts subtracted
    drafter.add_request("d", [5, 6], PARAMS, None)
    assert propose_one(drafter, "d", 2) == (7, 8)


def test_eviction_restores_the_counts_of_the_remaining_requests() -> None:
    drafter = make_drafter(min_token_prob=1.0, cache_requests=2)
    for request_id, tokens in [("a", [1, 2, 3]), ("b", [1, 2, 4]), ("c", [1, 2, 4])]:
        drafter.add_request(request_id, tokens, PARAMS, None)
        drafter.remove_request(request_id)
    # with "a" evicted, "1 2" continues with 4 only: full confidence even at min_token_prob 1.
    drafter.add_request("q", [1, 2], PARAMS, None)
    assert propose_one(drafter, "q", 1) == (4,)


def test_zero_cache_keeps_nothing() -> None:
    drafter = make_drafter(cache_requests=0)
    drafter.add_request("a", [1, 2, 3], PARAMS, None)
    drafter.remove_request("a")
    drafter.add_request("b", [1, 2], PARAMS, None)
    assert drafter.num_cached_requests == 0
    assert propose_one(drafter, "b", 2) == ()


def test_errors() -> None:
    drafter = make_drafter()
    drafter.add_request("r", [1], PARAMS, None)
    with pytest.raises(ValueError, match="already tracked"):
        drafter.add_request("r", [1], PARAMS, None)
    with pytest.raises(KeyError, match="unknown request id 'x'"):
        drafter.remove_request("x")
    with pytest.raises(ValueError, match="max_draft_tokens must be >= 0"):
        drafter.propose(["r"], [-1])
    with pytest.raises(ValueError, match=r"min_token_prob must be in \[0, 1\], got 2"):
        SuffixDrafter(max_depth=4, min_token_prob=2, cache_requests=1)


# ---- token trees (num_branches > 1) --------------------------------------------------------------------
def test_tree_adds_the_other_continuations_of_the_match():
    drafter = SuffixDrafter(max_depth=16, min_token_prob=0.01, cache_requests=0, num_branches=3)
    drafter.add_request("r", [1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 5, 9, 1, 2], SamplingParams(), None)
    (draft,) = drafter.propose(["r"], [3])
    # "9 1 2" went on with 4 and 5 once each: the tie goes to the smaller id, 5 is the second branch;
    # the shorter suffix "1 2" adds its own continuation 3
    assert draft.token_ids == (4, 9, 1)
    assert draft.tree.token_ids == (4, 9, 1, 5, 9, 1, 3, 9, 1)
    assert draft.tree.parents == (-1, 0, 1, -1, 3, 4, -1, 6, 7)


def test_tree_branches_respect_min_token_prob_and_sampled_requests_get_chains():
    tokens = [1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 5, 9, 1, 2]
    strict = SuffixDrafter(max_depth=16, min_token_prob=0.6, cache_requests=0, num_branches=3)
    strict.add_request("r", tokens, SamplingParams(), None)
    assert strict.propose(["r"], [3])[0].token_ids == ()  # 1/2 < 0.6: no chain, no branches
    sampled = SuffixDrafter(max_depth=16, min_token_prob=0.01, cache_requests=0, num_branches=3)
    sampled.add_request("r", tokens, SamplingParams(temperature=1.0), None)
    (draft,) = sampled.propose(["r"], [3])
    assert draft.token_ids == (4, 9, 1) and draft.tree is None


def test_tree_adds_the_continuations_of_shorter_suffixes():
    drafter = SuffixDrafter(max_depth=16, min_token_prob=0.01, cache_requests=0, num_branches=3)
    # "8 1 2" went on with 3 once; the shorter suffix "1 2" went on with 4 twice, "2" with 4 twice and 3 once
    drafter.add_request("r", [7, 1, 2, 4, 7, 1, 2, 4, 8, 1, 2, 3, 8, 1, 2], SamplingParams(), None)
    (draft,) = drafter.propose(["r"], [2])
    assert draft.token_ids == (3, 8)
    assert draft.tree.token_ids == (3, 8, 4, 7) and draft.tree.parents == (-1, 0, -1, 2)


# ---- the cross-request cache: outputs with a short prompt tail; eviction frees trie nodes --------------
def test_cache_keeps_outputs_and_the_prompt_tail_not_the_whole_prompt() -> None:
    drafter = make_drafter(max_depth=16)  # prompt tail: 16 // 4 = 4 tokens
    prompt = [30, 31, 32, 33, 34, 35, 36, 37, 38, 39]
    drafter.add_request("first", prompt, PARAMS, None)
    drafter.observe("first", [50, 51, 52])
    drafter.remove_request("first")
    drafter.add_request("early", [1, 31, 32], PARAMS, None)  # the prompt's start is not cached
    assert propose_one(drafter, "early", 3) == ()
    drafter.add_request("tail", [2, 37, 38], PARAMS, None)  # its last 4 tokens are
    assert propose_one(drafter, "tail", 3) == (39, 50, 51)


def live_nodes(trie) -> int:
    """Nodes reachable from the root (excluding it)."""
    stack, seen = [0], 0
    while stack:
        children = trie.children(stack.pop())
        seen += len(children)
        stack.extend(children)
    return seen


def test_eviction_frees_nodes_and_leaves_the_same_trie_as_a_fresh_cache() -> None:
    rng = random.Random(3)
    requests = [[rng.choice([0, 1, 2, 3, 4]) for _ in range(rng.randrange(5, 40))] for _ in range(30)]
    evicting = make_drafter(max_depth=8, cache_requests=3)
    for index, tokens in enumerate(requests):
        evicting.add_request(f"r{index}", tokens[:2], PARAMS, None)
        evicting.observe(f"r{index}", tokens[2:])
        evicting.remove_request(f"r{index}")
    fresh = make_drafter(max_depth=8, cache_requests=3)
    for index, tokens in enumerate(requests[-3:]):
        fresh.add_request(f"f{index}", tokens[:2], PARAMS, None)
        fresh.observe(f"f{index}", tokens[2:])
        fresh.remove_request(f"f{index}")
    kept, rebuilt = evicting._cache.trie, fresh._cache.trie
    assert live_nodes(kept) == live_nodes(rebuilt) == len(kept.edges) == len(rebuilt.edges)
    assert len(kept.count) - 1 - len(kept.free) == live_nodes(kept)  # every other node is on the free list
    for query, context in enumerate(([0], [1, 2], [3, 4, 0], [2, 2, 2], [4])):
        evicting.add_request(f"q{query}", context, PARAMS, None)
        fresh.add_request(f"q{query}", context, PARAMS, None)
        for budget in (1, 3, 5):
            assert propose_one(evicting, f"q{query}", budget) == propose_one(fresh, f"q{query}", budget)
