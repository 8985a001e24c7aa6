"""The structured-output benchmark's parts: a schema per Spec-Bench category, the prompts, the validation counts,
the rows and the table; and the whole run on a tiny random-weight checkpoint (the target as its own draft model)."""
import json

import pytest

from specdec.bench import structured_bench as sb
from specdec.config import GuidedDecoding
from specdec.verify.grammar import GrammarMatcher

pytestmark = pytest.mark.filterwarnings("ignore:draft model .* is not smaller than the target")

# Spec-Bench's categories (the MT-bench ones, then its own), as ../shared/data/spec_bench_dev.jsonl holds them
SPEC_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
                         "translation", "summarization", "qa", "math_reasoning", "rag"}


def test_every_spec_bench_category_has_a_schema_the_grammar_engine_takes(tiny_tokenizer):
    assert set(sb.CATEGORY_SCHEMAS) == SPEC_BENCH_CATEGORIES
    for schema in [*sb.CATEGORY_SCHEMAS.values(), sb.tool_call_schema()]:
        GrammarMatcher(GuidedDecoding(json_schema=schema), tiny_tokenizer, 300, tiny_tokenizer.eos_token_ids)
    for category, schema in sb.CATEGORY_SCHEMAS.items():
        text = sb.json_instruction("Q?", schema)
        assert all(f'"{name}"' in text for name in schema["properties"]), category


def test_the_tool_schema_takes_a_call_of_each_tool_and_nothing_else():
    import jsonschema

    schema = sb.tool_call_schema()
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, schema)
    jsonschema.validate({"name": "search_web", "arguments": {"query": "x", "max_results": 3}}, schema)
    for wrong in ({"name": "get_weather", "arguments": {"query": "x", "max_results": 3}},
                  {"name": "delete_files", "arguments": {}}, {"name": "send_email"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_prompts_per_category_then_tools_and_the_limit(spec_bench_file, tmp_path):
    prompts = sb.load_prompts(str(spec_bench_file), per_category=1, tool_prompts=2)
    assert [(p.key, p.category) for p in prompts] == [("spec_bench/81", "writing"), ("spec_bench/82", "qa"),
                                                      ("tool/0", "tool_call"), ("tool/1", "tool_call")]
    assert prompts[0].text.startswith("Write a poem about the sea.") and '"title"' in prompts[0].text
    assert prompts[0].schema == sb.CATEGORY_SCHEMAS["writing"] and prompts[2].schema == sb.tool_call_schema()
    assert [p.key for p in sb.load_prompts(str(spec_bench_file), 2, 3, limit=1)] == ["spec_bench/81", "tool/0"]
    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text(json.dumps({"question_id": 1, "category": "poetry", "turns": ["A haiku."]}) + "\n")
    with pytest.raises(ValueError, match=r"no JSON schema for the categories \['poetry'\]"):
        sb.load_prompts(str(unknown), 1, 0)


def test_check_output_counts_valid_invalid_and_truncated():
    schema = sb.CATEGORY_SCHEMAS["qa"]
    assert sb.check_output('{"answer": "Paris", "confidence": "high"}', schema, "stop") == (sb.VALID, None)
    assert sb.check_output('```json\n{"answer": "Paris", "confidence": "low"}\n```', schema, "stop")[0] == sb.VALID
    status, error = sb.check_output('{"answer": "Paris", "confidence": "sure"}', schema, "stop")
    assert status == sb.INVALID and error.startswith("schema: 'sure' is not one of")
    status, error = sb.check_output('{"answer": "Par', schema, "stop")
    assert status == sb.INVALID and error.startswith("not JSON")
    assert sb.check_output('{"answer": "Par', schema, "length") == (sb.TRUNCATED, None)


def record(method, constrained, prompt, tokens, wall_s, drafted=0, accepted=0, steps=0, status=sb.VALID,
           identical=True, mask_s=0.0, grammar_s=0.0):
    return {"method": method, "constrained": constrained, "prompt": prompt, "category": "qa", "new_tokens": tokens,
            "wall_s": wall_s, "drafted_tokens": drafted, "accepted_tokens": accepted, "verify_steps": steps,
            "grammar_mask_time_s": mask_s, "grammar_masks": 0, "grammar_time_s": grammar_s, "finish_reason": "stop",
            "status": status, "error": "schema: bad" if status == sb.INVALID else None, "identical": identical,
            "text": "{}"}


def test_rows_speedups_kept_speedup_and_counts():
    records = [record("plain", True, "a", 10, 1.0, mask_s=1e-3, grammar_s=2e-3),
               record("plain", False, "a", 10, 1.0, status=sb.INVALID),
               record("ngram", True, "a", 10, 0.5, drafted=8, accepted=6, steps=4, mask_s=2e-3, grammar_s=3e-3),
               record("ngram", False, "a", 10, 0.4, drafted=8, accepted=4, steps=4, status=sb.TRUNCATED,
                      identical=False)]
    rows = {(row.method, row.constrained): row for row in sb.summarize(records)}
    assert [key for key in rows] == [("plain", True), ("plain", False), ("ngram", True), ("ngram", False)]
    constrained, free = rows[("ngram", True)], rows[("ngram", False)]
    assert constrained.speedup == pytest.approx(2.0) and free.speedup == pytest.approx(2.5)
    assert constrained.kept_speedup == pytest.approx(0.8) and free.kept_speedup is None
    assert constrained.acceptance_rate == pytest.approx(0.75)
    assert constrained.mean_accepted_length == pytest.approx(2.5)
    assert constrained.mask_us_per_token == pytest.approx(200)
    assert constrained.grammar_us_per_token == pytest.approx(300)
    assert free.mask_us_per_token is None and rows[("plain", True)].acceptance_rate is None
    assert (free.valid, free.invalid, free.truncated, free.identical) == (0, 0, 1, 0)
    assert rows[("plain", False)].invalid == 1
    table = sb.format_table(list(rows.values())).splitlines()
    assert len(table) == 2 + 4
    assert table[4].startswith("| ngram | yes | 20.0 | 2.00x | 0.80 | 0.75 | 2.50 | 200 | 300 |")
    assert table[5].endswith("| 0 / 0 / 1 | 0/1 |")
    # an unconstrained output that does not validate is information; a differing output is a bug with exact kernels
    assert sb.failures(records, bit_exact=True) == ["NOT IDENTICAL to plain decoding (ngram free a)"]
    assert sb.failures(records, bit_exact=False) == []
    records[2]["status"] = sb.INVALID
    assert sb.failures(records, bit_exact=False)[0].startswith("INVALID constrained output (ngram constrained a)")


def test_the_bench_runs_every_case_on_a_tiny_checkpoint(tiny_model_dir, spec_bench_file, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--target", str(tiny_model_dir), "--draft-model", str(tiny_model_dir), "--dataset", str(spec_bench_file),
            "--per-category", "2", "--tool-prompts", "0", "--max-tokens", "12", "--k", "3", "--threads", "2",
            "--out", str(out)]  # no tool prompt: its tool list is longer than the tiny model's 512 positions
    assert sb.main(argv) == 0
    results = json.loads((out / "structured_bench.json").read_text())
    assert [(row["method"], row["constrained"]) for row in results["rows"]] == [
        (method, constrained) for method in ("plain", *sb.DRAFTERS) for constrained in (True, False)]
    assert results["failures"] == [] and results["metadata"]["prompts"] == ["spec_bench/81", "spec_bench/82",
                                                                              "spec_bench/83"]
    assert all(row["identical"] == row["outputs"] == 3 for row in results["rows"])
    constrained = [r for r in results["records"] if r["constrained"]]
    assert all(r["grammar_masks"] > 0 and r["status"] in (sb.VALID, sb.TRUNCATED) for r in constrained)
    assert capsys.readouterr().out.count("| yes |") == 4


def test_the_options_are_checked():
    for flags in (["--drafters", "eagle"], ["--tool-prompts", "7"], ["--limit", "0"], ["--k", "0"]):
        with pytest.raises(ValueError):
            sb.setup_from_args(sb.parse_args(flags))
