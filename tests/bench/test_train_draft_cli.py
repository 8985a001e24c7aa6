"""`specdec train-draft` end to end on a tiny checkpoint: head files, resume, then the head in `specdec bench`."""
import json

import pytest

from specdec.cli import main


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_train_draft_writes_a_head_that_resumes_and_benchmarks(tiny_model_dir, spec_bench_file, humaneval_file, tmp_path,
                                                               method):
    out = tmp_path / f"{method}.safetensors"
    argv = ["train-draft", "--model", str(tiny_model_dir), "--method", method, "--prompts", str(spec_bench_file),
            "--prompts", str(humaneval_file), "--max-new-tokens", "8", "--batch-tokens", "64", "--out", str(out),
            "--threads", "1"]
    assert main(argv + ["--steps", "3"]) == 0
    for suffix in (".safetensors", ".json", ".png", ".ckpt"):
        assert out.with_suffix(suffix).is_file(), suffix
    training = json.loads(out.with_suffix(".json").read_text())["training"]
    assert training["steps"] == 3 and training["sequences"] == 4 and training["tokens"] > 0
    assert (tmp_path / f"{tiny_model_dir.name}-features" / "shard-00000.safetensors").is_file()  # cached features
    assert main(argv + ["--steps", "5"]) == 0  # resumes at step 3 from the checkpoint, reuses the features
    assert json.loads(out.with_suffix(".json").read_text())["training"]["steps"] == 5
    bench_out = tmp_path / "bench"
    methods = f'none,{method}:{{"model": "{out}", "num_speculative_tokens": 3}}'
    assert main(["bench", "--model", str(tiny_model_dir), "--methods", methods, "--dataset", str(spec_bench_file),
                 "--max-new-tokens", "16", "--out", str(bench_out), "--no-progress", "--no-plots",
                 "--draft-policy", "fixed"]) == 0
    results = json.loads((bench_out / "results.json").read_text())
    assert results["lossless"] is True and list(results["summary"]) == ["none", method]


def test_train_draft_samples_more_continuations_and_reports_held_out_chains(tiny_model_dir, spec_bench_file,
                                                                           humaneval_file, tmp_path, capsys):
    out = tmp_path / "eagle.safetensors"
    argv = ["train-draft", "--model", str(tiny_model_dir), "--method", "eagle", "--prompts", str(spec_bench_file),
            "--prompts", str(humaneval_file), "--max-new-tokens", "8", "--batch-tokens", "64", "--out", str(out),
            "--threads", "1", "--steps", "2", "--holdout-every", "2", "--samples", "3", "--eval-prompts", "2",
            "--loss-positions", "continuation", "--token-weight", "1.0", "--precision", "bf16", "--unroll-steps", "2"]
    assert main(argv) == 0
    training = json.loads(out.with_suffix(".json").read_text())["training"]
    # the fixture files hold 4 questions: indices 0 and 2 of spec_bench and the HumanEval task train, index 1 is held out
    assert training["samples"] == 3 and training["sequences"] == 3 * 3  # 3 continuations of each training prompt
    assert 0 < training["continuation_tokens"] <= 3 * 3 * 8
    assert (training["loss_positions"], training["token_weight"], training["precision"]) == ("continuation", 1.0, "bf16")
    held_out = training["held_out"]
    assert held_out["sequences"] == 1 and held_out["starts"] > 0 and len(held_out["chain_acceptance"]) == 5
    assert held_out["mean_accepted_length"] == pytest.approx(1 + sum(held_out["chain_acceptance"]), abs=1e-3)
    capsys.readouterr()
    assert main(argv + ["--holdout-every", "0"]) == 2  # the last value given wins
    assert "--eval-prompts needs --holdout-every" in capsys.readouterr().err
    assert main(argv + ["--samples", "0"]) == 2
    assert "--samples must be >= 1" in capsys.readouterr().err
