"""Fault injection: the engine raises, or hangs, in each phase of the engine thread (faults.py). Every waiting
client, running or queued, streaming or not, gets its error within WAIT_S; /health says what went wrong; and a
new server on the same engine, the fault removed, serves normally. Also: clients that leave while queued, the
request deadline, a loop that dies without telling its handlers, and a shutdown with a hung engine."""
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from faults import KINDS, PHASES, inject, request_outcome
from server_helpers import MODEL, start_server, tiny_llm
from specdec.server.app import ServerConfig
from specdec.server.engine_loop import WatchdogConfig

WAIT_S = 10.0  # a generous bound: the watchdog here fires after 1 s, handlers look every 0.05 s
NUM_SLOTS = 2
LONG = {"model": MODEL, "prompt": "abc abc abc", "max_tokens": 100, "ignore_eos": True, "temperature": 0}
SHORT = {"model": MODEL, "prompt": "abc", "max_tokens": 4, "temperature": 0}
FAULT_CONFIG = ServerConfig(max_queue=4, disconnect_poll_s=0.05,
                            watchdog=WatchdogConfig(step_timeout_s=1.0, unhealthy_after_failed_steps=1))

# (phase, kind) -> (HTTP status, error code) each waiting client gets, and /health's code (None: 200)
EXPECTED = {
    ("add_request", "raise"): (500, None, None),  # the request fails alone, the engine stays healthy
    ("step", "raise"): (500, "engine_failing", "engine_failing"),  # unhealthy after 1 failure: all held fail
    ("deliver", "raise"): (500, "engine_failed", "engine_failed"),  # the loop ends: everything in flight fails
    ("snapshot", "raise"): (500, "engine_failed", "engine_failed"),
    **{(phase, "hang"): (503, "engine_stalled", "engine_stalled") for phase in PHASES},
}


def slow_plain_llm(make_tiny_model, tiny_tokenizer):
    """Plain decoding, NUM_SLOTS slots, 20 ms per step: a LONG request runs for 2 s or more."""
    llm = tiny_llm(make_tiny_model, tiny_tokenizer, max_num_seqs=NUM_SLOTS)
    real_step = llm.engine.step

    def slow_step():
        time.sleep(0.02)
        return real_step()

    llm.engine.step = slow_step
    return llm


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def health(url: str) -> tuple[int, str | None]:
    response = httpx.get(url + "/health", timeout=10)
    return response.status_code, None if response.status_code == 200 else response.json()["error"]["code"]


def assert_serves_normally(llm) -> None:
    server = start_server(llm, ServerConfig())
    try:
        assert health(server.url) == (200, None)
        for stream in (False, True):
            outcome = request_outcome(server.url, "/v1/completions", {**SHORT, "stream": stream})
            assert (outcome.status, outcome.error_code) == (200, None)
        status = server.wait_idle()
        assert status["kv_cache_free_slots"] == NUM_SLOTS and status["num_requests_waiting"] == 0
    finally:
        server.stop()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("phase", PHASES)
def test_fault_fails_every_waiting_client_and_health_tells(make_tiny_model, tiny_tokenizer, phase, kind):
    llm = slow_plain_llm(make_tiny_model, tiny_tokenizer)
    server = start_server(llm, FAULT_CONFIG)
    fault = inject(server.state, phase, kind)
    status, code, health_code = EXPECTED[(phase, kind)]
    bodies = [{**LONG, "stream": i % 2 == 0} for i in range(4)]  # two run in the two slots, two wait
    try:
        with ThreadPoolExecutor(len(bodies)) as pool:
            if phase == "add_request":  # the requests meet the fault as they reach the engine
                fault.armed.set()
            futures = [pool.submit(request_outcome, server.url, "/v1/completions", body) for body in bodies]
            if phase != "add_request":
                # all four reached the engine (two running, two waiting) before the fault: a request that came
                # later would rightly get 503 engine_failed instead
                wait_for(lambda: (lambda s: (s["num_requests_running"], s["num_requests_waiting"]))(server.status())
                         == (NUM_SLOTS, len(bodies) - NUM_SLOTS))
                fault.armed.set()
            armed_at = time.monotonic()
            outcomes = [future.result(timeout=60) for future in futures]
            answered_within_s = time.monotonic() - armed_at
        assert fault.hits >= 1
        for outcome in outcomes:
            assert outcome.error_code == code, outcomes
            assert outcome.status == status or (outcome.status == 200 and outcome.in_band), outcomes
        assert answered_within_s < WAIT_S
        assert health(server.url) == (200 if health_code is None else 503, health_code)
        if kind == "hang" or phase in ("deliver", "snapshot"):  # new requests are refused at once
            refused = request_outcome(server.url, "/v1/completions", SHORT)
            assert (refused.status, refused.error_code) == (503, health_code)
        body = httpx.get(server.url + "/health", timeout=10).json()
        if health_code is not None:  # the body says why
            assert body["error"]["message"] and body["error"]["type"] == "service_unavailable"
    finally:
        fault.remove()
        server.stop()
    assert_serves_normally(llm)


def test_failing_steps_fail_the_waiting_requests_and_a_good_step_ends_it(make_tiny_model, tiny_tokenizer):
    """A step that raises before it admits anything: the request waits in the engine until the third failure in
    a row fails it (500 engine_failing); a step that succeeds makes the engine healthy again."""
    llm = slow_plain_llm(make_tiny_model, tiny_tokenizer)
    server = start_server(llm, ServerConfig(watchdog=WatchdogConfig(unhealthy_after_failed_steps=3)))
    fault = inject(server.state, "step", "raise")
    try:
        assert health(server.url) == (200, None)
        fault.armed.set()
        failed = request_outcome(server.url, "/v1/completions", SHORT)
        assert (failed.status, failed.error_code) == (500, "engine_failing") and fault.hits == 3
        assert health(server.url) == (503, "engine_failing")
        assert server.status()["engine_failed_steps_in_a_row"] == 3
        assert server.metrics()["specdec:engine_step_errors_total"] == 3
        fault.armed.clear()
        assert request_outcome(server.url, "/v1/completions", SHORT).status == 200
        assert health(server.url) == (200, None)
        assert server.status()["engine_failed_steps_in_a_row"] == 0
    finally:
        fault.remove()
        server.stop()


def test_handlers_notice_a_dead_loop_that_could_not_tell_them(make_tiny_model, tiny_tokenizer):
    """If the dying loop cannot post the errors, a waiting handler still notices within one poll."""
    llm = slow_plain_llm(make_tiny_model, tiny_tokenizer)
    server = start_server(llm, FAULT_CONFIG)
    loop = server.state.loop
    real_fail_everything = loop._fail_everything

    def fail_without_posting(error):
        loop._post = lambda handle, item: False  # the queues never hear of it
        real_fail_everything(error)

    loop._fail_everything = fail_without_posting
    fault = inject(server.state, "deliver", "raise")
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(request_outcome, server.url, "/v1/completions", {**LONG, "stream": stream})
                       for stream in (False, True)]
            wait_for(lambda: server.status()["num_requests_running"] == 2)
            fault.armed.set()
            outcomes = [future.result(timeout=60) for future in futures]
        assert [outcome.error_code for outcome in outcomes] == ["engine_failed", "engine_failed"]
        assert outcomes[0].status == 500 and outcomes[1].in_band
    finally:
        fault.remove()
        server.stop()


def test_client_that_leaves_while_queued_is_aborted_and_logged_once(make_tiny_model, tiny_tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="specdec.server")
    llm = slow_plain_llm(make_tiny_model, tiny_tokenizer)
    server = start_server(llm, ServerConfig(max_queue=4, disconnect_poll_s=0.05))
    try:
        with ThreadPoolExecutor(NUM_SLOTS) as pool:
            running = [pool.submit(request_outcome, server.url, "/v1/completions", LONG) for _ in range(NUM_SLOTS)]
            wait_for(lambda: server.status()["num_requests_running"] == NUM_SLOTS)
            with pytest.raises(httpx.ReadTimeout):  # queued behind the two; the client gives up
                httpx.post(server.url + "/v1/completions", json=LONG, timeout=0.5)
            with pytest.raises(httpx.ReadTimeout):
                with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True},
                                  timeout=0.5) as response:
                    response.read()
            wait_for(lambda: server.metrics().get('specdec:request_failure_total{reason="abort"}') == 2)
            assert server.status()["num_requests_waiting"] == 0  # both left the queue
            assert all(future.result(timeout=60).status == 200 for future in running)
        assert server.wait_idle()["kv_cache_free_slots"] == NUM_SLOTS
    finally:
        server.stop()
    left = [r for r in caplog.records if "client disconnected before its first token" in r.getMessage()]
    assert len(left) == 2 and all(r.levelno == logging.INFO for r in left)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]


def test_client_that_leaves_a_non_streamed_request_is_logged_once(make_tiny_model, tiny_tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="specdec.server")
    server = start_server(slow_plain_llm(make_tiny_model, tiny_tokenizer), ServerConfig(disconnect_poll_s=0.05))
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=LONG, timeout=0.5)
        assert server.wait_idle()["kv_cache_free_slots"] == NUM_SLOTS
    finally:
        server.stop()
    left = [r for r in caplog.records if "client disconnected" in r.getMessage()]
    assert len(left) == 1 and "non-streamed" in left[0].getMessage()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]


def test_request_timeout_answers_504_and_frees_the_slot(make_tiny_model, tiny_tokenizer):
    server = start_server(slow_plain_llm(make_tiny_model, tiny_tokenizer),
                          ServerConfig(request_timeout_s=0.5, disconnect_poll_s=0.05))
    try:
        whole = request_outcome(server.url, "/v1/completions", LONG)
        streamed = request_outcome(server.url, "/v1/completions", {**LONG, "stream": True})
        assert (whole.status, whole.error_code) == (504, "request_timeout")
        assert streamed.in_band and streamed.error_code == "request_timeout"  # tokens had started to flow
        assert whole.seconds < WAIT_S and streamed.seconds < WAIT_S
        status = server.wait_idle()
        assert status["kv_cache_free_slots"] == NUM_SLOTS and status["num_requests_running"] == 0
        assert server.metrics()['specdec:request_failure_total{reason="timeout"}'] == 2
        assert request_outcome(server.url, "/v1/completions", SHORT).status == 200  # short ones fit
    finally:
        server.stop()


def test_shutdown_ends_running_requests_with_503_at_its_timeout(make_tiny_model, tiny_tokenizer, caplog):
    """The engine hangs, a stop begins: the waiting clients get 503 shutting_down (in-band for a stream) once the
    shutdown timeout has passed, new requests are refused, and the server stops without cancelling anything."""
    llm = slow_plain_llm(make_tiny_model, tiny_tokenizer)
    server = start_server(llm, ServerConfig(shutdown_timeout_s=0.5, disconnect_poll_s=0.05))
    fault = inject(server.state, "step", "hang")
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(request_outcome, server.url, "/v1/completions", {**LONG, "stream": stream})
                       for stream in (False, True)]
            wait_for(lambda: server.status()["num_requests_running"] == 2)
            fault.armed.set()
            wait_for(lambda: fault.hits >= 1)
            started = time.monotonic()
            stopper = threading.Thread(target=server.stop)
            stopper.start()
            outcomes = [future.result(timeout=60) for future in futures]
            stopper.join(60)
        assert (outcomes[0].status, outcomes[0].error_code) == (503, "shutting_down")
        assert outcomes[1].in_band and outcomes[1].error_code == "shutting_down"
        assert not server.thread.is_alive() and time.monotonic() - started < WAIT_S
    finally:
        fault.remove()
    assert not [r for r in caplog.records if "Cancel" in r.getMessage() or "Exception in ASGI" in r.getMessage()]


def test_health_and_status_of_a_healthy_server(ngram_server):
    assert health(ngram_server.url) == (200, None)
    status = ngram_server.status()
    assert status["health"] == {"ok": True, "code": None, "message": "ok"}
    assert status["engine_failed_steps_in_a_row"] == 0
    assert json.loads(httpx.get(ngram_server.url + "/health", timeout=10).text) == {"status": "ok"}
