"""8 concurrent greedy streams through continuous batching (4 KV slots, so half of them wait): each stream's
tokens and text equal the same request served alone without speculation, for the ngram and the draft-model
drafter and with per-request `"speculative": false`; streamed pieces add up exactly (none lost/duplicated)."""
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server_helpers import MODEL

PROMPTS = ["abcabcabcabc", "hello world, hello world", "the cat sat on the mat. the cat", "1 2 3 1 2 3 1 2",
           "zzzz", "lorem ipsum dolor sit amet lorem ipsum", "é à ü ö € 日本", "xyxyxyxyxyxy"]
MAX_TOKENS = 40


def request_body(prompt: str, stream: bool, speculative: bool = True) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream,
            "speculative": speculative, "return_token_ids": True, "ignore_eos": True}


def served_alone(url: str, prompt: str) -> tuple[list[int], str]:
    response = httpx.post(url + "/v1/completions", json=request_body(prompt, False, speculative=False), timeout=60)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["text"]


def stream(url: str, body: dict) -> tuple[list[int], str, str]:
    token_ids, text, finish = [], "", None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        response.raise_for_status()
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        choice = json.loads(line.removeprefix("data: "))["choices"][0]
        token_ids += choice["token_ids"]
        text += choice["text"]
        finish = choice["finish_reason"] or finish
    return token_ids, text, finish


@pytest.fixture(scope="module")
def references(ngram_server):
    return [served_alone(ngram_server.url, prompt) for prompt in PROMPTS]


@pytest.mark.parametrize("server_name, speculative", [("ngram_server", True), ("ngram_server", False),
                                                      ("draft_server", True)])
def test_concurrent_streams_identical_to_served_alone(request, references, tiny_tokenizer, server_name, speculative):
    server = request.getfixturevalue(server_name)
    before = server.metrics()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: stream(server.url, request_body(p, True, speculative)), PROMPTS))
    for (ref_ids, ref_text), (ids, text, finish) in zip(references, results):
        assert len(ref_ids) == MAX_TOKENS and finish == "length"
        assert ids == ref_ids
        assert text == ref_text == tiny_tokenizer.decode(ids)  # UTF-8 never split across chunks
    after = server.metrics()
    drafts = "specdec:spec_decode_num_drafts_total"
    if speculative:
        assert after[drafts] > before[drafts]
    else:
        assert after[drafts] == before[drafts]
    assert after["specdec:request_success_total{finished_reason=\"length\"}"] >= len(PROMPTS)
    server.wait_idle()
