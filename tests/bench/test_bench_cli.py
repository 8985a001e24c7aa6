"""`specdec bench` end to end on a tiny random-weight checkpoint: outputs, schema, lossless failure."""
import json

import pytest

from specdec.bench.methods import SpecdecRunner
from specdec.cli import main
from specdec.kernels import ops

SUMMARY_KEYS = {"tokens_per_s": float, "speedup": (float, type(None)), "mean_accepted_length": (float, type(None)),
                "acceptance_rate": (float, type(None)), "identical_rate": (float, type(None)), "n_prompts": int,
                "ttft_s": float, "decode_tokens_per_s": float, "decode_speedup": float}
RECORD_KEYS = {
    "round",
    "method",
    "family",
    "reference",
    "strict",
    "dataset",
    "question_id",
    "category",
    "turn",
    "prompt_tokens",
    "new_tokens",
    "wall_s",
    "first_token_s",
    "tokens_per_s",
    "verify_steps",
    "drafted_tokens",
    "accepted_tokens",
    "acceptance_rate",
    "mean_accepted_length",
    "position_acceptance_rates",
    "peak_rss_mib",
    "identical",
    "first_mismatch",
    "token_ids",
    "text",
}
pytestmark = pytest.mark.filterwarnings("ignore:draft model .* is not smaller than the target")
PLOTS = ("speedup.png", "acceptance_by_position.png", "tokens_per_s.png")


def _bench(model_dir, datasets, out, *extra):
    # the draft model in the target's format (auto): the target drafts its own tokens, all accepted
    draft = f'{{"model": "{model_dir}", "num_speculative_tokens": 3, "weight_format": "auto"}}'
    methods = f"none,ngram,suffix,draft_model:{draft}"
    argv = ["bench", "--model", str(model_dir), "--methods", methods, "--max-new-tokens", "24", "--out", str(out),
            "--no-progress", "--draft-policy", "fixed", *extra]  # fixed k: every draft position is exercised
    for dataset in datasets:
        argv += ["--dataset", str(dataset)]
    return main(argv)


def test_bench_end_to_end_writes_documented_outputs(tiny_model_dir, spec_bench_file, humaneval_file, tmp_path, capsys):
    out = tmp_path / "out"
    assert _bench(tiny_model_dir, [spec_bench_file, humaneval_file], out, "--repeats", "2") == 0
    captured = capsys.readouterr()
    assert "| ngram |" in captured.out
    err = captured.err
    results = json.loads((out / "results.json").read_text())
    assert results["lossless"] is True and results["mismatches"] == []
    assert results["categories"] == ["writing", "qa", "humaneval", "overall"]
    assert list(results["summary"]) == ["none", "ngram", "suffix", "draft_model"]
    for method, per_category in results["summary"].items():
        assert set(per_category) == set(results["categories"])
        for stats in per_category.values():
            for key, kind in SUMMARY_KEYS.items():
                assert isinstance(stats[key], kind), (method, key, stats[key])
    overall = results["summary"]
    assert overall["none"]["overall"]["n_prompts"] == 5  # 2 turns + 2 + 1 HumanEval
    assert overall["none"]["overall"]["speedup"] == 1.0 and overall["none"]["overall"]["acceptance_rate"] is None
    assert overall["ngram"]["overall"]["identical_rate"] == 1.0
    # the draft model is the target itself: every draft token is accepted
    assert overall["draft_model"]["overall"]["acceptance_rate"] == 1.0
    assert overall["draft_model"]["overall"]["mean_accepted_length"] > 1.0
    assert overall["draft_model"]["overall"]["position_acceptance_rates"] == [1.0, 1.0, 1.0]
    assert len(results["records"]) == 5 * 4 * 2
    assert all(RECORD_KEYS <= set(record) for record in results["records"])
    meta = results["metadata"]
    assert meta["model"] == str(tiny_model_dir) and meta["repeats"] == 2 and meta["torch_version"]
    assert isinstance(meta["threads"], int) and isinstance(meta["command_line"], list)
    assert meta["kernel_isa"] == ops.kernel_isa() and meta["supported_kernel_isas"] == list(ops.supported_isas())
    assert f"[kernels: {ops.kernel_isa()} " in err
    assert "## Speed-up over the reference" in (out / "results.md").read_text()
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_multi_turn_questions_continue_each_methods_own_conversation(tiny_model_dir, spec_bench_file, tmp_path):
    out = tmp_path / "out"
    assert _bench(tiny_model_dir, [spec_bench_file], out, "--categories", "writing", "--no-plots") == 0
    records = json.loads((out / "results.json").read_text())["records"]
    assert {(r["method"], r["turn"]) for r in records} == {(m, t) for m in ("none", "ngram", "suffix", "draft_model")
                                                            for t in (0, 1)}
    for record in (r for r in records if r["turn"] == 1):
        first = next(r for r in records if r["method"] == record["method"] and r["turn"] == 0)
        assert record["prompt_tokens"] > first["prompt_tokens"] + len(first["text"].encode()) // 2
    assert not (out / "speedup.png").exists()


def test_injected_mismatch_fails_the_run(tiny_model_dir, spec_bench_file, tmp_path, monkeypatch, capsys):
    original = SpecdecRunner.generate

    def corrupt(self, prompt_token_ids, max_new_tokens):
        generation = original(self, prompt_token_ids, max_new_tokens)
        if self.label == "ngram":
            index = min(3, len(generation.token_ids) - 1)
            generation.token_ids[index] = (generation.token_ids[index] + 1) % 256
        return generation

    monkeypatch.setattr(SpecdecRunner, "generate", corrupt)
    out = tmp_path / "out"
    assert _bench(tiny_model_dir, [spec_bench_file], out, "--limit", "1", "--no-plots") == 1
    assert "LOSSLESS VIOLATION: ngram vs none" in capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["lossless"] is False
    assert {m["method"] for m in results["mismatches"]} == {"ngram"}
    assert all(m["first_mismatch"] <= 3 and m["strict"] for m in results["mismatches"])
    assert results["summary"]["ngram"]["overall"]["identical_rate"] == 0.0
    assert results["summary"]["suffix"]["overall"]["identical_rate"] == 1.0
    assert "| ngram | none |" in (out / "results.md").read_text()


def test_bad_arguments_exit_with_a_clear_error(tiny_model_dir, spec_bench_file, tmp_path, capsys):
    argv = ["bench", "--model", str(tiny_model_dir), "--dataset", str(spec_bench_file), "--out", str(tmp_path)]
    assert main([*argv, "--methods", "none,lookahead"]) == 2
    assert "unknown benchmark method 'lookahead'" in capsys.readouterr().err
    assert main([*argv, "--methods", "none,eagle"]) == 2
    assert "speculative method 'eagle' needs 'model' (the head file" in capsys.readouterr().err
    assert main([*argv, "--methods", "draft_model"]) == 2
    assert "no default draft" in capsys.readouterr().err
    assert main([*argv, "--categories", "nope"]) == 2
    assert "no questions selected" in capsys.readouterr().err


@pytest.mark.parametrize("peer, module", [("llama-cpp", "llama_cpp"), ("vllm", "vllm")])
def test_missing_peer_is_a_clear_error(peer, module, tiny_model_dir, spec_bench_file, tmp_path, capsys):
    if __import__("importlib").util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed")
    argv = ["bench", "--model", str(tiny_model_dir), "--dataset", str(spec_bench_file), "--out", str(tmp_path),
            "--peer", peer]
    assert main(argv) == 2
    assert "not installed; run scripts/install-peers.sh" in capsys.readouterr().err


def test_transformers_peer_rows_checked_against_their_own_plain(tiny_model_dir, spec_bench_file, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = tmp_path / "out"
    methods = f'none,ngram,draft_model:{{"model": "{tiny_model_dir}"}}'
    argv = ["bench", "--model", str(tiny_model_dir), "--methods", methods, "--dataset", str(spec_bench_file),
            "--categories", "qa", "--limit", "1", "--max-new-tokens", "12", "--out", str(out), "--no-progress",
            "--no-plots", "--peer", "transformers"]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    runners = {runner["label"]: runner for runner in results["runners"]}
    assert runners["hf:plain"]["reference"] is None
    assert runners["hf:prompt_lookup"]["reference"] == runners["hf:assisted"]["reference"] == "hf:plain"
    summary = results["summary"]
    assert summary["hf:plain"]["overall"]["speedup"] == 1.0
    assert summary["hf:assisted"]["overall"]["identical_rate"] == 1.0
    assert summary["hf:assisted"]["overall"]["n_prompts"] == 1
    for label in ("hf:plain", "hf:prompt_lookup", "hf:assisted"):  # the streamer clock saw the first token
        stats = summary[label]["overall"]
        assert 0 < stats["ttft_s"] and stats["decode_tokens_per_s"] > 0, (label, stats)
