"""server/tool_calls.py: parsing Qwen2.5 / Hermes tool calls, the streamed holdback, the tool-call grammar (walked
with llguidance on the tiny byte-level tokenizer)."""
import json
import re

import pytest

from specdec.server.tool_calls import (EMPTY_PARAMETERS, FunctionSpec, ToolCallParser, ToolCallStream,
                                       tags_are_tokens, tool_call_grammar)
from specdec.verify.grammar import GrammarMatcher

PARSER = ToolCallParser(frozenset({"get_weather", "get_time"}))
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "24h": true}}\n</tool_call>'


def calls_of(parsed):
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


def test_one_call_no_content():
    parsed = PARSER.parse(WEATHER, "stop")
    assert parsed.content is None
    assert calls_of(parsed) == [("get_weather", {"city": "Paris"})]
    call = parsed.tool_calls[0].to_openai()
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"]) and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_several_calls_with_text_around():
    text = f"Let me check.\n\n{WEATHER}\n{TIME}\nDone "
    parsed = PARSER.parse(text, "stop")
    assert parsed.content == "Let me check.\nDone"
    assert calls_of(parsed) == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET", "24h": True})]
    assert len({call.id for call in parsed.tool_calls}) == 2


def test_unclosed_last_call_and_missing_arguments():
    parsed = PARSER.parse('<tool_call>\n{"name": "get_time"}\n', "stop")
    assert calls_of(parsed) == [("get_time", {})]


def test_a_call_without_tags_is_one_call_when_it_is_the_whole_output():
    bare = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    parsed = PARSER.parse(f"\n{bare}\n", "stop")
    assert parsed.content is None and calls_of(parsed) == [("get_weather", {"city": "Paris"})]
    for text in (f"Call: {bare}", f"{bare} then more", '{"name": "send_mail", "arguments": {}}', '{"city": "Paris"}'):
        assert PARSER.parse(text, "stop") is None, text


@pytest.mark.parametrize("text", [
    "no call here",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',  # broken JSON
    '<tool_call>\n{"name": "send_mail", "arguments": {}}\n</tool_call>',  # not one of the tools
    '<tool_call>\n{"name": "get_time", "arguments": "zone=CET"}\n</tool_call>',  # arguments not an object
    '<tool_call>\n["get_time"]\n</tool_call>',
    WEATHER + '\n<tool_call>\n{"name": get_time}\n</tool_call>',  # one malformed call: no calls at all
])
def test_malformed_calls_stay_content(text):
    assert PARSER.parse(text, "stop") is None


def test_only_a_natural_end_is_parsed():
    assert PARSER.parse(WEATHER, "length") is None
    assert PARSER.parse(WEATHER, "abort") is None


def stream(text: str, finish_reason: str, piece_sizes=(1, 3, 7)):
    """Feeds text in uneven pieces; returns (content deltas joined, the final delta)."""
    streamer = ToolCallStream(PARSER)
    content, position, i = "", 0, 0
    while position < len(text):
        position = min(len(text), position + piece_sizes[i % len(piece_sizes)])
        i += 1
        content += streamer.content_delta(text[:position])
    final = streamer.finish(text, finish_reason)
    return content, final


@pytest.mark.parametrize("text", ["Let me check.\n\n" + WEATHER + "\n" + TIME + "\nDone ", WEATHER,
                                  "  indented <tool_ca", "plain answer  \n", "a <tool_call> b", "x" + WEATHER,
                                  ' {"name": "get_time", "arguments": {}}', '{"answer": 42}'])
@pytest.mark.parametrize("finish_reason", ["stop", "length"])
def test_streamed_content_equals_the_parsed_content(text, finish_reason):
    content, final = stream(text, finish_reason)
    parsed = PARSER.parse(text, finish_reason)
    if parsed is None:
        assert content + final.content == text and final.tool_calls is None
        assert final.finish_reason == finish_reason
    else:
        assert content + final.content == (parsed.content or "")
        assert [(c.name, c.arguments) for c in final.tool_calls] == [(c.name, c.arguments) for c in parsed.tool_calls]
        assert final.finish_reason == "tool_calls"


def test_stream_holds_back_from_the_tag_on():
    streamer = ToolCallStream(PARSER)
    assert streamer.content_delta("Sure") == "Sure"
    assert streamer.content_delta("Sure. <tool") == "."  # a partial tag and the space before it wait
    assert streamer.content_delta("Sure. <tool_call>\n{") == ""
    assert streamer.content_delta("Sure. <toolbox") == " <toolbox"  # not a tag after all
    assert ToolCallStream(PARSER).content_delta(' {"name": "get_time", ') == ""  # maybe a call without tags


SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}


def matcher(grammar, tokenizer):
    return GrammarMatcher(grammar, tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def accepts(grammar, tokenizer, text: str) -> bool:
    walker = matcher(grammar, tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not all(walker.advance(token_id) for token_id in ids):
        return False
    return bool(walker.allowed()[sorted(tokenizer.eos_token_ids)].all())


def test_grammar_forces_the_named_call_with_schema_arguments(tiny_tokenizer):
    assert not tags_are_tokens(tiny_tokenizer)  # the byte-level tokenizer spells the tags out
    grammar = tool_call_grammar([FunctionSpec("get_weather", SCHEMA)], multiple=False, tags_are_tokens=False)
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}\n</tool_call>'
    assert accepts(grammar, tiny_tokenizer, good)
    for bad in (good.replace("Rome", "Oslo"), good.replace("3", "9"), good.replace(", ", ","),
                good.replace("get_weather", "get_time"), good + "\n" + good, "Sure. " + good):
        assert not accepts(grammar, tiny_tokenizer, bad), bad
    forced = matcher(grammar, tiny_tokenizer).forced_tokens()
    assert tiny_tokenizer.decode(forced).startswith('<tool_call>\n{"name": "get_weather", "arguments": {"')


def test_grammar_for_required_allows_any_tool_and_several_calls(tiny_tokenizer):
    functions = [FunctionSpec("get_weather", SCHEMA), FunctionSpec("get_time", EMPTY_PARAMETERS)]
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n</tool_call>'
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    several = tool_call_grammar(functions, multiple=True, tags_are_tokens=False)
    one = tool_call_grammar(functions, multiple=False, tags_are_tokens=False)
    assert accepts(several, tiny_tokenizer, weather + "\n" + time_call)
    assert accepts(one, tiny_tokenizer, time_call) and not accepts(one, tiny_tokenizer, weather + "\n" + time_call)
    assert not accepts(several, tiny_tokenizer, time_call.replace("{}", '{"x": 1}'))
    assert not accepts(several, tiny_tokenizer, "")
