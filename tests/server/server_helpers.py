"""Helpers for the server tests: uvicorn in a thread on a free loopback port (127.0.0.1 only), /metrics parsing."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from specdec.llm import LLM
from specdec.server.app import GracefulServer, ServerConfig, create_app

MAX_MODEL_LEN = 128
MODEL = "tiny-llama"



def metric_samples(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text, keyed 'name{label="value",...}' (parsed with prometheus_client)."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples

@dataclass
class RunningServer:
    url: str
    app: object
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def state(self):
        return self.app.state.server

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed 'name{label="value",...}' (parsed with prometheus_client)."""
        return metric_samples(httpx.get(self.url + "/metrics", timeout=10).text)

    def status(self) -> dict:
        return httpx.get(self.url + "/status", timeout=10).json()

    def wait_idle(self, timeout_s: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.status()
            idle = (status["num_requests_running"] == 0 and status["num_requests_waiting"] == 0
                    and status["kv_cache_free_slots"] == status["kv_cache_total_slots"])
            if idle or time.monotonic() > deadline:
                return status
            time.sleep(0.02)


def start_server(llm, config: ServerConfig | None = None, **uvicorn_options) -> RunningServer:
    """uvicorn_options: more uvicorn.Config arguments (e.g. timeout_graceful_shutdown)."""
    app = create_app(llm, config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = GracefulServer(uvicorn.Config(app, log_level="warning", lifespan="on", **uvicorn_options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    return RunningServer(f"http://127.0.0.1:{port}", app, server, thread)


def tiny_llm(make_tiny_model, tiny_tokenizer, speculative_config=None, max_num_seqs=4) -> LLM:
    """A fixed draft length: the tests count drafts and accepted tokens, which the adaptive policy would make depend
    on how fast this machine runs the model and the drafter."""
    return LLM(loaded=(make_tiny_model("llama"), tiny_tokenizer), speculative_config=speculative_config,
               max_model_len=MAX_MODEL_LEN, max_num_seqs=max_num_seqs, draft_policy="fixed")


NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@contextlib.contextmanager
def ngram_tiny_server(make_tiny_model, tiny_tokenizer):
    """A running server on the tiny llama model with an n-gram drafter, warmed up outside timed requests."""
    llm = tiny_llm(make_tiny_model, tiny_tokenizer, NGRAM_CONFIG)
    llm.generate([[1, 2, 3]])  # warm-up (kernel build)
    running = start_server(llm)
    try:
        yield running
    finally:
        running.stop()
