"""The official `openai` client against the server: completions, chat, streaming, logprobs, usage, stop."""
import math

import openai
import pytest

from server_helpers import MODEL


@pytest.fixture(scope="module")
def client(ngram_server):
    return openai.OpenAI(base_url=ngram_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_model(client):
    assert [model.id for model in client.models.list().data] == [MODEL]


def test_completion_greedy_is_deterministic_with_usage(client, tiny_tokenizer):
    first = client.completions.create(model=MODEL, prompt="hello hello hello", max_tokens=20, temperature=0)
    second = client.completions.create(model=MODEL, prompt="hello hello hello", max_tokens=20, temperature=0)
    assert first.choices[0].text == second.choices[0].text
    assert first.choices[0].finish_reason in ("stop", "length")
    assert first.usage.prompt_tokens == len(tiny_tokenizer.encode("hello hello hello"))
    assert 1 <= first.usage.completion_tokens <= 20
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens


def test_completion_streaming_equals_non_streaming(client):
    kwargs = dict(model=MODEL, prompt="abcabcabc", max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 30 == whole.usage.completion_tokens


def test_chat_and_chat_streaming(client, tiny_tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    expected_prompt = tiny_tokenizer.encode(tiny_tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert whole.usage.prompt_tokens == len(expected_prompt)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_completion_logprobs(client):
    result = client.completions.create(model=MODEL, prompt="xyz", max_tokens=8, temperature=0, logprobs=3,
                                       extra_body={"ignore_eos": True})
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    for value, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert value <= 0 and len(top) <= 3  # distinct token strings may collide in the dict
        assert math.isclose(value, max(top.values()), abs_tol=1e-5)  # greedy: the chosen token is the most likely
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_chat_logprobs_streaming_and_not(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=6, temperature=0,
                  logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert len(content) == 6
    assert all(len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
               for entry in content)
    streamed = [entry for chunk in client.chat.completions.create(stream=True, **kwargs)
                if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


def test_stop_string_and_seeded_sampling(client):
    base = client.completions.create(model=MODEL, prompt="hello", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[5:7]
    stopped = client.completions.create(model=MODEL, prompt="hello", max_tokens=24, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text
    assert base.startswith(stopped.choices[0].text)
    sampled = [client.completions.create(model=MODEL, prompt="hello", max_tokens=12, temperature=0.9, top_p=0.9,
                                         seed=7, extra_body={"top_k": 50}).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_errors_come_back_as_openai_exceptions(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=4)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=10**6)
