"""The sampling benchmark end to end on a tiny random-weight checkpoint (the target as its own draft model): the
JSON's shape, one row per (drafter, temperature, acceptance), and exact acceptance identical to plain seeded
sampling for every output."""
import json

import pytest

from specdec.bench import sampling_bench
from specdec.config import ACCEPTANCE_METHODS

pytestmark = pytest.mark.filterwarnings("ignore:draft model .* is not smaller than the target")


def test_the_bench_writes_every_row_and_exact_acceptance_is_identical(tiny_model_dir, spec_bench_file,
                                                                      humaneval_file, tmp_path, capsys):
    out = tmp_path / "out"
    # the draft model in the target's format (auto): the target drafting with its own numbers
    argv = ["--target", str(tiny_model_dir), "--draft-model", str(tiny_model_dir), "--draft-weight-format", "auto",
            "--dataset", str(humaneval_file), "--dataset", str(spec_bench_file), "--prompts", "3", "--max-tokens", "12",
            "--temperatures", "0.5,1.0", "--k", "3", "--threads", "2", "--out", str(out)]
    assert sampling_bench.main(argv) == 0
    results = json.loads((out / "sampling_bench.json").read_text())
    rows = results["rows"]
    assert [(row["drafter"], row["temperature"], row["acceptance"]) for row in rows] == [
        (drafter, temperature, acceptance) for drafter in sampling_bench.DRAFTERS for temperature in (0.5, 1.0)
        for acceptance in ACCEPTANCE_METHODS]
    assert set(rows[0]) == {"drafter", "temperature", "acceptance", "acceptance_rate", "mean_accepted_length",
                            "tokens_per_s", "plain_tokens_per_s", "speedup", "identical_fraction", "outputs", "tokens"}
    assert all(row["identical_fraction"] == 1.0 and row["outputs"] == 3 for row in rows if row["acceptance"] == "exact")
    assert results["exact_identical"] is True
    draft_model_exact = [row for row in rows if row["drafter"] == "draft_model" and row["acceptance"] == "exact"]
    assert all(row["acceptance_rate"] == 1.0 for row in draft_model_exact)  # the target drafting with its own numbers
    metadata = results["metadata"]
    assert metadata["bit_exact"] is True and metadata["cpu"] and metadata["seeds"] == [0, 1, 2]
    assert metadata["questions"] == ["humaneval/HumanEval/0", "spec_bench/81", "spec_bench/82"]
    assert len(results["records"]) == 2 * 3 * (1 + 2 * len(sampling_bench.DRAFTERS))
    table = capsys.readouterr().out
    assert table.count("| exact |") == 6 and "| speed-up |" in table


def test_the_options_are_checked():
    for flags in (["--drafters", "eagle"], ["--temperatures", "0"], ["--prompts", "0"]):
        with pytest.raises(ValueError):
            sampling_bench.setup_from_args(sampling_bench.parse_args(flags))
