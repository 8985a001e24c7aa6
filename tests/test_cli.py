"""`specdec generate` end to end on a tiny checkpoint directory: the options reach the engine."""
import re

import pytest
import torch

import specdec.engine.engine as engine_module
from specdec.cache.kv_cache import KVCache
from specdec.cli import main


@pytest.fixture
def cache_dtypes(monkeypatch):
    """The dtypes of the KV caches the engine builds during a command."""
    seen = []

    class RecordingCache(KVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(self.dtype)

    monkeypatch.setattr(engine_module, "KVCache", RecordingCache)
    return seen


@pytest.mark.parametrize("option,expected", [([], torch.float16), (["--kv-cache-dtype", "float32"], torch.float32),
                                             (["--weight-format", "fp32"], torch.float32)])
def test_generate_builds_the_kv_cache_the_options_ask_for(tiny_model_dir, cache_dtypes, capsys, option, expected):
    argv = ["generate", "--model", str(tiny_model_dir), "--max-tokens", "6", "--threads", "2", *option,
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', "--compare-plain",
            "--draft-policy", "fixed", "abcabcabc"]  # fixed: no cost profile of the tiny model measured and cached
    assert main(argv) == 0
    assert cache_dtypes == [expected]
    err = capsys.readouterr().err
    assert re.search(r"\[plain: 6 tokens, [\d.]+ tok/s; first token after [\d.]+ s, then [\d.]+ tok/s\]", err), err
    assert re.search(r"\[speed-up over plain decoding: [\d.]+x in the decode phase \([\d.]+ -> [\d.]+ tok/s after "
                     r"the first token\), [\d.]+x end to end with the \d+-token prompt's prefill \([\d.]+ -> [\d.]+ "
                     r"tok/s\); output identical to plain: yes\]", err), err


def test_generate_names_the_draft_models_own_weight_format(tiny_model_dir, capsys):
    config = f'{{"method": "draft_model", "model": "{tiny_model_dir}", "num_speculative_tokens": 3}}'
    argv = ["generate", "--model", str(tiny_model_dir), "--max-tokens", "6", "--threads", "2", "--weight-format", "q8",
            "--speculative-config", config, "--draft-policy", "fixed", "abcabcabc"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "[kernels: " in err and "(q8 " in err  # the target as asked
    assert f"[draft model: {tiny_model_dir} (q4-all: q4 " in err  # the draft model in its default format


def test_generate_rejects_an_unknown_kv_cache_dtype(tiny_model_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(tiny_model_dir), "--kv-cache-dtype", "bf16", "hi"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'bf16'" in capsys.readouterr().err


def test_generate_constrains_to_a_json_schema_file_with_penalties(tiny_model_dir, tmp_path, capsys):
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(schema))
    argv = ["generate", "--model", str(tiny_model_dir), "--max-tokens", "40", "--threads", "2", "--json-schema",
            str(schema_file), "--presence-penalty", "0.5", "--frequency-penalty", "0.2", "--repetition-penalty", "1.1",
            "--min-p", "0.05", "--min-tokens", "2", "--temperature", "0.8", "--seed", "1", "give me JSON"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "finish: stop" in captured.err
    jsonschema.validate(json.loads(captured.out), schema)


def test_generate_options_reach_the_sampling_params(tmp_path):
    from specdec.cli import build_parser, generate_params
    from specdec.config import GuidedDecoding, SamplingParams

    grammar_file = tmp_path / "g.lark"
    grammar_file.write_text('start: "yes" | "no"')
    args = build_parser().parse_args(["generate", "--grammar", str(grammar_file), "--presence-penalty", "0.5",
                                      "--frequency-penalty", "0.2", "--repetition-penalty", "1.1", "--min-p", "0.05",
                                      "--min-tokens", "2", "--max-tokens", "7", "--stop", "x", "hi"])
    assert generate_params(args) == SamplingParams(max_tokens=7, stop=("x",), presence_penalty=0.5,
                                                   frequency_penalty=0.2, repetition_penalty=1.1, min_p=0.05,
                                                   min_tokens=2, guided=GuidedDecoding(lark='start: "yes" | "no"'))
    args = build_parser().parse_args(["generate", "--regex", "[0-9]+", "hi"])
    assert generate_params(args).guided == GuidedDecoding(regex="[0-9]+")


def test_generate_takes_one_constraint_and_an_existing_file(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--regex", "a+", "--grammar", "g.lark", "hi"])
    assert exit_info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_model_dir), "--json-schema", str(tmp_path / "missing.json"),
                 "hi"]) == 2
    assert "missing.json" in capsys.readouterr().err
