"""No request field is silently ignored: every field of the OpenAI request schemas (walked from the `openai`
package's typed request params) is implemented or refused with a 400 naming it; `user` and `metadata` are accepted
and ignored. Penalties and biases over HTTP, and /tokenize and /detokenize in vLLM's shape."""
import httpx
import openai.types.chat.completion_create_params as chat_params
import openai.types.completion_create_params as completion_params
import pytest

from server_helpers import MAX_MODEL_LEN, MODEL
from specdec.server.protocol import IGNORED_FIELDS, ChatCompletionRequest, CompletionRequest

CHAT_FIELDS = sorted(chat_params.CompletionCreateParamsBase.__annotations__)
COMPLETION_FIELDS = sorted(completion_params.CompletionCreateParamsBase.__annotations__)
BASE = {"/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2}}
DEPRECATED = {"functions", "function_call"}  # refused, pointing to tools / tool_choice


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def assert_refused(response, field):
    assert response.status_code == 400, (field, response.text)
    error = response.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert field in error["message"]
    assert error["code"] in ("unsupported_parameter", "unknown_parameter")


@pytest.mark.parametrize("path,fields,model_cls", [("/v1/chat/completions", CHAT_FIELDS, ChatCompletionRequest),
                                                   ("/v1/completions", COMPLETION_FIELDS, CompletionRequest)])
def test_every_openai_request_field_is_implemented_or_refused(ngram_server, path, fields, model_cls):
    assert len(fields) > 10  # the schema was read
    implemented, refused = [], []
    for field in fields:
        if field in model_cls.model_fields:
            implemented.append(field)
            continue
        assert_refused(post(ngram_server, path, {**BASE[path], field: {"x": 1}}), field)
        refused.append(field)
    assert {"presence_penalty", "frequency_penalty", "logit_bias", "seed", "stop", "user"} <= set(implemented)
    if path == "/v1/chat/completions":
        assert {"tools", "tool_choice", "parallel_tool_calls", "response_format"} <= set(implemented)
        assert DEPRECATED <= set(refused)
        for field in DEPRECATED:
            response = post(ngram_server, path, {**BASE[path], field: {"type": "json_object"}})
            assert response.json()["error"]["code"] == "unsupported_parameter"
            assert "not implemented" in response.json()["error"]["message"]
            assert "use tool" in response.json()["error"]["message"]


@pytest.mark.parametrize("path", BASE)
def test_user_and_metadata_are_accepted_and_unknown_fields_refused(ngram_server, path):
    assert set(IGNORED_FIELDS) == {"user", "metadata"}
    response = post(ngram_server, path, {**BASE[path], "user": "someone", "metadata": {"k": "v"}})
    assert response.status_code == 200, response.text
    assert_refused(post(ngram_server, path, {**BASE[path], "no_such_field": 1}), "no_such_field")


def completion_ids(server, **fields):
    body = {**BASE["/v1/completions"], "temperature": 0, "return_token_ids": True, **fields}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["finish_reason"]


@pytest.mark.parametrize("server_name", ["ngram_server", "draft_server"])
def test_logit_bias_min_tokens_and_stop_token_ids_over_http(request, server_name):
    server = request.getfixturevalue(server_name)
    ids, _ = completion_ids(server, max_tokens=6, logit_bias={"7": 100}, ignore_eos=True)
    assert ids == [7] * 6
    ids, reason = completion_ids(server, max_tokens=10, logit_bias={"7": 100}, stop_token_ids=[7], min_tokens=3)
    assert len(ids) == 4 and 7 not in ids[:3] and ids[3] == 7 and reason == "stop"
    plain, _ = completion_ids(server, prompt="abcabcabcabc", max_tokens=12, ignore_eos=True)
    penalized, _ = completion_ids(server, prompt="abcabcabcabc", max_tokens=12, ignore_eos=True,
                                  presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=2.0)
    assert penalized != plain
    assert len(set(penalized)) >= len(set(plain))


@pytest.mark.parametrize("fields,param", [({"logit_bias": {"10000000": 1}}, "logit_bias"),
                                          ({"logit_bias": {"x": 1}}, "logit_bias"),
                                          ({"logit_bias": {"3": 101}}, "logit_bias.3"),
                                          ({"stop_token_ids": [10**7]}, "stop_token_ids"),
                                          ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
                                          ({"presence_penalty": 3}, "presence_penalty"),
                                          ({"min_p": 1.5}, "min_p"),
                                          ({"repetition_penalty": 0}, "repetition_penalty")])
def test_bad_penalty_fields_are_400_naming_them(ngram_server, fields, param):
    response = post(ngram_server, "/v1/completions", {**BASE["/v1/completions"], **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_tokenize_and_detokenize(ngram_server, tiny_tokenizer):
    response = post(ngram_server, "/tokenize", {"model": MODEL, "prompt": "hello world"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body == {"tokens": tiny_tokenizer.encode("hello world"), "count": len(body["tokens"]),
                    "max_model_len": MAX_MODEL_LEN}
    without = post(ngram_server, "/tokenize", {"prompt": "hello world", "add_special_tokens": False}).json()
    assert without["tokens"] == tiny_tokenizer.encode("hello world", add_special_tokens=False)
    messages = [{"role": "user", "content": "hi there"}]
    chat = post(ngram_server, "/tokenize", {"model": MODEL, "messages": messages}).json()
    assert chat["tokens"] == tiny_tokenizer.encode_chat(messages) and chat["count"] == len(chat["tokens"])
    text = post(ngram_server, "/detokenize", {"model": MODEL, "tokens": without["tokens"]}).json()
    assert text == {"prompt": tiny_tokenizer.decode(without["tokens"])}


@pytest.mark.parametrize("path,body,param", [("/tokenize", {"model": "other", "prompt": "x"}, "model"),
                                             ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
                                             ("/tokenize", {}, "prompt"),
                                             ("/detokenize", {"tokens": [10**7]}, "tokens"),
                                             ("/detokenize", {"tokens": ["a"]}, "tokens.0")])
def test_tokenize_errors_name_the_field(ngram_server, path, body, param):
    response = post(ngram_server, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_openapi_lists_tokenize_and_detokenize(ngram_server):
    paths = httpx.get(ngram_server.url + "/openapi.json", timeout=10).json()["paths"]
    assert "post" in paths["/tokenize"] and "post" in paths["/detokenize"]
