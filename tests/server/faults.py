"""Fault injection for the server tests: make a phase of the engine thread raise or hang, from the outside.

The faults wrap callables of a running server (nothing in src/ knows about them):
  add_request  Engine.add_request (the engine thread applies a new request)
  step         Engine.step
  deliver      EngineLoop._deliver (one step's output handed to its request)
  snapshot     EngineLoop._take_snapshot (what /status and /metrics read after each iteration)
A fault does nothing until armed. An armed "raise" fault raises InjectedFault on every call; an armed "hang"
fault blocks every call until released, then calls through.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx

PHASES = ("add_request", "step", "deliver", "snapshot")
KINDS = ("raise", "hang")


class InjectedFault(RuntimeError):
    pass


@dataclass
class Fault:
    phase: str
    kind: str
    armed: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    hits: int = 0  # calls that met the armed fault

    def wrap(self, call):
        def faulty(*args, **kwargs):
            if self.armed.is_set():
                self.hits += 1
                if self.kind == "raise":
                    raise InjectedFault(f"injected fault in {self.phase}")
                self.released.wait(120)
            return call(*args, **kwargs)

        return faulty

    def remove(self) -> None:
        """Disarms the fault and ends any hang in progress."""
        self.armed.clear()
        self.released.set()


def inject(state, phase: str, kind: str) -> Fault:
    """Wraps `phase` of a server's engine or engine loop (state: app.state.server) with a disarmed fault."""
    fault = Fault(phase, kind)
    target, name = {"add_request": (state.engine, "add_request"), "step": (state.engine, "step"),
                    "deliver": (state.loop, "_deliver"), "snapshot": (state.loop, "_take_snapshot")}[phase]
    setattr(target, name, fault.wrap(getattr(target, name)))
    return fault


@dataclass(frozen=True)
class Outcome:
    """How one request ended, as its client saw it."""

    status: int
    error_code: str | None  # from the error body, or from an in-band error event
    in_band: bool = False  # the error came as a stream event after a 200
    seconds: float = 0.0  # from sending to the end of the answer


def request_outcome(url: str, path: str, body: dict, timeout_s: float = 60) -> Outcome:
    """Sends one request and reads its whole answer (a stream to its end)."""
    started = time.monotonic()
    with httpx.stream("POST", url + path, json=body, timeout=timeout_s) as response:
        if response.status_code != 200:
            error = json.loads(response.read())["error"]
            return Outcome(response.status_code, error["code"], seconds=time.monotonic() - started)
        if not body.get("stream"):
            response.read()
            return Outcome(200, None, seconds=time.monotonic() - started)
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    errors = [json.loads(event)["error"] for event in events[:-1] if "error" in json.loads(event)]
    return Outcome(200, errors[0]["code"] if errors else None, in_band=bool(errors),
                   seconds=time.monotonic() - started)
