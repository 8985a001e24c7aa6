"""response_format over HTTP: json_object and json_schema constrain the output (verify/grammar.py), under
speculation (ngram and draft_model servers) as in plain decoding; inconsistent formats are 400s naming the field."""
import json

import httpx
import jsonschema
import pytest

from server_helpers import MODEL

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}


def chat(server, **fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "give me JSON"}], "max_tokens": 40,
            "temperature": 0, **fields}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


@pytest.mark.parametrize("server_name", ["ngram_server", "draft_server"])
def test_json_schema_response_format_gives_valid_json(request, server_name):
    server = request.getfixturevalue(server_name)
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    response = chat(server, response_format=response_format)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    plain = chat(server, response_format=response_format, speculative=False).json()["choices"][0]
    assert plain["message"]["content"] == choice["message"]["content"]


def test_json_object_response_format_starts_an_object(ngram_server):
    response = chat(ngram_server, response_format={"type": "json_object"}, max_tokens=8)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"].startswith("{")
    text = chat(ngram_server, response_format={"type": "text"}, max_tokens=8)
    assert text.status_code == 200, text.text


@pytest.mark.parametrize("response_format,param", [
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_object", "json_schema": {"name": "x", "schema": {}}}, "response_format.json_schema"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
])
def test_bad_response_format_is_400_naming_the_field(ngram_server, response_format, param):
    response = chat(ngram_server, response_format=response_format)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_schema_the_grammar_engine_refuses_is_400(ngram_server):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}}
    response = chat(ngram_server, response_format=bad)
    assert response.status_code == 400, response.text
    assert "constraint" in response.json()["error"]["message"]


def test_the_server_builds_the_grammar_tokenizer_view_when_it_starts(make_tiny_model, tmp_path):
    """A fresh tokenizer (none of the other tests' cached views): its llguidance view exists once the server's
    warm-up thread ends, before any constrained request."""
    from server_helpers import start_server, tiny_llm
    from specdec.models.tokenizer import Tokenizer
    from specdec.verify.grammar import has_ll_tokenizer
    from tiny_models import write_tiny_tokenizer

    tokenizer = Tokenizer.from_hf_dir(write_tiny_tokenizer(tmp_path))
    llm = tiny_llm(make_tiny_model, tokenizer)
    vocab_size = llm.model.config.vocab_size
    assert not has_ll_tokenizer(tokenizer, vocab_size)
    server = start_server(llm)
    try:
        server.state.grammar_warm_up.join(60)
        assert not server.state.grammar_warm_up.is_alive()
        assert has_ll_tokenizer(tokenizer, vocab_size)
    finally:
        server.stop()
