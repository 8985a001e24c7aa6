"""`specdec train-draft` end to end on a tiny checkpoint: head files, resume, then the head in `specdec bench`."""
import json

import pytest

from specdec.cli import main


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_train_draft_writes_a_head_that_resumes_and_benchmarks(
    tiny_model_dir, spec_bench_file, humaneval_file, tmp_path, method
):
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
    # the fixture files hold 4 questions: indices 0 and 2 of spec_bench and the HumanEval task train, index 1 is held
    # out
    assert training["samples"] == 3 and training["sequences"] == 3 * 3  # 3 continuations of each training prompt
    assert 0 < training["continuation_tokens"] <= 3 * 3 * 8
    assert (training["loss_positions"], training["token_weight"], training["precision"]) == (
        "continuation",
        1.0,
        "bf16",
    )
    held_out = training["held_out"]
    assert held_out["sequences"] == 1 and held_out["starts"] > 0 and len(held_out["chain_acceptance"]) == 5
    assert held_out["mean_accepted_length"] == pytest.approx(1 + sum(held_out["chain_acceptance"]), abs=1e-3)
    capsys.readouterr()
    assert main(argv + ["--holdout-every", "0"]) == 2  # the last value given wins
    assert "--eval-prompts needs --holdout-every" in capsys.readouterr().err
    assert main(argv + ["--samples", "0"]) == 2
    assert "--samples must be >= 1" in capsys.readouterr().err


def test_train_draft_adds_self_instructed_questions_and_warm_starts(tiny_model_dir, spec_bench_file, humaneval_file,
                                                                    tmp_path, capsys):
    from specdec.heads.config import load_head

    base = ["train-draft", "--model", str(tiny_model_dir), "--method", "eagle", "--prompts", str(spec_bench_file),
            "--prompts", str(humaneval_file), "--max-new-tokens", "8", "--batch-tokens", "64", "--threads", "1",
            "--steps", "2"]
    first, second = tmp_path / "first.safetensors", tmp_path / "second.safetensors"
    assert main(base + ["--out", str(first)]) == 0
    assert main(base + ["--out", str(second), "--self-instruct", "4", "--self-instruct-max-tokens", "24",
                        "--init-from", str(first)]) == 0
    training = json.loads(second.with_suffix(".json").read_text())["training"]
    rows = (tmp_path / f"{tiny_model_dir.name}-features-self-instruct" / "questions.jsonl").read_text().splitlines()
    assert rows and training["self_instruct"]["questions"] == len(rows)
    assert training["sequences"] == 4 + len(rows)  # the dev prompts' continuations (cached) and the new questions'
    first_tokens = json.loads(first.with_suffix(".json").read_text())["training"]["tokens"]
    assert training["tokens"] == first_tokens + training["self_instruct"]["tokens"]
    assert training["init_from"] == str(first)
    assert load_head(second).draft_token_ids.tolist() == load_head(first).draft_token_ids.tolist()
    capsys.readouterr()
    assert main(base + ["--out", str(tmp_path / "third.safetensors"), "--init-from", str(first),
                        "--draft-vocab", "64"]) == 2
    assert "another configuration (draft_vocab_size differ)" in capsys.readouterr().err
    assert main(base + ["--out", str(tmp_path / "third.safetensors"), "--self-instruct", "-1"]) == 2
    assert "--self-instruct must be >= 0" in capsys.readouterr().err
