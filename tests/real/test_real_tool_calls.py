"""Tool calls on Qwen2.5-Coder-0.5B-Instruct over HTTP (greedy, n-gram speculation with a fixed draft length): its
own chat template tells it about a weather tool; with tool_choice "auto" it calls the tool by itself and the call
is parsed into tool_calls; with tool_choice naming the function the call is constrained and its arguments
validate; speculative output equals plain output in both."""
import json

import jsonschema
import pytest
from fastapi.testclient import TestClient

from specdec.llm import LLM
from specdec.server.app import ServerConfig, create_app
from real_models import real_model_path

pytestmark = pytest.mark.real

MODEL = "qwen2.5-coder-0.5b-instruct"
WEATHER_SCHEMA = {"type": "object",
                  "properties": {"location": {"type": "string", "description": "the city, e.g. Paris"},
                                 "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["location"]}
TOOLS = [{"type": "function", "function": {"name": "get_current_weather",
                                           "description": "Get the current weather in a given location",
                                           "parameters": WEATHER_SCHEMA}}]
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def client():
    real_model_path(MODEL)
    llm = LLM(model=MODEL, max_num_seqs=2, max_model_len=1024, draft_policy="fixed",
              speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    with TestClient(create_app(llm, ServerConfig(model_name=MODEL))) as test_client:
        yield test_client


def choice_of(client, **fields):
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 96,
            "return_token_ids": True, **fields}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def the_call(choice):
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_current_weather"
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, WEATHER_SCHEMA)
    return arguments


@pytest.mark.parametrize("tool_choice", ["auto", {"type": "function", "function": {"name": "get_current_weather"}}])
def test_weather_question_gives_a_parsed_call(client, tool_choice):
    speculative = choice_of(client, tool_choice=tool_choice)
    arguments = the_call(speculative)
    assert "paris" in arguments["location"].lower()
    plain = choice_of(client, tool_choice=tool_choice, speculative=False)
    assert plain["token_ids"] == speculative["token_ids"]
