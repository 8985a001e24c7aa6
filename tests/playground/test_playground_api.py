"""What the playground relies on from the server, over plain HTTP: the page and its files, /v1/specdec/info,
and per-token provenance in streamed and non-streamed responses (only when asked for)."""
from __future__ import annotations

import json

import httpx
import pytest

from specdec.server.responses import draft_positions
from specdec.engine.sequence import TokenKind

MODEL = "tiny-llama"
SPEC_KINDS = {"accepted", "recovered", "bonus"}


def stream_choices(url: str, path: str, body: dict) -> list[dict]:
    choices = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices.extend(json.loads(line[len("data: "):])["choices"])
    return choices


def check_step(kinds: list[str], positions: list[int | None]) -> None:
    """One chunk = one engine step: target alone, or accepted 1..a then one recovered/bonus at a + 1."""
    if kinds == ["target"]:
        assert positions == [None]
        return
    assert positions == list(range(1, len(kinds) + 1))
    assert all(kind == "accepted" for kind in kinds[:-1])
    assert kinds[-1] in SPEC_KINDS  # a stop can end the step on an accepted token


def test_page_and_static_files_are_served(playground_server):
    page = httpx.get(playground_server.url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/static/app.js"></script>' in page.text
    for name, media_type in (("app.js", "javascript"), ("style.css", "text/css")):
        response = httpx.get(f"{playground_server.url}/static/{name}", timeout=10)
        assert response.status_code == 200 and media_type in response.headers["content-type"]
    missing = httpx.get(playground_server.url + "/static/nope.js", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_spec_info(playground_server):
    info = httpx.get(playground_server.url + "/v1/specdec/info", timeout=10).json()
    kernel_keys = ("kernel_", "supported_kernel_", "bit_exact")
    kernels = {key: info.pop(key) for key in list(info) if key.startswith(kernel_keys)}
    assert info == {"model": MODEL, "max_model_len": 128, "speculative": True, "method": "ngram",
                    "num_speculative_tokens": 4, "per_request_k": False}
    # tests/server/test_server_kernel_info.py checks their values
    assert set(kernels) == {"kernel_isa", "supported_kernel_isas", "kernel_weights", "kernel_threads", "kernel_build",
                            "kernel_warning", "bit_exact", "kernel_avx_vnni"}


@pytest.mark.parametrize(
    "path, prompt",
    [
        ("/v1/completions", {"prompt": "abcabcabc"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abcabc"}]}),
    ],
)
def test_streamed_chunks_carry_token_kinds(playground_server, path, prompt):
    body = {"model": MODEL, **prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "return_token_kinds": True}
    choices = [c for c in stream_choices(playground_server.url, path, body) if "token_kinds" in c]
    kinds = [kind for c in choices for kind in c["token_kinds"]]
    assert sum(len(c["token_ids"]) for c in choices) == len(kinds) == 40
    for choice in choices:
        assert len(choice["token_ids"]) == len(choice["token_kinds"]) == len(choice["draft_positions"]) \
            == len(choice["token_texts"])
        if choice["token_ids"]:
            check_step(choice["token_kinds"], choice["draft_positions"])
    assert kinds[0] == "target"  # the prefill step's token
    assert "accepted" in kinds  # tiny random models repeat themselves: the n-gram drafts get accepted

    plain = [c for c in stream_choices(playground_server.url, path, {**body, "speculative": False})
             if "token_kinds" in c]
    assert {kind for c in plain for kind in c["token_kinds"]} == {"target"}
    assert [t for c in plain for t in c["token_ids"]] == [t for c in choices for t in c["token_ids"]]  # lossless


def test_provenance_only_when_asked(playground_server):
    body = {"model": MODEL, "prompt": "abcabc", "max_tokens": 8, "temperature": 0}
    for choice in stream_choices(playground_server.url, "/v1/completions", {**body, "return_token_ids": True}):
        assert not {"token_kinds", "draft_positions", "token_texts"} & choice.keys()
    response = httpx.post(playground_server.url + "/v1/completions", json=body, timeout=60).json()
    assert not {"token_ids", "token_kinds", "draft_positions", "token_texts"} & response["choices"][0].keys()


def test_non_streamed_response_carries_token_kinds(playground_server):
    body = {"model": MODEL, "prompt": "abcabcabc", "max_tokens": 30, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "return_token_kinds": True}
    choice = httpx.post(playground_server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert len(choice["token_ids"]) == len(choice["token_kinds"]) == len(choice["draft_positions"]) == 30
    assert choice["token_texts"] == [playground_server.state.tokenizer.decode([t]) for t in choice["token_ids"]]
    streamed = [c for c in stream_choices(playground_server.url, "/v1/completions", body) if "token_kinds" in c]
    assert choice["token_kinds"] == [k for c in streamed for k in c["token_kinds"]]
    assert choice["draft_positions"] == [p for c in streamed for p in c["draft_positions"]]


def test_draft_positions():
    accepted, recovered, bonus, target = TokenKind.ACCEPTED, TokenKind.RECOVERED, TokenKind.BONUS, TokenKind.TARGET
    assert draft_positions([target]) == [None]
    assert draft_positions([recovered]) == [1]
    assert draft_positions([accepted, accepted, recovered]) == [1, 2, 3]
    assert draft_positions([accepted] * 4 + [bonus]) == [1, 2, 3, 4, 5]
