"""The load script against a tiny-model server: every level completes without errors or malformed
responses, and the JSON report carries throughput, latency percentiles, RSS and acceptance."""
import json

from specdec.bench import load_test


def test_load_test_against_tiny_server(ngram_server, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"question_id": i, "category": "summarization", "turns": [f"repeat abc abc abc {i}"]} for i in range(5)]
    rows.append({"question_id": 99, "category": "qa", "turns": ["not this one"]})
    prompts.write_text("\n".join(json.dumps(row) for row in rows))
    output = tmp_path / "report.json"
    code = load_test.main(["--url", ngram_server.url, "--concurrency", "1,4", "--prompts", str(prompts),
                           "--category", "summarization", "--max-tokens", "16", "--requests", "6",
                           "--rss-interval", "0.01", "--output", str(output)])
    report = json.loads(output.read_text())
    assert code == 0 and report["errors"] == 0 and report["malformed"] == 0
    assert [level["concurrency"] for level in report["levels"]] == [1, 4]
    for level in report["levels"]:
        assert level["requests"] == 6 and level["output_tok_s"] > 0
        assert 0 < level["ttft_p50_s"] <= level["ttft_p95_s"] and level["latency_p50_s"] <= level["latency_p95_s"]
        assert level["server_rss_mb"] > 1 and level["acceptance_rate"] is not None
        assert level["server_rss_samples_mb"] and min(level["server_rss_samples_mb"]) > 1
    assert "tok/s" in capsys.readouterr().out


def test_load_test_counts_errors(ngram_server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["y" * 400]}))  # longer than the context
    output = tmp_path / "report.json"
    code = load_test.main(["--url", ngram_server.url, "--concurrency", "2", "--prompts", str(prompts),
                           "--category", "x", "--max-tokens", "8", "--requests", "2", "--output", str(output)])
    report = json.loads(output.read_text())
    assert code == 1 and report["errors"] == 2 and "HTTP 400" in report["levels"][0]["error_samples"][0]


def test_rss_growth_compares_the_last_quarter_with_the_second():
    assert load_test.rss_growth_mb([100.0] * 7) is None  # too few samples
    assert load_test.rss_growth_mb([50.0, 50.0] + [100.0] * 4 + [110.0] * 2) == 10.0  # warm-up quarter ignored


def test_load_prompts_reads_spec_bench_and_humaneval_rows(tmp_path):
    """The prompts come through the bench's one dataset reader: Spec-Bench first turns by category, HumanEval
    prompts (category "humaneval"); an empty selection is an error naming the category."""
    import pytest

    spec = tmp_path / "spec.jsonl"
    spec.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [f"{c} {i}", "second"]})
                              for i, c in enumerate(["qa", "writing", "qa"])))
    humaneval = tmp_path / "humaneval.jsonl"
    humaneval.write_text(json.dumps({"task_id": "HumanEval/0", "prompt": "def f(x):\n    return x\n"}))
    assert load_test.load_prompts(str(spec), "qa") == ["qa 0", "qa 2"]
    assert load_test.load_prompts(str(spec), None) == ["qa 0", "writing 1", "qa 2"]
    assert len(load_test.load_prompts(str(humaneval), None)) == 1
    assert load_test.load_prompts(str(humaneval), "humaneval") == load_test.load_prompts(str(humaneval), None)
    with pytest.raises(ValueError, match="no prompts with category 'math'"):
        load_test.load_prompts(str(spec), "math")
