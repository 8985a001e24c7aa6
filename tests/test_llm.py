"""LLM.generate's sampling options: a SamplingParams or the same as keyword arguments, constraints included
(tiny model)."""
import json
import re

import jsonschema
import pytest

from specdec.config import GuidedDecoding, SamplingParams
from specdec.llm import LLM, sampling_params_from

PROMPT = [5, 17, 42, 5, 17, 42]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}


@pytest.fixture(scope="module")
def llm(make_tiny_model, tiny_tokenizer):
    return LLM(loaded=(make_tiny_model("qwen2"), tiny_tokenizer), max_model_len=128, max_num_seqs=2,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3}, draft_policy="fixed")


def test_keywords_build_the_same_params():
    params = sampling_params_from(None, dict(max_tokens=9, temperature=0.5, seed=3, stop=["x", "y"],
                                             presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.2,
                                             min_p=0.1, min_tokens=2, regex="a+"))
    assert params == SamplingParams(max_tokens=9, temperature=0.5, seed=3, stop=("x", "y"), presence_penalty=0.5,
                                    frequency_penalty=0.25, repetition_penalty=1.2, min_p=0.1, min_tokens=2,
                                    guided=GuidedDecoding(regex="a+"))
    assert sampling_params_from(None, dict(grammar='start: "a"')).guided == GuidedDecoding(lark='start: "a"')
    assert sampling_params_from(None, dict(json_schema=SCHEMA)).guided == GuidedDecoding(json_schema=SCHEMA)
    assert sampling_params_from(None, dict(stop="\n", json_object=False)) == SamplingParams(stop=("\n",))
    assert sampling_params_from(None, {}) == SamplingParams()


@pytest.mark.parametrize("params,keywords,message", [
    (SamplingParams(), dict(max_tokens=3), "not both"),
    (None, dict(max_token=3), r"unknown sampling keyword arguments \['max_token'\]"),
    (None, dict(regex="a", grammar='start: "a"'), "exactly one of"),
    (None, dict(regex="a", guided=GuidedDecoding(regex="b")), "give the constraint once"),
])
def test_conflicting_or_unknown_keywords_are_refused(params, keywords, message):
    with pytest.raises(ValueError, match=message):
        sampling_params_from(params, keywords)


def test_generate_takes_keywords_like_a_sampling_params(llm):
    options = dict(max_tokens=12, presence_penalty=0.7, repetition_penalty=1.3, min_tokens=4)
    (by_keywords,) = llm.generate([PROMPT], **options)
    (by_params,) = llm.generate([PROMPT], SamplingParams(**options))
    (plain,) = llm.generate([PROMPT], max_tokens=12)
    assert by_keywords.token_ids == by_params.token_ids
    assert by_keywords.token_ids != plain.token_ids  # the penalties reached the engine
    assert by_keywords.grammar_masks == 0 and by_keywords.grammar_time_s == 0


@pytest.mark.parametrize("constraint,pattern", [(dict(regex="(ab|cd)+e"), r"((ab|cd)*(a|c)?|(ab|cd)+e)"),
                                                (dict(grammar='start: ("ab" | "cd")+ "e"'),
                                                 r"((ab|cd)*(a|c)?|(ab|cd)+e)")])
def test_generate_constrains_by_keyword(llm, constraint, pattern):
    (output,) = llm.generate([PROMPT], max_tokens=30, **constraint)
    assert re.fullmatch(pattern, output.text), output.text
    assert output.grammar_masks > 0 and 0 < output.grammar_mask_time_s <= output.grammar_time_s


def test_generate_json_schema_keyword_validates(llm):
    (output,) = llm.generate([PROMPT], max_tokens=40, json_schema=SCHEMA)
    assert output.finish_reason == "stop", output.text
    jsonschema.validate(json.loads(output.text), SCHEMA)


def test_each_output_times_its_first_token_and_its_decode_phase(llm):
    import time

    started = time.perf_counter()
    outputs = llm.generate([PROMPT, PROMPT[:4]], max_tokens=10, ignore_eos=True)
    wall_s = time.perf_counter() - started
    for output in outputs:
        assert len(output.token_ids) == 10
        assert 0 < output.first_token_s < output.elapsed_s <= wall_s
        decode_s = output.elapsed_s - output.first_token_s
        assert output.decode_tokens_per_s == pytest.approx(9 / decode_s)
        assert output.tokens_per_s == pytest.approx(10 / output.elapsed_s)


def test_an_output_without_tokens_has_no_decode_phase(llm):
    (output,) = llm.generate([PROMPT], max_tokens=1)
    assert len(output.token_ids) == 1 and output.decode_tokens_per_s == 0.0
    assert output.first_token_s == output.elapsed_s
