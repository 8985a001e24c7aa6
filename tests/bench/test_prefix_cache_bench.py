"""The prefix-cache benchmark runs end to end on a tiny checkpoint: second turns copy the first from the cache."""
import json

from specdec.bench import prefix_cache_bench


def test_second_turns_come_from_the_cache_with_identical_outputs(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "two_turns.jsonl"
    rows = [{"question_id": i, "category": "writing", "turns": [f"Tell me about the number {i} please.", "Shorter."]}
            for i in range(2)] + [{"question_id": 9, "category": "qa", "turns": ["one turn only"]}]
    data.write_text("\n".join(json.dumps(row) for row in rows))
    assert prefix_cache_bench.main(["--model", str(tiny_model_dir), "--dataset", str(data), "--questions", "5",
                                    "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert out.count("question ") == 2  # the one-turn question is skipped
    assert "identical outputs: 2/2" in out
    assert " 0 from the cache" not in out
