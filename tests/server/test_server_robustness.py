"""Bad inputs get their documented status and an OpenAI error body; the server stays up through
disconnects (slot freed), a full queue (503), a wrong API key (401) and an engine step that raises."""
import json
import threading
import time

import httpx
import pytest

from server_helpers import MAX_MODEL_LEN, MODEL, start_server, tiny_llm
from specdec.server.app import ServerConfig

GOOD = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

BAD_INPUTS = [  # (path, body (dict, or raw bytes), status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b"\xff\xfe", 400, None),
    ("/v1/completions", {**GOOD, "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "prompt": "x" * (MAX_MODEL_LEN + 10)}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": list(range(MAX_MODEL_LEN))}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [5, 10**6]}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("/v1/completions", {**GOOD, "model": "gpt-4"}, 400, "model"),
    ("/v1/completions", {**GOOD, "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {**GOOD, "top_k": -3}, 400, "top_k"),
    ("/v1/completions", {**GOOD, "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {**GOOD, "stop": [""]}, 400, "stop"),
    ("/v1/completions", {**GOOD, "stop": 5}, 400, "stop"),
    ("/v1/completions", {**GOOD, "n": 2}, 400, "n"),
    ("/v1/completions", {**GOOD, "echo": True}, 400, "echo"),
    ("/v1/completions", {**GOOD, "speculative": "no"}, 400, "speculative"),
    ("/v1/completions", {**GOOD, "seed": 2**70}, 400, "seed"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/nope", GOOD, 404, None),
]


def post(url: str, path: str, body, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers={"content-type": "application/json", **(headers or {})},
                      timeout=30)


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("path, body, status, param", BAD_INPUTS)
def test_bad_input_gets_its_status_and_server_stays_up(ngram_server, path, body, status, param):
    error = assert_openai_error(post(ngram_server.url, path, body), status)
    if param is not None:
        assert error["param"] == param
    assert post(ngram_server.url, "/v1/completions", GOOD).status_code == 200


def test_prompt_too_long_names_both_lengths(ngram_server):
    error = assert_openai_error(post(ngram_server.url, "/v1/completions", {**GOOD, "prompt": "x" * 200}), 400)
    assert str(MAX_MODEL_LEN) in error["message"] and "201" in error["message"]  # 200 bytes + BOS


@pytest.fixture
def slow_server(make_tiny_model, tiny_tokenizer):
    """One KV slot, no queue, 20 ms per engine step, and a one-shot switch that makes the next Engine.step raise
    after it has run (its outputs are lost, as in a real mid-step failure)."""
    llm = tiny_llm(make_tiny_model, tiny_tokenizer, {"method": "ngram", "num_speculative_tokens": 2}, max_num_seqs=1)
    real_step, fail = llm.engine.step, threading.Event()

    def step():
        time.sleep(0.02)
        outputs = real_step()
        if fail.is_set():
            fail.clear()
            raise RuntimeError("injected engine failure")
        return outputs

    llm.engine.step = step
    running = start_server(llm, ServerConfig(api_key="sesame", max_queue=0))
    running.fail = fail
    yield running
    running.stop()


AUTH = {"authorization": "Bearer sesame"}
LONG = {**GOOD, "max_tokens": 100, "ignore_eos": True, "stream": True}


def test_api_key(slow_server):
    assert_openai_error(post(slow_server.url, "/v1/completions", GOOD), 401)
    assert_openai_error(post(slow_server.url, "/v1/completions", GOOD, headers={"authorization": "Bearer nope"}), 401)
    assert httpx.get(slow_server.url + "/v1/models", timeout=10).status_code == 401
    assert post(slow_server.url, "/v1/completions", GOOD, headers=AUTH).status_code == 200
    assert httpx.get(slow_server.url + "/health", timeout=10).status_code == 200  # open, like /metrics


def test_disconnect_mid_stream_frees_the_slot_and_full_queue_is_503(slow_server):
    with httpx.stream("POST", slow_server.url + "/v1/completions", json=LONG, headers=AUTH, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # the request is running and holds the only slot
        status = slow_server.status()
        assert status["kv_cache_free_slots"] == 0 and status["num_requests_running"] == 1
        busy = post(slow_server.url, "/v1/completions", GOOD, headers=AUTH)
        assert_openai_error(busy, 503)
        assert busy.headers["retry-after"]
    # leaving the block closes the connection mid-stream (100 tokens take >= 2 s here)
    status = slow_server.wait_idle()
    assert status["kv_cache_free_slots"] == 1 and status["num_requests_running"] == 0
    metrics = slow_server.metrics()
    assert metrics['specdec:request_failure_total{reason="abort"}'] == 1
    assert metrics["specdec:kv_cache_free_slots"] == 1
    assert post(slow_server.url, "/v1/completions", GOOD, headers=AUTH).status_code == 200


def test_disconnect_of_non_streaming_request_aborts_it(slow_server):
    with pytest.raises(httpx.TimeoutException):  # the client gives up and closes the connection
        httpx.post(slow_server.url + "/v1/completions", json={**GOOD, "max_tokens": 100, "ignore_eos": True},
                   headers=AUTH, timeout=0.3)
    status = slow_server.wait_idle()
    assert status["kv_cache_free_slots"] == 1
    assert slow_server.metrics()['specdec:request_failure_total{reason="abort"}'] == 1


def test_engine_step_failure_fails_the_request_and_the_server_lives_on(slow_server):
    slow_server.fail.set()
    assert_openai_error(post(slow_server.url, "/v1/completions", GOOD, headers=AUTH), 500)
    with httpx.stream("POST", slow_server.url + "/v1/completions", json=LONG, headers=AUTH, timeout=30) as response:
        lines = response.iter_lines()
        assert "choices" in json.loads(next(lines).removeprefix("data: "))
        slow_server.fail.set()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert "error" in json.loads(rest[-2].removeprefix("data: "))  # told in-band, stream ends cleanly
    assert httpx.get(slow_server.url + "/health", timeout=10).status_code == 200
    assert post(slow_server.url, "/v1/completions", GOOD, headers=AUTH).status_code == 200
    assert slow_server.metrics()["specdec:engine_step_errors_total"] == 2
    assert slow_server.wait_idle()["kv_cache_free_slots"] == 1
