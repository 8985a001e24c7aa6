"""`specdec serve --replicas 2` on a local Ray, 2 replicas of 1 thread each on a tiny random-weight model: greedy
outputs are one engine's, both replicas serve, a shared prompt prefix stays on one replica (and hits its prefix
cache), /metrics sums the replicas, and a killed replica's requests get errors, not hangs, while Ray restarts it.
Ray starts once for the module; the kill test runs last."""
import json
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn

from server_helpers import NGRAM_CONFIG
from specdec.config import SamplingParams
from specdec.llm import LLM
from specdec.server.app import ServerConfig
from specdec.server.replicas import ReplicaDeployment, ReplicaOptions, core_shares
from specdec.server.router import REPLICA_HEADER, RouterServer, rendezvous_order

AFFINITY_CHARS = 24
MAX_TOKENS = 24
MODEL = "tiny"
PROMPTS = ["The quick brown fox jumps over", "def add(a, b):\n    return", "Once upon a time, in a land",
           "1, 2, 3, 4, 5, 6, 7, 8,", "Speculative decoding drafts tokens", "SELECT name FROM users WHERE",
           "Roses are red, violets are", "import numpy as np\nx = np."]


@pytest.fixture(scope="module")
def llm_options(tiny_model_dir):
    return dict(model=str(tiny_model_dir), speculative_config=NGRAM_CONFIG, max_model_len=256, max_num_seqs=4,
                draft_policy="fixed", prefix_cache_tokens=4096)


@pytest.fixture(scope="module")
def reference(llm_options):
    """One engine in this process, built as each replica builds its own."""
    return LLM(**llm_options)


@pytest.fixture(scope="module")
def router_url(llm_options):
    deployment = ReplicaDeployment(ReplicaOptions(replicas=2, threads=1, affinity_prefix_chars=AFFINITY_CHARS),
                                   llm_options, ServerConfig(model_name=MODEL))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = RouterServer(uvicorn.Config(deployment.app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the router did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        deployment.close()


def complete(url: str, prompt: str, speculative: bool = True, stream: bool = False, timeout: float = 60) -> dict:
    """The completion's token ids and text, with the replica that served it."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "speculative": speculative, "stream": stream}
    if not stream:
        response = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        usage = response.json()["usage"]
        return {"token_ids": choice["token_ids"], "replica": response.headers[REPLICA_HEADER],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}
    token_ids = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                token_ids += json.loads(line[len("data: "):])["choices"][0].get("token_ids", [])
        return {"token_ids": token_ids, "replica": response.headers[REPLICA_HEADER]}


def reference_ids(reference: LLM, prompt: str, speculative: bool = True) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return list(reference.generate(prompt, params, speculative=speculative)[0].token_ids)


def replicas(url: str) -> list[dict]:
    return httpx.get(url + "/health", timeout=10).json()["replicas"]


def routed_to(index: int, prompts: list[str]) -> list[str]:
    """The prompts whose affinity key ranks replica `index` first."""
    return [p for p in prompts if rendezvous_order(p[:AFFINITY_CHARS], [0, 1])[0] == index]


def test_greedy_outputs_are_one_engines_and_both_replicas_serve(router_url, reference):
    jobs = [(prompt, speculative, stream) for prompt in PROMPTS for speculative in (True, False)
            for stream in (False, True)]
    with ThreadPoolExecutor(4) as pool:  # concurrent requests: each replica batches them
        served = list(pool.map(lambda job: complete(router_url, *job), jobs))
    for (prompt, speculative, _), result in zip(jobs, served):
        assert result["token_ids"] == reference_ids(reference, prompt, speculative), (prompt, speculative)
    assert {result["replica"] for result in served} == {"0", "1"}


def test_requests_sharing_a_prefix_go_to_one_replica_and_hit_its_prefix_cache(router_url):
    for prefix in ("You are a helpful assistant. Answer briefly: ", "Translate into French, keep the tone: "):
        served = [complete(router_url, prefix + question) for question in ("why?", "how so?", "where to?")]
        assert {result["replica"] for result in served} == {str(rendezvous_order(prefix[:AFFINITY_CHARS], [0, 1])[0])}
        assert all(result["cached_tokens"] > 0 for result in served[1:])  # the prefix came from that replica's cache


def test_health_info_and_pinning(router_url):
    reported = replicas(router_url)
    assert [r["state"] for r in reported] == ["up", "up"] and [r["threads"] for r in reported] == [1, 1]
    shares = core_shares(2, 1, sorted(os.sched_getaffinity(0)))
    assert [tuple(r["cores"]) if r["cores"] else None for r in reported] == shares
    for replica, share in zip(reported, shares):
        assert replica["pid"] != os.getpid()
        if share is not None:
            assert os.sched_getaffinity(replica["pid"]) == set(share)
    info = httpx.get(router_url + "/v1/specdec/info", timeout=10).json()
    assert info["speculative"] and [r["index"] for r in info["replicas"]] == [0, 1]


def metric(text: str, name: str) -> float:
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(name))


def test_metrics_sum_the_replicas(router_url):
    complete(router_url, PROMPTS[0])
    texts = [httpx.get(r["url"] + "/metrics", timeout=10).text for r in replicas(router_url)]
    summed = httpx.get(router_url + "/metrics", timeout=10).text
    for name in ("specdec:generation_tokens_total", "specdec:request_success_total",
                 "specdec:spec_decode_num_draft_tokens_total", "specdec:kv_cache_total_slots"):
        assert metric(summed, name) == sum(metric(text, name) for text in texts) > 0, name
    assert metric(summed, 'specdec:replica_requests_total{replica="0"}') > 0
    assert metric(summed, 'specdec:replica_requests_total{replica="1"}') > 0


def test_a_killed_replica_fails_its_requests_and_comes_back(router_url, reference):
    victim = replicas(router_url)[0]
    prompts = routed_to(0, [f"Request number {i} to be cut off: tell a story" for i in range(40)])[:3]
    tokens_before = metric(httpx.get(router_url + "/metrics", timeout=10).text, "specdec:generation_tokens_total")
    os.kill(victim["pid"], signal.SIGSTOP)  # frozen: the requests sent now stay in flight on it
    try:
        with ThreadPoolExecutor(2) as pool:
            bodies = [{"model": MODEL, "prompt": prompts[0], "max_tokens": MAX_TOKENS, "stream": True},
                      {"model": MODEL, "prompt": prompts[1], "max_tokens": MAX_TOKENS}]
            cut = [pool.submit(httpx.post, router_url + "/v1/completions", json=body, timeout=60) for body in bodies]
            deadline = time.monotonic() + 30
            while replicas(router_url)[0]["in_flight"] < 2:
                assert time.monotonic() < deadline, "the requests did not reach the replica"
                time.sleep(0.05)
            os.kill(victim["pid"], signal.SIGKILL)
            answers = [future.result(timeout=60) for future in cut]  # errors within the timeout, not hangs
    finally:
        try:  # never leave a stopped process behind, whatever failed above
            os.kill(victim["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    for answer in answers:
        assert answer.status_code == 502 and answer.json()["error"]["code"] == "replica_failed"
        assert answer.headers[REPLICA_HEADER] == "0"
    meanwhile = complete(router_url, prompts[2])  # its replica is down or restarting: another one answers
    assert meanwhile["token_ids"] == reference_ids(reference, prompts[2])
    deadline = time.monotonic() + 120
    while (replica := replicas(router_url)[0])["state"] != "up" or replica["pid"] == victim["pid"]:
        assert time.monotonic() < deadline, f"replica 0 did not come back: {replica}"
        time.sleep(0.2)
    assert replica["restarts"] == 1
    after = complete(router_url, prompts[0])
    assert after["replica"] == "0" and after["token_ids"] == reference_ids(reference, prompts[0])
    summed = httpx.get(router_url + "/metrics", timeout=10).text
    assert metric(summed, 'specdec:replica_restarts_total{replica="0"}') == 1
    assert metric(summed, "specdec:generation_tokens_total") >= tokens_before  # the lost counts are kept


def test_serve_replica_options_parse():
    from specdec.cli import build_parser

    args = build_parser().parse_args(["serve", "m", "--replicas", "2", "--threads", "1", "--ray-address", "auto",
                                      "--affinity-prefix-chars", "64"])
    assert (args.replicas, args.threads, args.ray_address, args.affinity_prefix_chars) == (2, 1, "auto", 64)
    assert build_parser().parse_args(["serve", "m"]).replicas is None  # one engine in the process, no Ray
    with pytest.raises(ValueError, match="--replicas must be >= 1"):
        ReplicaOptions(replicas=0)


def test_without_ray_the_error_says_how_to_install_it(monkeypatch, capsys):
    from specdec.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert main(["serve", "no-model-needed", "--replicas", "2"]) == 2
    assert "pip install 'specdec[ray]'" in capsys.readouterr().err
