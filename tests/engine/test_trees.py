"""Token trees end to end on tiny models: greedy output identical to plain decoding for ngram and suffix
trees (batch 1 and 4, all architectures, a Gemma 3 whose sliding window is crossed by the trees), with
off-first-branch paths actually accepted and compacted; sampled requests verify trees under exact acceptance only
(their output then equals plain seeded sampling: tests/engine/test_seeded_exact.py)."""
import pytest

from specdec.cache.kv_cache import KVCache
from specdec.config import SamplingParams
from specdec.drafters.base import Draft, Drafter
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.suffix import SuffixDrafter
from specdec.drafters.tree import DraftTree
from specdec.engine.engine import Engine, _verified_tree
from specdec.verify.noise import RequestNoise
from test_speculative import PROMPTS, run

MODELS = [("llama", {}), ("qwen2", {}), ("gemma3", {}), ("gemma3", {"sliding_window": 3})]
# branching repetitions: after "1 2" comes 3, 4 or 5, so trees beat chains
TREE_PROMPTS = [
    [1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 5, 9, 1, 2],
    *PROMPTS[1:],
]


def tree_drafter(method, num_branches=4, draft_model=None):
    if method == "ngram":
        return NgramDrafter(prompt_lookup_max=3, prompt_lookup_min=1, num_branches=num_branches)
    if method == "suffix":
        return SuffixDrafter(max_depth=16, min_token_prob=0.01, cache_requests=8, num_branches=num_branches)
    return DraftModelDrafter(draft_model, max_num_seqs=4, max_model_len=256, num_branches=num_branches)


class CompactionSpy:
    """Counts KVCache.compact calls (accepted paths that left the first branch)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = KVCache.compact

        def spy(cache, slot, src, dst):
            self.calls += 1
            return original(cache, slot, src, dst)

        monkeypatch.setattr(KVCache, "compact", spy)


@pytest.mark.parametrize("architecture,overrides", MODELS)
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_tree_output_identical_to_plain(make_tiny_model, tiny_tokenizer, architecture, overrides, method, batch):
    model = make_tiny_model(architecture, **overrides)
    params = SamplingParams(max_tokens=40)
    prompts = TREE_PROMPTS[:batch]
    plain, _ = run(model, tiny_tokenizer, prompts, params)
    draft_model = make_tiny_model(architecture, seed=1, **overrides)
    spec, engine = run(model, tiny_tokenizer, prompts, params, tree_drafter(method, draft_model=draft_model))
    for plain_seq, spec_seq in zip(plain, spec):
        assert spec_seq.output_token_ids == plain_seq.output_token_ids
        assert spec_seq.finish_reason == plain_seq.finish_reason
    assert engine.metrics.verify_steps > 0


class OracleTreeDrafter(Drafter):
    """Knows the plain greedy output; hides it in the second or third branch behind wrong first branches, so
    the accepted path leaves the first branch (and needs compaction) at every depth over the run."""

    def __init__(self, expected_by_prompt, num_branches=3):
        self.expected_by_prompt = expected_by_prompt  # prompt tuple -> prompt + plain output
        self.num_branches = num_branches
        self.state = {}  # request id -> [expected tokens, tokens so far, steps]

    def add_request(self, request_id, prompt_token_ids, params, generator):
        self.state[request_id] = [self.expected_by_prompt[tuple(prompt_token_ids)], list(prompt_token_ids), 0]

    def propose(self, request_ids, max_draft_tokens):
        drafts = []
        for request_id, budget in zip(request_ids, max_draft_tokens):
            expected, tokens, steps = self.state[request_id]
            truth = expected[len(tokens) : len(tokens) + budget]
            self.state[request_id][2] += 1
            if not truth:
                drafts.append(Draft(()))
                continue
            cut = steps % len(truth)  # the first branch is right up to depth `cut`, then wrong
            wrong = lambda token: (token + 1) % 256  # noqa: E731
            branches = [(*truth[:cut], wrong(truth[cut])), (wrong(truth[0]) + 1,), tuple(truth)][: self.num_branches]
            drafts.append(Draft.from_branches(branches))
        return drafts

    def observe(self, request_id, token_ids):
        self.state[request_id][1].extend(token_ids)

    def remove_request(self, request_id):
        del self.state[request_id]


@pytest.mark.parametrize("architecture,overrides", MODELS)
@pytest.mark.parametrize("batch", [1, 4])
def test_oracle_trees_accept_off_branch_paths_exactly(make_tiny_model, tiny_tokenizer, monkeypatch, architecture,
                                                      overrides, batch):
    model = make_tiny_model(architecture, **overrides)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain, _ = run(model, tiny_tokenizer, PROMPTS[:batch], params)
    expected = {tuple(prompt): prompt + seq.output_token_ids for prompt, seq in zip(PROMPTS, plain)}
    _, chains = run(model, tiny_tokenizer, PROMPTS[:batch], params, OracleTreeDrafter(expected, num_branches=1), k=5)
    spy = CompactionSpy(monkeypatch)
    spec, trees = run(model, tiny_tokenizer, PROMPTS[:batch], params, OracleTreeDrafter(expected), k=5)
    assert [seq.output_token_ids for seq in spec] == [seq.output_token_ids for seq in plain]
    assert spy.calls > 0
    assert trees.metrics.mean_accepted_length > chains.metrics.mean_accepted_length + 1.0


def test_sampled_requests_verify_chains_under_rejection_sampling(make_tiny_model, tiny_tokenizer, monkeypatch):
    model = make_tiny_model("llama")
    spy = CompactionSpy(monkeypatch)
    engine = Engine(model, tiny_tokenizer, max_num_seqs=4, max_model_len=256, drafter=tree_drafter("ngram"),
                    num_speculative_tokens=4, acceptance="rejection")
    for prompt in TREE_PROMPTS:
        engine.add_request(prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=30))
    while engine.has_unfinished():
        engine.step()
    assert spy.calls == 0 and engine.metrics.verify_steps > 0
    drafter = tree_drafter("ngram")
    drafter.add_request("sampled", TREE_PROMPTS[0], SamplingParams(temperature=1.0), RequestNoise(0, "rejection"))
    drafter.add_request("exact", TREE_PROMPTS[0], SamplingParams(temperature=1.0), RequestNoise(0, "exact"))
    drafter.add_request("greedy", TREE_PROMPTS[0], SamplingParams(), None)
    sampled, exact, greedy = drafter.propose(["sampled", "exact", "greedy"], [4, 4, 4])
    assert sampled.tree is None and exact.tree is not None and greedy.tree is not None


def test_the_engine_verifies_a_sampled_tree_only_under_exact_acceptance(make_tiny_model, tiny_tokenizer):
    draft = Draft((1, 2), None, DraftTree((1, 2, 3), (-1, 0, -1)))
    for acceptance, verified in (("exact", True), ("rejection", False)):
        engine = Engine(make_tiny_model("llama"), tiny_tokenizer, max_num_seqs=2, max_model_len=64,
                        acceptance=acceptance)
        assert _verified_tree(engine.add_request([1, 2], SamplingParams()), draft) is draft.tree
        sampled = engine.add_request([1, 2], SamplingParams(temperature=0.5))
        assert (_verified_tree(sampled, draft) is draft.tree) is verified


def test_tree_nodes_stay_within_the_row_budget(make_tiny_model, tiny_tokenizer):
    """k = 4 per branch, 8 branches, max_verify_tokens 12 with batch 2: at most 12 // 2 - 1 = 5 nodes each."""
    model = make_tiny_model("llama")
    engine = Engine(model, tiny_tokenizer, max_num_seqs=2, max_model_len=256, drafter=tree_drafter("ngram", 8),
                    num_speculative_tokens=4, max_verify_tokens=12)
    rows = []
    original = model.forward
    model.forward = lambda batch, cache: (rows.append(batch.row_counts), original(batch, cache))[1]
    try:
        for prompt in TREE_PROMPTS[:2]:
            engine.add_request(prompt, SamplingParams(max_tokens=30))
        while engine.has_unfinished():
            engine.step()
    finally:
        del model.forward
    assert max(count for counts in rows[1:] for count in counts) <= 6  # rows[0]: the prefill
