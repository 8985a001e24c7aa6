"""Benchmark building blocks: method parsing, datasets, conversations, lossless comparison, summaries."""
import json

import pytest

from specdec.datasets import HUMANEVAL_CATEGORY, load_questions
from specdec.bench.methods import Generation, Runner, parse_methods, split_methods
from specdec.bench.report import OVERALL, build_results
from specdec.bench.runner import check_lossless, first_difference, run_round


def test_split_methods_keeps_json_commas():
    assert split_methods('none, ngram:{"num_speculative_tokens":7,"prompt_lookup_max":3},suffix') == [
        "none", 'ngram:{"num_speculative_tokens":7,"prompt_lookup_max":3}', "suffix"]
    with pytest.raises(ValueError, match="unbalanced"):
        split_methods('ngram:{"a":1')


def test_parse_methods_defaults_and_overrides():
    specs = parse_methods(
        ['ngram,ngram:{"num_speculative_tokens":7},suffix,draft_model'], "qwen2.5-coder-1.5b-instruct"
    )
    assert [spec.label for spec in specs] == ["none", "ngram", "ngram-2", "suffix", "draft_model"]
    assert specs[1].config == {"method": "ngram", "num_speculative_tokens": 16, "prompt_lookup_max": 4,
                               "prompt_lookup_min": 2}
    assert specs[2].config["num_speculative_tokens"] == 7
    assert specs[3].config["num_speculative_tokens"] == 16
    assert specs[4].config == {"method": "draft_model", "num_speculative_tokens": 4,
                               "model": "qwen2.5-coder-0.5b-instruct"}
    labelled = parse_methods(['none,suffix:{"label":"suffix-k4","num_speculative_tokens":4}'], "m")
    assert [spec.label for spec in labelled] == ["none", "suffix-k4"]
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        parse_methods(['ngram:{"num_speculative_tokens":0}'], "m")
    with pytest.raises(ValueError, match="unknown speculative config key"):
        parse_methods(['ngram:{"k":3}'], "m")


def test_parse_methods_per_method_draft_policy():
    specs = parse_methods(['ngram:{"draft_policy":"fixed","num_speculative_tokens":3,"label":"k3"},ngram'], "m")
    assert [(spec.label, spec.draft_policy) for spec in specs] == [("none", None), ("k3", "fixed"), ("ngram", None)]
    assert "draft_policy" not in specs[1].config
    with pytest.raises(ValueError, match="unknown draft_policy 'greedy'"):
        parse_methods(['ngram:{"draft_policy":"greedy"}'], "m")
    with pytest.raises(ValueError, match="method 'none' takes no speculative config"):
        parse_methods(['none:{"draft_policy":"fixed"}'], "m")


def test_load_questions_formats_categories_and_limit(tmp_path):
    path = tmp_path / "mixed.jsonl"
    rows = [{"question_id": i, "category": "qa" if i % 2 else "rag", "turns": [f"q{i}"]} for i in range(6)]
    rows.append({"task_id": "HumanEval/7", "prompt": "def f():\n"})
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n")
    questions = load_questions(path, limit=2)
    assert [(q.category, q.question_id) for q in questions] == [
        ("rag", "0"), ("qa", "1"), ("rag", "2"), ("qa", "3"), (HUMANEVAL_CATEGORY, "HumanEval/7")]
    assert "def f():" in questions[-1].turns[0] and "Complete the following Python function" in questions[-1].turns[0]
    assert [q.question_id for q in load_questions(path, categories=["qa"])] == ["1", "3", "5"]
    # the questions `train-draft --holdout-every 3` leaves out: file indices 2, 5 (the HumanEval row is index 6)
    assert [q.question_id for q in load_questions(path, held_out_of=3)] == ["2", "5"]
    assert [q.question_id for q in load_questions(path, categories=["qa"], held_out_of=3)] == ["5"]
    path.write_text('{"id": 1}\n')
    with pytest.raises(ValueError, match="neither a Spec-Bench row"):
        load_questions(path)


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2


class ScriptedRunner(Runner):
    """Answers with fixed tokens and remembers every prompt it got."""

    family = "fake"
    strict = True

    def __init__(self, label, reference, answer):
        self.label, self.reference, self.answer, self.prompts = label, reference, answer, []

    def generate(self, prompt_token_ids, max_new_tokens):
        self.prompts.append(list(prompt_token_ids))
        return Generation(list(self.answer[:max_new_tokens]), wall_s=0.01 if self.reference else 0.02,
                          verify_steps=2, drafted_tokens=4, accepted_tokens=3, drafted_per_position=[2, 2],
                          accepted_per_position=[2, 1])

    def describe(self):
        return {"label": self.label, "reference": self.reference}


class NullProgress:
    def update(self, n):
        pass

    def set_postfix_str(self, text, refresh=True):
        pass


def test_each_runner_sees_its_own_previous_answer(tiny_tokenizer, tmp_path):
    path = tmp_path / "two_turns.jsonl"
    path.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["first?", "second?"]}) + "\n")
    questions = load_questions(path)
    plain = ScriptedRunner("none", None, tiny_tokenizer.encode("AAAA", add_special_tokens=False))
    other = ScriptedRunner("fast", "none", tiny_tokenizer.encode("AABB", add_special_tokens=False))
    records = run_round(0, questions, [plain, other], tiny_tokenizer, 8, NullProgress())
    assert plain.prompts[0] == other.prompts[0] == tiny_tokenizer.encode_chat([{"role": "user", "content": "first?"}])
    assert plain.prompts[1] == tiny_tokenizer.encode_chat([{"role": "user", "content": "first?"},
                                                            {"role": "assistant", "content": "AAAA"},
                                                            {"role": "user", "content": "second?"}])
    assert "AABB" in tiny_tokenizer.decode(other.prompts[1])
    mismatches = check_lossless(records)
    assert [(m["turn"], m["first_mismatch"]) for m in mismatches] == [(0, 2), (1, 2)]

    results = build_results({}, [plain.describe(), other.describe()], records, mismatches)
    fast = results["summary"]["fast"][OVERALL]
    assert fast["speedup"] == pytest.approx(2.0) and fast["identical_rate"] == 0.0
    assert fast["acceptance_rate"] == pytest.approx(0.75) and fast["mean_accepted_length"] == pytest.approx(2.5)
    assert fast["position_acceptance_rates"] == [1.0, 0.5]
    assert results["lossless"] is False


class TimedRunner(ScriptedRunner):
    """Scripted answer with a scripted request time and time to first token."""

    def __init__(self, label, reference, answer, wall_s, first_token_s):
        super().__init__(label, reference, answer)
        self.wall_s, self.first_token_s = wall_s, first_token_s

    def generate(self, prompt_token_ids, max_new_tokens):
        return Generation(list(self.answer[:max_new_tokens]), wall_s=self.wall_s, first_token_s=self.first_token_s)


def test_decode_phase_leaves_out_the_time_to_first_token(tiny_tokenizer, tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"question_id": 1, "category": "summarization", "turns": ["sum up"]}) + "\n")
    answer = list(range(5, 16))  # 11 tokens: 1 first + 10 decoded
    plain = TimedRunner("none", None, answer, wall_s=3.0, first_token_s=1.0)  # 10 tokens in 2 s
    fast = TimedRunner("fast", "none", answer, wall_s=1.5, first_token_s=1.0)  # 10 tokens in 0.5 s
    blind = TimedRunner("blind", "none", answer, wall_s=1.5, first_token_s=None)  # no first-token time
    records = run_round(0, load_questions(path), [plain, fast, blind], tiny_tokenizer, 16, NullProgress())
    results = build_results({}, [r.describe() for r in (plain, fast, blind)], records, check_lossless(records))
    summary = {label: results["summary"][label][OVERALL] for label in ("none", "fast", "blind")}
    assert summary["none"]["decode_tokens_per_s"] == pytest.approx(5.0)
    assert summary["fast"]["decode_tokens_per_s"] == pytest.approx(20.0)
    assert summary["fast"]["decode_speedup"] == pytest.approx(4.0)
    assert summary["fast"]["speedup"] == pytest.approx(2.0)  # whole request: 11 / 1.5 over 11 / 3
    assert summary["fast"]["ttft_s"] == pytest.approx(1.0)
    assert summary["blind"]["decode_tokens_per_s"] is None and summary["blind"]["decode_speedup"] is None
    assert summary["blind"]["ttft_s"] is None


def test_kernel_bench_compares_the_weight_layouts(capsys):
    from specdec.bench import kernel_bench

    kernel_bench.main(["--shapes", "64x48", "--ms", "1,8", "--no-baselines", "--skip-attention", "--hot",
                       "--layouts", "vnni,amx"])
    out = capsys.readouterr().out
    assert "q8-vnni" in out and "q8-amx" in out
    with pytest.raises(SystemExit):
        kernel_bench.main(["--layouts", "tiles"])


def test_the_reports_kernel_line_names_the_path_its_variant_and_a_warning():
    from specdec.bench.report import _kernels_text

    assert _kernels_text({}) == ""  # results written before the kernel path was recorded
    assert _kernels_text({"kernel_isa": "avx512", "kernel_warning": None}) == ", kernel path avx512"
    assert _kernels_text({"kernel_isa": "avx2", "kernel_avx_vnni": True}) == ", kernel path avx2 with AVX-VNNI"
    assert _kernels_text({"kernel_isa": "scalar", "kernel_warning": "slow"}) == ", kernel path scalar (**slow**)"
