"""A bounded fuzz of request bodies (hypothesis, 150 examples): whatever the body, never a 5xx, always an
OpenAI-shaped body, and the server keeps answering."""
import json

import httpx
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from server_helpers import MODEL

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                         st.text(max_size=12))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bot", 3]),
                                           "content": st.one_of(st.text(max_size=20), json_values)}), max_size=3)
fields = {
    "model": st.one_of(st.just(MODEL), json_values),
    "prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 400), max_size=6), json_values),
    "messages": st.one_of(messages, json_values),
    "max_tokens": st.one_of(st.integers(-3, 8), st.integers(100, 10**12), json_values),
    "temperature": st.one_of(st.floats(-1, 3), json_values),
    "top_p": st.one_of(st.floats(-0.5, 1.5), json_values),
    "top_k": st.one_of(st.integers(-2, 400), json_values),
    "seed": st.one_of(st.integers(-2**64, 2**65), json_values),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "logprobs": st.one_of(st.integers(-1, 25), st.booleans(), json_values),
    "top_logprobs": st.one_of(st.integers(-1, 25), json_values),
    "speculative": st.one_of(st.booleans(), json_values),
    "n": st.one_of(st.integers(0, 3), json_values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "tools": st.one_of(st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["function", "custom"]),
         "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "a b", ""])},
                                           optional={"parameters": json_values})}), max_size=2), json_values),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), json_values,
                             st.fixed_dictionaries({"type": st.just("function"),
                                                    "function": st.fixed_dictionaries({"name": st.just("f")})})),
    "parallel_tool_calls": st.one_of(st.booleans(), json_values),
}
valid_fields = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 300),
    "seed": st.integers(0, 2**40), "stop": st.lists(st.text(min_size=1, max_size=2), max_size=2),
    "stream": st.booleans(), "speculative": st.booleans(), "ignore_eos": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logprobs": st.one_of(st.integers(0, 5), st.booleans()), "top_logprobs": st.integers(0, 5),
}
valid_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL), "prompt": st.text(min_size=1, max_size=30), "max_tokens": st.integers(1, 6),
     "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                 "content": st.text(max_size=20)}), min_size=1, max_size=3)},
    optional=valid_fields)
perturbed = st.tuples(valid_bodies, st.fixed_dictionaries({}, optional=fields).filter(lambda f: len(f) <= 2))
bodies = st.one_of(st.fixed_dictionaries({}, optional=fields), valid_bodies, perturbed.map(lambda p: {**p[0], **p[1]}))
raw_bodies = st.one_of(bodies.map(lambda b: json.dumps(b).encode()), st.binary(max_size=30),
                       json_values.map(lambda v: json.dumps(v).encode()))


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=raw_bodies, short=st.booleans())
def test_fuzzed_bodies_never_get_a_5xx(ngram_server, path, body, short):
    if short and body.startswith(b"{") and b"max_tokens" not in body:  # keep valid requests quick
        body = body[:-1] + (b', "max_tokens": 3}' if body != b"{}" else b'"max_tokens": 3}')
    response = httpx.post(
        ngram_server.url + path, content=body, headers={"content-type": "application/json"}, timeout=60
    )
    event(f"status {response.status_code}")
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]")
    else:
        assert response.json()["choices"]
