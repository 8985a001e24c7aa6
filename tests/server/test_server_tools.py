"""Tool calls over HTTP on a tiny random-weight model whose chat template renders tools: tool_choice naming a
function or "required" constrains the output to calls whose arguments match the schema, under speculation (ngram,
fixed draft length) exactly as in plain decoding; calls come back as OpenAI tool_calls (also through the openai
SDK, streamed and not); assistant calls and tool answers are accepted back; malformed tool fields are 400s
naming the field."""
import json
import threading

import httpx
import jsonschema
import openai
import pytest

from server_helpers import MODEL, NGRAM_CONFIG, start_server
from specdec.llm import LLM
from specdec.models.tokenizer import Tokenizer
from tiny_models import write_tiny_tokenizer

# A short Qwen2.5-like template: the tools' names, past calls with their arguments as JSON, tool answers.
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<assistant>"
    "{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}\n"
    "{% elif m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>\n"
    "{% else %}<{{ m.role }}>{{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False}
TIME_SCHEMA = {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
               "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": WEATHER_SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}}]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_server(make_tiny_model, tmp_path_factory):
    tokenizer = Tokenizer.from_hf_dir(write_tiny_tokenizer(tmp_path_factory.mktemp("tools-tokenizer")))
    tokenizer.chat_template = TOOLS_TEMPLATE
    llm = LLM(loaded=(make_tiny_model("llama"), tokenizer), speculative_config=NGRAM_CONFIG, max_model_len=512,
              max_num_seqs=4, draft_policy="fixed")
    running = start_server(llm)
    yield running
    running.stop()


def chat(server, **fields):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 120, "temperature": 0, "tools": TOOLS, **fields}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def ok_choice(response):
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def assert_valid_calls(choice, count=None):
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert calls and (count is None or len(calls) == count), calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    return [(call["function"]["name"], call["function"]["arguments"]) for call in calls]


def test_named_tool_choice_gives_a_call_matching_the_schema_identical_to_plain(tools_server):
    speculative = ok_choice(chat(tools_server, tool_choice=NAMED, return_token_ids=True, return_token_kinds=True))
    calls = assert_valid_calls(speculative, count=1)
    assert calls[0][0] == "get_weather" and speculative["message"]["content"] is None
    assert "accepted" in speculative["token_kinds"]  # drafts were verified (the grammar's forced text, at least)
    plain = ok_choice(chat(tools_server, tool_choice=NAMED, return_token_ids=True, speculative=False))
    assert plain["token_ids"] == speculative["token_ids"]
    assert assert_valid_calls(plain, count=1) == calls


def test_required_tool_choice_calls_one_of_the_tools(tools_server):
    speculative = ok_choice(chat(tools_server, tool_choice="required", parallel_tool_calls=False))
    calls = assert_valid_calls(speculative, count=1)
    plain = ok_choice(chat(tools_server, tool_choice="required", parallel_tool_calls=False, speculative=False))
    assert assert_valid_calls(plain) == calls


def test_required_with_parallel_calls_allows_more_calls(tools_server):
    """The random model goes on calling until max_tokens (the output is then content: truncated); with the
    end-of-sequence token favoured it ends after the first call."""
    truncated = ok_choice(chat(tools_server, tool_choice="required"))
    assert truncated["finish_reason"] == "length" and truncated["message"]["content"].count("<tool_call>") >= 2
    plain = ok_choice(chat(tools_server, tool_choice="required", speculative=False))
    assert plain["message"] == truncated["message"]
    ended = ok_choice(chat(tools_server, tool_choice="required", logit_bias={"257": 100}))
    assert_valid_calls(ended, count=1)


def test_concurrent_tool_requests_equal_sequential_ones(tools_server):
    requests = [{"tool_choice": NAMED}, {"tool_choice": "required"},
                {"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, {"tool_choice": "auto"}]
    sequential = [ok_choice(chat(tools_server, return_token_ids=True, **fields))["token_ids"] for fields in requests]
    concurrent = [None] * len(requests)

    def run(i):
        concurrent[i] = ok_choice(chat(tools_server, return_token_ids=True, **requests[i]))["token_ids"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert concurrent == sequential


def test_auto_without_a_call_is_plain_content(tools_server):
    choice = ok_choice(chat(tools_server, max_tokens=12))
    assert choice["finish_reason"] in ("stop", "length") and "tool_calls" not in choice["message"]
    assert isinstance(choice["message"]["content"], str)


def test_tool_choice_none_renders_no_tools(tools_server):
    def prompt_tokens(**fields):
        response = chat(tools_server, max_tokens=1, **fields)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    without_tools = prompt_tokens(tools=None)
    assert prompt_tokens(tool_choice="none") == without_tools < prompt_tokens(tool_choice="auto")


def test_openai_sdk_reads_calls_streamed_and_not(tools_server):
    client = openai.OpenAI(base_url=tools_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    fields = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=120)
    completion = client.chat.completions.create(**fields)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "tool_calls" and message.content is None
    call = message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
    chunks = list(client.chat.completions.create(**fields, stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(delta.content or "" for delta in deltas) == ""
    streamed = [c for delta in deltas for c in delta.tool_calls or ()]
    assert [(c.index, c.function.name, c.function.arguments) for c in streamed] == [
        (0, "get_weather", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


ROUND_TRIP = [
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]


def test_calls_and_tool_answers_are_accepted_back(tools_server, tiny_tokenizer):
    choice = ok_choice(chat(tools_server, messages=ROUND_TRIP, max_tokens=4))
    assert choice["finish_reason"] in ("stop", "length")
    tokens = httpx.post(tools_server.url + "/tokenize", json={"model": MODEL, "messages": ROUND_TRIP, "tools": TOOLS},
                        timeout=60).json()["tokens"]
    text = tiny_tokenizer.decode(tokens)
    assert text.startswith("<tools>get_weather;get_time;</tools>\n")
    # the arguments reach the template as a dict, as transformers passes them (not as a JSON string)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}</tool_call>' in text
    assert "<tool_response>18 C</tool_response>\n<assistant>" in text


@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "send_mail"}}}, "tool_choice.function.name"),
    ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "custom", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [ROUND_TRIP[0], ROUND_TRIP[2]], "tool_choice": "none"}, None),  # a valid tool message
    ({"messages": [ROUND_TRIP[0], {"role": "tool", "content": "18 C"}]}, "messages.1.tool_call_id"),
    ({"messages": [{**ROUND_TRIP[0], "tool_call_id": "call_1"}]}, "messages.0.tool_call_id"),
    ({"messages": [{**ROUND_TRIP[0], "tool_calls": ROUND_TRIP[1]["tool_calls"]}]}, "messages.0.tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{**ROUND_TRIP[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": "{city: Paris}"}}]}]}, "messages.0.tool_calls.0.function.arguments"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
])
def test_bad_tool_fields_are_400_naming_them(tools_server, fields, param):
    response = chat(tools_server, max_tokens=2, **fields)
    if param is None:
        assert response.status_code == 200, response.text
        return
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    if param in ("functions", "function_call"):
        assert error["code"] == "unsupported_parameter" and "use tool" in error["message"]


def test_a_schema_the_grammar_engine_cannot_enforce_is_400_only_when_constrained(tools_server):
    odd = {"type": "object", "properties": {"when": {"type": "string", "format": "no-such-format"}}}
    tools = [TOOLS[0], {"type": "function", "function": {"name": "odd", "parameters": odd}}]
    for choice in ("required", {"type": "function", "function": {"name": "odd"}}):
        response = chat(tools_server, max_tokens=2, tools=tools, tool_choice=choice)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "tools.1.function.parameters"
    assert chat(tools_server, max_tokens=2, tools=tools, tool_choice=NAMED).status_code == 200
    assert chat(tools_server, max_tokens=2, tools=tools, tool_choice="auto").status_code == 200


def test_a_template_that_ignores_tools_is_400(ngram_server):
    response = chat(ngram_server, max_tokens=2)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "tools_not_supported"
    assert chat(ngram_server, max_tokens=2, tool_choice="none").status_code == 200


def test_openapi_documents_the_tool_fields(tools_server):
    document = httpx.get(tools_server.url + "/openapi.json", timeout=10).json()
    properties = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    for field in ("tools", "tool_choice", "parallel_tool_calls"):
        assert properties[field]["description"], field
    assert "<tool_call>" in document["paths"]["/v1/chat/completions"]["post"]["summary"]
    assert "Tool" in document["components"]["schemas"] and "functions" not in properties
