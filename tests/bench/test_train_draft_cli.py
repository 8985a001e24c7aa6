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
