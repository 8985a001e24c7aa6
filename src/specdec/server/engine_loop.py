"""One background thread owns the Engine; HTTP handlers talk to it only through commands and queues.

    handler (event loop)                         engine thread
    submit(handle) ──► commands (deque + Condition) ──► engine.add_request / engine.abort
                                                          engine.step()  (continuous batching)
    handle.queue  ◄── loop.call_soon_threadsafe(put) ◄──  StepOutput | RequestFailed per request

The thread sleeps on the condition while there is neither a command nor an unfinished request. Nothing but
this thread touches the Engine; readers get an `EngineSnapshot` published after every step. A request that
the engine rejects (ValueError) fails alone; if `Engine.step()` raises, every request that had left the
waiting queue is aborted and failed, and the loop goes on serving the others.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field

from specdec.config import SamplingParams
from specdec.engine.engine import Engine, StepOutput
from specdec.server.metrics import EngineSnapshot, ServerMetrics
from specdec.server.protocol import APIError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestFailed:
    """Put on a request's queue instead of a StepOutput when the engine could not serve it."""

    error: APIError


@dataclass
class RequestHandle:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    speculative: bool
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # StepOutput | RequestFailed
    arrival_s: float = field(default_factory=time.monotonic)
    last_token_s: float | None = None  # engine thread only


@dataclass(frozen=True)
class _Add:
    handle: RequestHandle


@dataclass(frozen=True)
class _Abort:
    request_id: str


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ServerMetrics, max_queue: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.capacity = engine.cache.num_slots + max_queue  # requests in flight before 503
        self._cond = threading.Condition()
        self._commands: collections.deque[_Add | _Abort] = collections.deque()
        self._in_flight = 0  # submitted and not yet finished / failed / aborted (guarded by _cond)
        self._pending_adds = 0  # submitted, not yet handed to the engine (guarded by _cond)
        self._handles: dict[str, RequestHandle] = {}  # engine thread only
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self.snapshot = self._take_snapshot()

    # ---- called from the HTTP side ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def pending(self) -> int:
        with self._cond:
            return self._pending_adds

    def submit(self, handle: RequestHandle) -> None:
        """Queues a request, or raises a 503 APIError when the queue is full or the loop is stopping."""
        with self._cond:
            if self._stopping or not self._thread.is_alive():
                raise APIError(503, "the server is shutting down", "service_unavailable", code="shutting_down")
            if self._in_flight >= self.capacity:
                raise APIError(503, f"the server is at capacity ({self._in_flight} requests in flight); retry later",
                               "service_unavailable", code="queue_full")
            self._in_flight += 1
            self._pending_adds += 1
            self._commands.append(_Add(handle))
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._commands.append(_Abort(request_id))
            self._cond.notify()

    # ---- the engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._commands or self._stopping or self.engine.has_unfinished()):
                    self._cond.wait()
                if self._stopping:
                    break
                commands = list(self._commands)
                self._commands.clear()
            for command in commands:
                self._apply(command)
            if self.engine.has_unfinished():
                self._step()
            self.snapshot = self._take_snapshot()
        self._shutdown()

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            handle = self._handles.pop(command.request_id, None)
            if handle is not None:
                self._safe_abort(command.request_id)
                self.metrics.record_failure("abort")
                self._finish_one()
            return
        handle = command.handle
        with self._cond:
            self._pending_adds -= 1
        try:
            self.engine.add_request(handle.prompt_token_ids, handle.params, request_id=handle.request_id,
                                    speculative=handle.speculative)
        except ValueError as error:
            self._fail(handle, APIError(400, str(error), param="prompt"))
            return
        except Exception as error:  # noqa: BLE001 - one request's failure must not stop the loop
            logger.exception("add_request failed for %s", handle.request_id)
            self._fail(handle, APIError(500, f"could not add the request: {error}", "internal_server_error"))
            return
        self._handles[handle.request_id] = handle
        self.metrics.record_prompt(len(handle.prompt_token_ids))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:  # noqa: BLE001
            logger.exception("Engine.step() raised; failing the requests it was running")
            self.metrics.record_step_error()
            self._fail_running(APIError(500, f"the engine failed while running this request: {error}",
                                        "internal_server_error"))
            return
        for output in outputs:
            self._deliver(output)

    def _deliver(self, output: StepOutput) -> None:
        handle = self._handles.get(output.request_id)
        if handle is None:  # aborted meanwhile
            return
        now = time.monotonic()
        if output.new_token_ids:
            first = handle.last_token_s is None
            self.metrics.record_tokens(first, len(output.new_token_ids), now - handle.arrival_s,
                                       now - (handle.last_token_s or now))
            handle.last_token_s = now
        if output.finished:
            del self._handles[output.request_id]
            self.metrics.record_finish(output.finish_reason, now - handle.arrival_s)
            self._finish_one()
        if not self._post(handle, output) and not output.finished:
            self._handles.pop(output.request_id, None)
            self._safe_abort(output.request_id)
            self.metrics.record_failure("client_gone")
            self._finish_one()

    def _fail_running(self, error: APIError) -> None:
        still_waiting = {seq.request_id for seq in self.engine.waiting}
        for request_id in [rid for rid in self._handles if rid not in still_waiting]:
            self._safe_abort(request_id)
            self._fail(self._handles.pop(request_id), error)

    def _fail(self, handle: RequestHandle, error: APIError) -> None:
        self.metrics.record_failure("error")
        self._finish_one()
        self._post(handle, RequestFailed(error))

    def _safe_abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:  # noqa: BLE001
            logger.exception("Engine.abort(%s) raised", request_id)

    def _finish_one(self) -> None:
        with self._cond:
            self._in_flight -= 1

    @staticmethod
    def _post(handle: RequestHandle, item: StepOutput | RequestFailed) -> bool:
        try:
            handle.loop.call_soon_threadsafe(handle.queue.put_nowait, item)
            return True
        except RuntimeError:  # the handler's event loop is closed
            return False

    def _take_snapshot(self) -> EngineSnapshot:
        engine = self.engine
        prefixes = engine.prefix_cache
        return EngineSnapshot(running=len(engine.running), waiting=len(engine.waiting),
                              free_slots=engine.cache.free_slots, total_slots=engine.cache.num_slots,
                              spec=engine.metrics.copy(),
                              prefix_cache_queries=prefixes.queried_tokens if prefixes else 0,
                              prefix_cache_hits=prefixes.hit_tokens if prefixes else 0)

    def _shutdown(self) -> None:
        with self._cond:
            commands = list(self._commands)
            self._commands.clear()
        error = APIError(503, "the server is shutting down", "service_unavailable", code="shutting_down")
        for command in commands:
            if isinstance(command, _Add):
                self._post(command.handle, RequestFailed(error))
        for request_id, handle in list(self._handles.items()):
            self._safe_abort(request_id)
            self._post(handle, RequestFailed(error))
        self._handles.clear()
