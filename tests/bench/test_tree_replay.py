"""The replay of lookup drafters on a bench run's plain outputs gives the engine's own steps (fixed draft depth)."""
import json

import pytest

from specdec.bench.tree_replay import (CopyOracle, ReplayCase, accepted_draft_tokens, cases_from_results, main,
                                       replay)
from specdec.cli import main as cli_main
from specdec.config import SpeculativeConfig
from specdec.drafters.base import Draft
from specdec.models.loader import load_tokenizer

LOOKUP_CONFIGS = {
    "ngram-chain": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    "ngram-tree": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "num_draft_branches": 4},
    # no cross-request cache: the bench's warm-up request would be in it, and the replay does not see that request
    "suffix-chain": {"method": "suffix", "num_speculative_tokens": 4, "suffix_cache_requests": 0},
    "suffix-tree": {"method": "suffix", "num_speculative_tokens": 4, "suffix_cache_requests": 0,
                    "num_draft_branches": 3},
}


@pytest.fixture(scope="module")
def bench_run(tiny_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("replay-data")
    rows = [{"question_id": 1, "category": "qa", "turns": ["a b a b a b a b", "again: a b a b"]},
            {"question_id": 2, "category": "summarization", "turns": ["one two three one two three one two"]},
            {"question_id": 3, "category": "qa", "turns": ["x y z x y z x y z"]}]
    dataset = data / "spec_bench.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = data / "out"
    methods = ",".join(
        ["none"]
        + [
            f"{config['method']}:{json.dumps({**{k: v for k, v in config.items() if k != 'method'}, 'label': label})}"
            for label, config in LOOKUP_CONFIGS.items()
        ]
    )
    argv = ["bench", "--model", str(tiny_model_dir), "--methods", methods, "--dataset", str(dataset),
            "--max-new-tokens", "40", "--out", str(out), "--no-progress", "--no-plots", "--draft-policy", "fixed"]
    assert cli_main(argv) == 0
    return out / "results.json"


def test_replay_gives_the_steps_the_engine_took(bench_run, tiny_model_dir):
    results = json.loads(bench_run.read_text())
    cases = cases_from_results(results, load_tokenizer(tiny_model_dir))
    assert [(case.question_id, case.turn) for case in cases] == [("1", 0), ("1", 1), ("2", 0), ("3", 0)]
    for label, config in LOOKUP_CONFIGS.items():
        records = [r for r in results["records"] if r["method"] == label]
        engine_steps = sum(r["verify_steps"] for r in records)
        engine_accepted = sum(r["accepted_tokens"] for r in records)
        replayed = replay(SpeculativeConfig.from_dict(config), cases)
        assert (replayed.verify_steps, replayed.accepted_tokens) == (engine_steps, engine_accepted), label
        assert replayed.new_tokens == sum(r["new_tokens"] - 1 for r in records)
        assert engine_accepted > 0, f"{label}: no draft was accepted, so the comparison proves little"


def test_replay_counts_only_the_categories_asked_for(bench_run, tiny_model_dir):
    results = json.loads(bench_run.read_text())
    cases = cases_from_results(results, load_tokenizer(tiny_model_dir))
    config = SpeculativeConfig.from_dict(LOOKUP_CONFIGS["ngram-chain"])
    everything, qa, summarization = (replay(config, cases, categories) for categories in
                                     (None, {"qa"}, {"summarization"}))
    assert qa.verify_steps + summarization.verify_steps == everything.verify_steps
    assert qa.forwards + summarization.forwards == everything.forwards
    assert qa.new_tokens == sum(r["new_tokens"] - 1 for r in results["records"]
                                      if r["method"] == "none" and r["category"] == "qa")


def test_cli_prints_chains_and_trees_side_by_side(bench_run, tiny_model_dir, tmp_path, capsys):
    out_json = tmp_path / "rows.json"
    assert main([str(bench_run), "--model", str(tiny_model_dir), "--config",
                 json.dumps(LOOKUP_CONFIGS["ngram-chain"]), "--branches", "1,4", "--json", str(out_json),
                 "--oracle-context", "1"]) == 0
    table = capsys.readouterr().out
    assert (
        "| ngram | 3 | 1 |" in table and "| ngram | 3 | 4 |" in table and "| copy oracle, context 1 | 3 | 1 |" in table
    )
    rows = json.loads(out_json.read_text())
    assert [row["branches"] for row in rows] == [1, 4, 1]
    assert rows[1]["mean_accepted_length"] >= rows[0]["mean_accepted_length"]


def test_cli_rejects_a_model_drafter_and_unknown_categories(bench_run, tiny_model_dir, capsys):
    config = json.dumps({"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 2})
    assert main([str(bench_run), "--model", str(tiny_model_dir), "--config", config]) == 2
    assert "not a lookup drafter" in capsys.readouterr().err
    assert main([str(bench_run), "--model", str(tiny_model_dir), "--config", json.dumps(LOOKUP_CONFIGS["ngram-chain"]),
                 "--categories", "poetry"]) == 2
    assert "no plain row of categories ['poetry']" in capsys.readouterr().err
    assert main([str(bench_run), "--model", str(tiny_model_dir), "--config", json.dumps(LOOKUP_CONFIGS["ngram-chain"]),
                 "--oracle-context", "0"]) == 2
    assert "--oracle-context needs contexts of at least 1 token" in capsys.readouterr().err


def test_a_changed_dataset_is_an_error(bench_run, tiny_model_dir):
    results = json.loads(bench_run.read_text())
    plain = next(r for r in results["records"] if r["method"] == "none")
    plain["prompt_tokens"] += 1
    with pytest.raises(ValueError, match="the rebuilt prompt has"):
        cases_from_results(results, load_tokenizer(tiny_model_dir))


def test_accepted_draft_tokens_follows_the_matching_tree_path():
    chain = Draft(token_ids=(5, 6, 7))
    assert accepted_draft_tokens(chain, [5, 6, 9, 9]) == 2
    assert accepted_draft_tokens(chain, [5, 6]) == 2  # the target's tokens end (end of the output)
    tree = Draft.from_branches([(5, 6, 7), (5, 8, 9, 10), (4,)])
    assert accepted_draft_tokens(tree, [5, 8, 9, 10, 11]) == 4
    assert accepted_draft_tokens(tree, [4, 6]) == 1
    assert accepted_draft_tokens(tree, [3]) == 0


def test_replay_of_a_sequence_that_repeats_itself():
    # prompt "1 2 3 4" and the target repeating it: after the first "1", the 2-gram "4 1" is not seen, but
    # "1" (min 1) continues with "2 3 4" — so every later step accepts the whole depth-3 draft
    case = ReplayCase("qa", "q", 0, [1, 2, 3, 4], [1, 2, 3, 4, 1, 2, 3, 4, 1], max_new_tokens=9)
    result = replay(SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                                 "prompt_lookup_min": 1}), [case])
    # the first token comes from the prefill, then two verify steps commit 3 accepted + 1 each
    assert (result.forwards, result.verify_steps, result.accepted_tokens, result.new_tokens) == (2, 2, 6, 8)
    assert result.mean_accepted_length == 4.0 and result.nodes_per_step == 3.0


def test_the_copy_oracle_never_drafts_a_failing_token_and_bounds_the_lookup_drafters(bench_run, tiny_model_dir):
    results = json.loads(bench_run.read_text())
    cases = cases_from_results(results, load_tokenizer(tiny_model_dir))
    for context in (1, 2):
        config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                              "prompt_lookup_min": context})
        oracle = replay(config, cases, drafter=CopyOracle(cases, context), label="oracle")
        assert oracle.accepted_tokens == oracle.draft_nodes > 0  # every drafted token accepted
        assert oracle.tokens_per_forward >= replay(config, cases).tokens_per_forward
        assert oracle.label == "oracle" and oracle.new_tokens == replay(config, cases).new_tokens


def test_the_copy_oracle_copies_only_after_its_context():
    case = ReplayCase("qa", "q", 0, [1, 2, 3, 4, 9, 2, 3], [4, 2, 3, 5], max_new_tokens=8)
    oracle = CopyOracle([case], context=2)
    oracle.add_request("r", case.prompt_token_ids, None, None)
    assert oracle.propose(["r"], [3])[0].token_ids == (4,)  # "2 3" is followed by 4 (then 9, not 2)
    oracle.observe("r", [4])
    assert oracle.propose(["r"], [3])[0].token_ids == ()  # "3 4" is followed by 9, the answer goes on with 2
    one_token = CopyOracle([case], context=1)
    one_token.add_request("r", case.prompt_token_ids, None, None)
    one_token.observe("r", [4])
    assert one_token.propose(["r"], [3])[0].token_ids == ()  # after 4 comes 9 only
    with pytest.raises(ValueError, match="at least 1 token"):
        CopyOracle([case], context=0)
