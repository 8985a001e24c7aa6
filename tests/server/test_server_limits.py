"""Request limits: the body (413 while reading, a 50 MB body never read whole), Content-Type (415), prompt length
and stop strings (400), the capacity check before the body is read (503), prompts tokenized in a prompt thread,
and a burst of 1000 requests against a small queue (each served or refused with 503, none lost, memory flat)."""
import asyncio
import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from server_helpers import MODEL, start_server, tiny_llm
from specdec.server.app import ServerConfig
from specdec.server.protocol import RequestLimits

GOOD = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
FIFTY_MB = 50 * 2**20


def raw_post(url: str, headers: dict[str, str], body_bytes: int, chunked: bool,
             path: str = "/v1/completions") -> tuple[int, int]:
    """POSTs a body of `body_bytes` over a plain socket while reading the answer, and stops sending once the
    answer has come or the server closed the connection. Returns (HTTP status, body bytes sent)."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {body_bytes}"
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: test\r\n{head}{framing}\r\n\r\n".encode())
    answered = threading.Event()
    sent = 0

    def send_body() -> None:
        nonlocal sent
        piece = b"{" + b" " * (2**16 - 1)
        try:
            while sent < body_bytes and not answered.is_set():
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                sent += len(piece)
        except OSError:  # the server answered and closed the connection
            pass

    sender = threading.Thread(target=send_body)
    sender.start()
    received = b""
    while b"\r\n" not in received:
        data = sock.recv(4096)
        if not data:
            break
        received += data
    answered.set()
    sender.join(30)
    sock.close()
    return int(received.split(b" ", 2)[1]), sent


def assert_error(response: httpx.Response, status: int, code: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    return error


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_50_mb_body_is_refused_while_it_is_read(ngram_server, chunked):
    status, sent = raw_post(ngram_server.url, {"Content-Type": "application/json"}, FIFTY_MB, chunked)
    assert status == 413
    limit = RequestLimits().max_body_bytes
    if chunked:  # read up to the limit (plus what the sockets buffer), never the whole body
        assert limit < sent < FIFTY_MB // 2
    else:  # refused from Content-Length alone
        assert sent < FIFTY_MB // 2
    assert httpx.post(ngram_server.url + "/v1/completions", json=GOOD, timeout=30).status_code == 200


def test_body_at_the_limit_is_read_and_over_it_is_413(make_tiny_model, tiny_tokenizer):
    server = start_server(
        tiny_llm(make_tiny_model, tiny_tokenizer), ServerConfig(limits=RequestLimits(max_body_bytes=200))
    )
    try:
        at_limit = json.dumps({**GOOD, "user": ""}).encode()
        at_limit = at_limit[:-1] + b" " * (200 - len(at_limit)) + b"}"
        post = lambda content: httpx.post(server.url + "/v1/completions", content=content,  # noqa: E731
                                          headers={"content-type": "application/json"}, timeout=30)
        assert post(at_limit).status_code == 200
        error = assert_error(post(at_limit + b" "), 413, "request_too_large")
        assert "200 bytes" in error["message"]
    finally:
        server.stop()


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonp"])
def test_posts_need_a_json_content_type(ngram_server, content_type):
    headers = {} if content_type is None else {"content-type": content_type}
    response = httpx.post(ngram_server.url + "/v1/completions", content=json.dumps(GOOD), headers=headers, timeout=30)
    assert_error(response, 415, "unsupported_media_type")


def test_json_content_type_with_parameters_is_accepted(ngram_server):
    for content_type in ("application/json; charset=utf-8", "Application/JSON"):
        response = httpx.post(ngram_server.url + "/v1/chat/completions", headers={"content-type": content_type},
                              content=json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 2}), timeout=30)
        assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def limited_server(make_tiny_model, tiny_tokenizer):
    limits = RequestLimits(max_prompt_chars=64, max_stop_strings=2, max_stop_chars=8)
    running = start_server(tiny_llm(make_tiny_model, tiny_tokenizer), ServerConfig(limits=limits))
    yield running
    running.stop()


LIMITED = [  # (path, body changes, status, code, param)
    ("/v1/completions", {"prompt": "x" * 65}, 400, "prompt_too_long", "prompt"),
    ("/v1/completions", {"prompt": ["x" * 65]}, 400, "prompt_too_long", "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 40},
                                           {"role": "assistant", "content": "y" * 25}]},
     400, "prompt_too_long", "messages"),
    ("/v1/completions", {"stop": ["a", "b", "c"]}, 400, None, "stop"),
    ("/v1/completions", {"stop": "x" * 9}, 400, "stop_too_long", "stop"),
    ("/v1/chat/completions", {"stop": ["ok", "y" * 9]}, 400, "stop_too_long", "stop"),
    ("/v1/completions", {"prompt": "x" * 64, "stop": ["a", "x" * 8]}, 200, None, None),  # at the limits
]


@pytest.mark.parametrize("path, change, status, code, param", LIMITED)
def test_prompt_and_stop_limits(limited_server, path, change, status, code, param):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    body = {**({k: v for k, v in GOOD.items() if k != "prompt"} | chat if "chat" in path else GOOD), **change}
    response = httpx.post(limited_server.url + path, json=body, timeout=30)
    if status == 200:
        assert response.status_code == 200, response.text
    else:
        assert assert_error(response, status, code)["param"] == param


def test_token_id_prompts_are_bounded_by_the_context_not_the_character_limit(limited_server):
    response = httpx.post(limited_server.url + "/v1/completions", json={**GOOD, "prompt": [5] * 100}, timeout=30)
    assert response.status_code == 200, response.text


@pytest.fixture
def busy_server(make_tiny_model, tiny_tokenizer):
    """One slot, no queue, 20 ms per step: a long request fills the server."""
    llm = tiny_llm(make_tiny_model, tiny_tokenizer, max_num_seqs=1)
    real_step = llm.engine.step
    llm.engine.step = lambda: (time.sleep(0.02), real_step())[1]
    running = start_server(llm, ServerConfig(max_queue=0))
    yield running
    running.stop()


def test_capacity_is_checked_before_the_body_is_read(busy_server):
    long = {**GOOD, "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", busy_server.url + "/v1/completions", json=long, timeout=30) as response:
        lines = response.iter_lines()  # kept: a dropped iterator would close the stream, and the request with it
        next(lines)  # it runs and holds the only slot
        refused = httpx.post(busy_server.url + "/v1/completions", content=b"{not json",
                             headers={"content-type": "application/json"}, timeout=30)
        assert_error(refused, 503, "queue_full")  # not a 400: the body was never parsed
        assert refused.headers["retry-after"] == "1"
        status, sent = raw_post(busy_server.url, {"Content-Type": "application/json"}, FIFTY_MB, chunked=True)
        assert status == 503 and sent < FIFTY_MB // 2
    assert busy_server.wait_idle()["kv_cache_free_slots"] == 1
    assert httpx.post(busy_server.url + "/v1/completions", json=GOOD, timeout=30).status_code == 200


def test_prompts_are_rendered_and_tokenized_in_a_prompt_thread(make_tiny_model, tiny_tokenizer):
    server = start_server(tiny_llm(make_tiny_model, tiny_tokenizer))
    state = server.state
    threads: list[str] = []
    for name in ("prepare_completion", "prepare_chat"):
        real = getattr(state, name)

        def recording(body, real=real):
            threads.append(threading.current_thread().name)
            return real(body)

        setattr(state, name, recording)
    try:
        assert httpx.post(server.url + "/v1/completions", json=GOOD, timeout=30).status_code == 200
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=30).status_code == 200
    finally:
        server.stop()
    assert len(threads) == 2 and all(name.startswith("specdec-prompt") for name in threads)


@pytest.mark.parametrize("text", ["hello world", "", "  leading spaces", "<s> a start token", "ünïcödé 日本語 🙂",
                                  "abc " * 500])
def test_encode_through_the_batch_call_equals_the_backends_encode(tiny_tokenizer, text):
    """Tokenizer.encode tokenizes through the backend's batch call (which releases the GIL): the same ids as the
    backend's plain encode, BOS added once."""
    ids = tiny_tokenizer.backend.encode(text, add_special_tokens=False).ids
    assert tiny_tokenizer.encode(text, add_special_tokens=False) == ids
    assert tiny_tokenizer.encode(text) == [tiny_tokenizer.bos_token_id, *ids]
    bos = tiny_tokenizer.id_to_token(tiny_tokenizer.bos_token_id)
    assert tiny_tokenizer.encode(bos + text) == [tiny_tokenizer.bos_token_id, *ids]  # no second BOS


async def burst(url: str, num_requests: int, max_connections: int) -> list[tuple[int, str | None]]:
    """num_requests requests at once (streamed and not), each answer as (status, error code or "ok")."""
    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str | None]:
        body = {**GOOD, "stream": i % 3 == 0}
        response = await client.post(url + "/v1/completions", json=body)
        if response.status_code != 200:
            assert response.headers.get("retry-after") == "1"
            return response.status_code, response.json()["error"]["code"]
        if body["stream"]:
            assert response.text.rstrip().endswith("data: [DONE]") and '"error"' not in response.text
        else:
            assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
        return 200, "ok"

    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return await asyncio.gather(*(one(client, i) for i in range(num_requests)))


def test_a_burst_of_1000_requests_against_a_small_queue(make_tiny_model, tiny_tokenizer):
    server = start_server(tiny_llm(make_tiny_model, tiny_tokenizer, max_num_seqs=2), ServerConfig(max_queue=2))
    try:
        rss_mb = []
        for _ in range(2):
            answers = asyncio.run(burst(server.url, 1000, max_connections=200))
            assert len(answers) == 1000
            assert set(answers) <= {(200, "ok"), (503, "queue_full")}, set(answers)
            assert answers.count((200, "ok")) >= 4  # the slots and the queue were used
            status = server.wait_idle()
            assert (status["num_requests_running"], status["num_requests_waiting"]) == (0, 0)
            assert status["kv_cache_free_slots"] == 2
            rss_mb.append(server.metrics()["process_resident_memory_bytes"] / 2**20)
        metrics = server.metrics()
        served = sum(value for key, value in metrics.items() if key.startswith("specdec:request_success_total"))
        assert served == metrics["specdec:e2e_request_latency_seconds_count"]
        assert rss_mb[1] - rss_mb[0] < 64, rss_mb  # flat: the second burst adds nothing that stays
        assert httpx.post(server.url + "/v1/completions", json=GOOD, timeout=30).status_code == 200
    finally:
        server.stop()
