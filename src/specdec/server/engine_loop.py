"""One background thread owns the Engine; HTTP handlers talk to it only through commands and queues.

    handler (event loop)                         engine thread
    submit(handle) ──► commands (deque + Condition) ──► engine.add_request / engine.abort
                                                          engine.step()  (continuous batching)
    handle.queue  ◄── loop.call_soon_threadsafe(put) ◄──  StepOutput | RequestFailed per request

The thread sleeps on the condition while there is neither a command nor an unfinished request. Nothing but
this thread touches the Engine; readers get an `EngineSnapshot` published after every step.

Failures:
- A request that the engine rejects (ValueError) fails alone (400; 500 for any other error of add_request).
- If `Engine.step()` raises, every request that had left the waiting queue is aborted and failed (500), and the
  loop goes on serving the others. After `unhealthy_after_failed_steps` such steps in a row, every request the
  engine holds fails (500 `engine_failing`) and `health()` is unhealthy, until a step succeeds.
- Any other exception in the thread (delivering outputs, applying commands, taking the snapshot) ends the loop:
  every request in flight or queued is failed with 500 `engine_failed`, and later ones are refused with 503.
- The watchdog: while an iteration (apply commands, step, deliver, snapshot) has run for longer than
  `step_timeout_s`, the engine counts as stalled: `health()` says so, new requests are refused with 503
  `engine_stalled`, and waiting handlers give up with the same error (app.py).

Capacity: a handler first takes a `Reservation` (503 `queue_full` when `max_num_seqs + max_queue` requests are
in flight), before it reads the body; the reservation is handed to the engine with `submit`, or given back.
"""
from __future__ import annotations

import asyncio
import collections
import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass, field

import torch

from specdec.config import SamplingParams
from specdec.engine.engine import Engine, StepOutput
from specdec.server.metrics import EngineSnapshot, ServerMetrics
from specdec.server.protocol import APIError

logger = logging.getLogger(__name__)


def release_openmp_threads() -> bool:
    """Ends the calling thread's OpenMP worker threads in torch's libgomp (`omp_pause_resource_all`); they come back
    if this thread runs a parallel region again. True when released; False where torch has no libgomp of its own.

    Every thread that runs a parallel region keeps its own team of workers. libgomp cuts its spin-wait at team
    barriers from about 3 ms to about 1 us while it manages more threads than there are CPUs, and then every
    parallel region of a forward ends in futex sleeps and wake-ups. The model is loaded on the main thread and
    stepped on the engine thread: with both teams alive, 2 torch threads on 2 cores decoded Qwen2.5-Coder-0.5B at
    21-31 tok/s against 41 tok/s on the loading thread alone (37-38 tok/s with the loading thread's team released).
    """
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    if not os.path.exists(path):
        return False
    try:
        gomp = ctypes.CDLL(path)  # already loaded by torch: the same library and thread pools
        return gomp.omp_pause_resource_all(1) == 0  # 1: omp_pause_soft
    except (OSError, AttributeError):
        logger.debug("could not release the OpenMP threads through %s", path, exc_info=True)
        return False


@dataclass(frozen=True)
class WatchdogConfig:
    step_timeout_s: float = 60.0  # an iteration of the engine thread running longer than this is a stall
    unhealthy_after_failed_steps: int = 3  # this many Engine.step() failures in a row make /health 503

    def __post_init__(self) -> None:
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0, got {self.step_timeout_s!r}")
        if self.unhealthy_after_failed_steps < 1:
            raise ValueError(f"unhealthy_after_failed_steps must be >= 1, got {self.unhealthy_after_failed_steps!r}")


@dataclass(frozen=True)
class EngineHealth:
    """What /health answers. code: None when healthy; else engine_failed (the loop stopped on an error),
    engine_stopped (the thread is not running), engine_stalled (the watchdog), engine_failing (steps raise)."""

    code: str | None
    message: str

    @property
    def ok(self) -> bool:
        return self.code is None

    def error(self) -> APIError:
        return APIError(503, self.message, "service_unavailable", code=self.code)


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
    reason: str  # the request_failure_total label: abort (client left), timeout, error (the handler gave up)


def shutting_down_error() -> APIError:
    return APIError(503, "the server is shutting down", "service_unavailable", code="shutting_down")


class Reservation:
    """A place among the requests in flight, taken before the request's body is read. `submit` hands it, with
    the request, to the engine thread (which gives the place back when the request ends); leaving the `with`
    block without submitting gives it back at once."""

    def __init__(self, loop: EngineLoop) -> None:
        self._loop = loop
        self._submitted = False

    def submit(self, handle: RequestHandle) -> None:
        self._loop._submit_reserved(handle)
        self._submitted = True

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc_info) -> None:
        if not self._submitted:
            self._loop._release_reserved()


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ServerMetrics, max_queue: int,
                 watchdog: WatchdogConfig = WatchdogConfig()) -> None:
        self.engine = engine
        self.metrics = metrics
        self.watchdog = watchdog
        self.capacity = engine.cache.num_slots + max_queue  # requests in flight before 503
        self._cond = threading.Condition()
        self._commands: collections.deque[_Add | _Abort] = collections.deque()
        self._in_flight = 0  # reserved and not yet finished / failed / aborted / released (guarded by _cond)
        self._pending_adds = 0  # submitted, not yet handed to the engine (guarded by _cond)
        self._handles: dict[str, RequestHandle] = {}  # engine thread only
        self._stopping = False
        self._failure: APIError | None = None  # set once, when the loop stopped on an error (guarded by _cond)
        # Written by the engine thread, read by the watchdog (single attribute reads and writes):
        self._busy_since_s: float | None = None  # start of the iteration in progress; None while idle
        self._phase = "idle"  # idle, apply, step, deliver, snapshot
        self._failed_steps_in_a_row = 0
        self._last_step_error = ""
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self.snapshot = self._take_snapshot()

    # ---- called from the HTTP side ----------------------------------------------------------------------
    def start(self) -> None:
        release_openmp_threads()  # the thread that loaded the model (the server's main thread) steps no more
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("the engine thread did not stop within %.1f s (it is in %s); leaving it behind",
                           timeout_s, self._phase)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def pending(self) -> int:
        with self._cond:
            return self._pending_adds

    @property
    def failed_steps_in_a_row(self) -> int:
        return self._failed_steps_in_a_row

    def health(self) -> EngineHealth:
        if self._failure is not None:
            return EngineHealth("engine_failed", self._failure.message)
        if not self._thread.is_alive():
            return EngineHealth("engine_stopped", "the engine thread is not running")
        stall = self._stall_message()
        if stall is not None:
            return EngineHealth("engine_stalled", stall)
        failed = self._failed_steps_in_a_row
        if failed >= self.watchdog.unhealthy_after_failed_steps:
            return EngineHealth("engine_failing", f"the last {failed} engine steps all raised (the last one: "
                                                  f"{self._last_step_error})")
        return EngineHealth(None, "ok")

    def unavailable_error(self) -> APIError | None:
        """Why a waiting handler should stop waiting: the loop failed, stopped, or is stalled; None otherwise."""
        if self._failure is not None:
            return self._failure
        if not self._thread.is_alive():
            return shutting_down_error()
        stall = self._stall_message()
        return None if stall is None else EngineHealth("engine_stalled", stall).error()

    def reserve(self) -> Reservation:
        """A place for one more request, or a 503 APIError: queue full, stopping, failed or stalled."""
        with self._cond:
            self._raise_if_unavailable()
            if self._in_flight >= self.capacity:
                raise APIError(503, f"the server is at capacity ({self._in_flight} requests in flight); retry later",
                               "service_unavailable", code="queue_full")
            self._in_flight += 1
        return Reservation(self)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        with self._cond:
            self._commands.append(_Abort(request_id, reason))
            self._cond.notify()

    def _submit_reserved(self, handle: RequestHandle) -> None:
        with self._cond:
            self._raise_if_unavailable()
            self._pending_adds += 1
            self._commands.append(_Add(handle))
            self._cond.notify()

    def _release_reserved(self) -> None:
        with self._cond:
            self._in_flight -= 1

    def _raise_if_unavailable(self) -> None:
        if self._failure is not None:
            raise APIError(503, f"the engine has failed and cannot serve until the server is restarted: "
                                f"{self._failure.message}", "service_unavailable", code="engine_failed")
        if self._stopping or not self._thread.is_alive():
            raise shutting_down_error()
        stall = self._stall_message()
        if stall is not None:
            raise EngineHealth("engine_stalled", stall).error()

    def _stall_message(self) -> str | None:
        busy_since_s = self._busy_since_s
        if busy_since_s is None:
            return None
        busy_s = time.monotonic() - busy_since_s
        if busy_s <= self.watchdog.step_timeout_s:
            return None
        return (f"the engine is stalled: no engine step has finished for {busy_s:.1f} s (the step timeout is "
                f"{self.watchdog.step_timeout_s:g} s); the engine thread is in {self._phase}")

    # ---- the engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._iterate():
                pass
        except BaseException as error:  # noqa: BLE001 - whatever ends the loop, its requests must hear of it
            self._fail_everything(error)
            return
        self._shutdown()

    def _iterate(self) -> bool:
        """One iteration: wait for work, apply the commands, step, deliver, publish a snapshot. False: stop."""
        self._busy_since_s, self._phase = None, "idle"
        engine_busy = self.engine.has_unfinished()  # outside the lock: engine code never runs under it
        with self._cond:
            while not (self._commands or self._stopping or engine_busy):
                self._cond.wait()  # only commands change the engine's state while this thread waits
            if self._stopping:
                return False
            self._busy_since_s = time.monotonic()
            commands = list(self._commands)
            self._commands.clear()
        self._phase = "apply"
        for command in commands:
            self._apply(command)
        if self.engine.has_unfinished():
            self._step()
        self._phase = "snapshot"
        self.snapshot = self._take_snapshot()
        return True

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            handle = self._handles.pop(command.request_id, None)
            if handle is not None:
                self._safe_abort(command.request_id)
                self.metrics.record_failure(command.reason)
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
        self._phase = "step"
        try:
            outputs = self.engine.step()
        except Exception as error:  # noqa: BLE001
            self._step_failed(error)
            return
        self._failed_steps_in_a_row = 0
        self._phase = "deliver"
        for output in outputs:
            self._deliver(output)

    def _step_failed(self, error: Exception) -> None:
        """The requests the step was running fail; after `unhealthy_after_failed_steps` failures in a row, those
        waiting for a slot fail too (a step that raises before it admits them would never fail them)."""
        self._failed_steps_in_a_row += 1
        self._last_step_error = f"{type(error).__name__}: {error}"
        self.metrics.record_step_error()
        failed = self._failed_steps_in_a_row
        if failed < self.watchdog.unhealthy_after_failed_steps:
            logger.exception("Engine.step() raised; failing the requests it was running")
            self._fail_running(APIError(500, f"the engine failed while running this request: {error}",
                                        "internal_server_error"))
            return
        logger.exception("Engine.step() raised for the %d. time in a row; failing every request the engine holds",
                         failed)
        failing = APIError(500, f"the last {failed} engine steps all raised (the last one: {self._last_step_error})",
                           "internal_server_error", code="engine_failing")
        for request_id in list(self._handles):
            self._safe_abort(request_id)
            self._fail(self._handles.pop(request_id), failing)

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

    def _fail_everything(self, error: BaseException) -> None:
        """The loop is ending on an error: every request it holds or has queued fails with 500 engine_failed,
        and from now on `reserve` refuses new ones. Each step here is guarded: nothing may stop the failing."""
        phase = self._phase
        logger.error("the engine loop stopped on an error in %s; failing every request in flight", phase,
                     exc_info=error)
        failure = APIError(500, f"the engine loop stopped on an error in {phase} ({type(error).__name__}: {error}); "
                                "the server must be restarted", "internal_server_error", code="engine_failed")
        with self._cond:
            self._failure = failure
            commands = list(self._commands)
            self._commands.clear()
            self._pending_adds = 0
            self._in_flight = 0
        queued = [command.handle for command in commands if isinstance(command, _Add)]
        running = list(self._handles.values())
        self._handles.clear()
        for handle in running:
            self._safe_abort(handle.request_id)
        for handle in queued + running:
            try:
                self.metrics.record_failure("error")
                self._post(handle, RequestFailed(failure))
            except Exception:  # noqa: BLE001
                logger.exception("could not fail request %s", handle.request_id)
        self._busy_since_s, self._phase = None, "stopped"

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
        error = shutting_down_error()
        for command in commands:
            if isinstance(command, _Add):
                self._post(command.handle, RequestFailed(error))
        for request_id, handle in list(self._handles.items()):
            self._safe_abort(request_id)
            self._post(handle, RequestFailed(error))
        self._handles.clear()
