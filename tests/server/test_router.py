"""The router of `specdec serve --replicas` without Ray: affinity keys, rendezvous hashing with bounded load, /metrics
merging, and what a client gets when a replica fails (replicas faked with httpx's MockTransport)."""
import asyncio
import json

import httpx

from server_helpers import metric_samples
from specdec.server.router import (REPLICA_HEADER, ReplicaAddress, ReplicaPool, ReplicaState, ReplicaUnavailable,
                                   Router, RouterConfig, affinity_key, choose_replica, create_router_app,
                                   merge_metric_texts, render_families, rendezvous_order)

CHAT = "/v1/chat/completions"


def chat_body(*contents: str) -> bytes:
    roles = ["system", "user", "assistant", "user"]
    return json.dumps({"model": "m", "messages": [{"role": roles[i], "content": c} for i, c in enumerate(contents)]}
                      ).encode()


def test_a_conversations_next_turn_has_its_key():
    first = affinity_key(CHAT, chat_body("You are terse." * 10, "What is 2+2?"), 64)
    next_turn = affinity_key(CHAT, chat_body("You are terse." * 10, "What is 2+2?", "4", "And 3+3?"), 64)
    other = affinity_key(CHAT, chat_body("You are verbose." * 10, "What is 2+2?"), 64)
    assert first == next_turn and len(first) == 64
    assert other != first


def test_completion_keys_are_the_prompts_first_characters():
    body = lambda prompt: json.dumps({"model": "m", "prompt": prompt}).encode()
    assert affinity_key("/v1/completions", body("abcdefgh"), 4) == "abcd"
    assert affinity_key("/v1/completions", body(["abcdefgh", "zzz"]), 4) == "abcd"  # a batch: its first prompt
    assert affinity_key("/v1/completions", body([1, 2, 3]), 4) == "[1,2"
    assert affinity_key("/v1/completions", body("abcdefgh"), 0) is None  # affinity off
    assert affinity_key("/v1/completions", b"not json", 4) is None
    assert affinity_key("/tokenize", body("abcdefgh"), 4) is None


def test_rendezvous_order_is_stable_and_a_leaving_replica_moves_only_its_keys():
    keys = [f"prompt {i}" for i in range(200)]
    orders = {key: rendezvous_order(key, [0, 1, 2]) for key in keys}
    assert all(rendezvous_order(key, [2, 1, 0]) == orders[key] for key in keys)
    assert {order[0] for order in orders.values()} == {0, 1, 2}
    for key in keys:  # without replica 1, every key keeps its order among the others
        assert rendezvous_order(key, [0, 2]) == [i for i in orders[key] if i != 1]


def test_a_hot_key_spills_over_at_the_load_bound():
    replicas = [ReplicaState(0), ReplicaState(1)]
    first, second = rendezvous_order("hot", [0, 1])
    chosen = []
    for _ in range(6):  # six requests of one key in flight together
        replica = choose_replica(replicas, "hot", load_factor=1.25)
        replica.in_flight += 1
        chosen.append(replica.index)
    assert chosen[:2] == [first, first] and chosen.count(first) == 4 and chosen.count(second) == 2
    idle = [ReplicaState(0), ReplicaState(1, in_flight=3)]
    assert choose_replica(idle, None, 1.25).index == 0  # no key: the least loaded


REPLICA_METRICS = """# HELP specdec:generation_tokens Generated tokens.
# TYPE specdec:generation_tokens counter
specdec:generation_tokens_total {tokens}
# HELP specdec:e2e_request_latency_seconds End-to-end request latency.
# TYPE specdec:e2e_request_latency_seconds histogram
specdec:e2e_request_latency_seconds_bucket{{le="0.5"}} {fast}
specdec:e2e_request_latency_seconds_bucket{{le="+Inf"}} {count}
specdec:e2e_request_latency_seconds_sum {seconds}
specdec:e2e_request_latency_seconds_count {count}
# HELP specdec:num_requests_running Requests in the running batch.
# TYPE specdec:num_requests_running gauge
specdec:num_requests_running {running}
"""


def test_metrics_are_summed_and_earlier_incarnations_kept():
    texts = [REPLICA_METRICS.format(tokens=10, fast=1, count=2, seconds=0.75, running=1),
             REPLICA_METRICS.format(tokens=5, fast=3, count=3, seconds=1.5, running=2)]
    retired = {"specdec:generation_tokens": {"specdec:generation_tokens_total": 100.0},
               "specdec:num_requests_running": {"specdec:num_requests_running": 7.0}}  # a gauge: not kept
    text = render_families(merge_metric_texts(texts, retired))
    merged = metric_samples(text)
    assert merged["specdec:generation_tokens_total"] == 115
    assert merged['specdec:e2e_request_latency_seconds_bucket{le="0.5"}'] == 4
    assert merged['specdec:e2e_request_latency_seconds_bucket{le="+Inf"}'] == 5
    assert merged["specdec:e2e_request_latency_seconds_sum"] == 2.25
    assert merged["specdec:num_requests_running"] == 3
    assert "specdec:generation_tokens_total 115\n" in text  # counters stay integers


class FakePool(ReplicaPool):
    """Replicas that never come back (address: unavailable) and whose restarts are only recorded."""

    def __init__(self) -> None:
        self.restarted: list[int] = []

    async def address(self, index: int) -> ReplicaAddress:
        raise ReplicaUnavailable("restarting")

    def restart(self, index: int) -> None:
        self.restarted.append(index)

    def begin_shutdown(self) -> None:
        pass


class FailingStream(httpx.AsyncByteStream):
    """An SSE body that breaks off inside its second event, as when the replica's process is killed."""

    async def __aiter__(self):
        yield b'data: {"n": 1}\n\ndata: {"n"'
        raise httpx.ReadError("connection reset by peer")


def run_router(handler, config: RouterConfig = RouterConfig(health_interval_s=0.05), **requests):
    """Runs the router app over two fake replicas (urls http://r0, http://r1) answered by `handler`; calls each
    `requests` coroutine function with (client, router) and returns their results by name."""
    addresses = [ReplicaAddress(i, f"http://r{i}", 100 + i, "node", 1, None) for i in range(2)]
    router = Router(FakePool(), addresses, config, transport=httpx.MockTransport(handler))
    app = create_router_app(router)

    async def main():
        await router.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://router") as client:
                return {name: await request(client, router) for name, request in requests.items()}
        finally:
            await router.stop()

    return asyncio.run(main()), router


def healthy(request: httpx.Request):
    return httpx.Response(200, json={"status": "ok"}) if request.url.path == "/health" else None


def test_a_stream_cut_by_a_dying_replica_ends_with_an_error_event():
    def handler(request):
        return healthy(request) or httpx.Response(200, headers={"content-type": "text/event-stream"},
                                                  stream=FailingStream())

    async def stream(client, router):
        response = await client.post(CHAT, content=chat_body("hi"), headers={"content-type": "application/json"})
        return response.status_code, response.headers[REPLICA_HEADER], response.text

    results, router = run_router(handler, stream=stream)
    status, replica, text = results["stream"]
    events = [event for event in text.split("\n\n") if event]
    assert status == 200 and events[0] == 'data: {"n": 1}'  # the complete event, never the torn one
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert error["code"] == "replica_failed" and f"replica {replica}" in error["message"]
    assert events[2:] == ["data: [DONE]"]
    assert all(r.in_flight == 0 for r in router.replicas)


def test_a_request_on_a_replica_marked_down_gets_502_at_once():
    release = asyncio.Event()

    async def handler(request):
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        await release.wait()  # the replica hangs (its node is gone): only the router can end the request
        return httpx.Response(200, json={})

    async def hanging(client, router):
        task = asyncio.ensure_future(client.post(CHAT, content=chat_body("hi"),
                                                 headers={"content-type": "application/json"}))
        while not any(r.in_flight for r in router.replicas):
            await asyncio.sleep(0.01)
        busy = next(r for r in router.replicas if r.in_flight)
        router.mark_down(busy, "test: the node is gone")
        response = await asyncio.wait_for(task, 10)
        release.set()
        return response, busy.index

    results, router = run_router(handler, RouterConfig(health_interval_s=60), hanging=hanging)
    response, index = results["hanging"]
    assert response.status_code == 502 and response.json()["error"]["code"] == "replica_failed"
    assert response.headers[REPLICA_HEADER] == str(index)
    assert router.replicas[index].state == "down"


def test_a_refused_connection_goes_to_the_other_replica():
    def handler(request):
        if request.url.host == "r0":
            raise httpx.ConnectError("connection refused")
        return healthy(request) or httpx.Response(200, json={"served_by": 1})

    async def requests(client, router):
        return [await client.post("/v1/completions", json={"model": "m", "prompt": f"p{i}"}) for i in range(4)]

    results, router = run_router(handler, RouterConfig(health_interval_s=60), requests=requests)
    assert [r.status_code for r in results["requests"]] == [200] * 4
    assert {r.headers[REPLICA_HEADER] for r in results["requests"]} == {"1"}
    assert [r.state for r in router.replicas] == ["down", "up"]


def test_a_replica_whose_engine_failed_is_restarted_and_none_left_gives_503():
    def handler(request):
        if request.url.path == "/health":
            return httpx.Response(503, json={"error": {"message": "the engine loop stopped", "code": "engine_failed"}})
        return httpx.Response(200, json={})

    async def after_checks(client, router):
        while any(r.state == "up" for r in router.replicas):
            await asyncio.sleep(0.01)
        return (await client.post("/v1/completions", json={"model": "m", "prompt": "p"}),
                await client.get("/health"))

    results, router = run_router(handler, after_checks=after_checks)
    response, health = results["after_checks"]
    assert sorted(router.pool.restarted) == [0, 1]
    assert response.status_code == 503 and response.json()["error"]["code"] == "no_replica_available"
    assert health.status_code == 503 and [r["state"] for r in health.json()["replicas"]] == ["down", "down"]
