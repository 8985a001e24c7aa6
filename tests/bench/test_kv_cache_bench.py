"""The KV-cache dtype benchmark runs end to end on a tiny checkpoint and reports both caches."""
import json

from specdec.bench import kv_cache_bench


def test_kv_cache_bench_reports_speed_and_accuracy_of_both_caches(tiny_model_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [text]}) for text in ("abc abc abc", "hello there")))
    assert kv_cache_bench.main(["--model", str(tiny_model_dir), "--contexts", "16,40", "--rounds", "2",
                                "--accuracy-prompts", "2", "--new-tokens", "4", "--prompts", str(prompts)]) == 0
    out = capsys.readouterr().out
    assert out.count("context ") == 2 and "T(8) fp16" in out
    assert "q8 + fp32 cache vs fp32 reference over 2 prompts x 5 positions" in out
    assert "q8 + fp16 cache vs fp32 reference" in out
