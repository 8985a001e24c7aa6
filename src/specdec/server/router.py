"""One OpenAI-compatible endpoint in front of N replicas of the single-engine server (`specdec serve --replicas N`).

    client ──► router app (this module, in the `specdec serve` process)
                 │ affinity key: the first `affinity_prefix_chars` characters of the prompt, or of the chat
                 │ messages serialized in order; rendezvous hashing over the live replicas, with bounded load
                 ▼
               replica i: app.py's server (one engine with its drafter) on its own port, in its own process

Each replica is the server of app.py unchanged, so a request gets the same checks, errors and output from it as from
a single server; the router forwards the bytes (a stream event by event) and adds `x-specdec-replica: i`. Requests
whose keys agree land on the same replica while it is live and not more loaded than `load_factor` times the mean,
so its prefix cache and the suffix drafter's cross-request cache keep paying.

Failures: a replica whose process died (connection refused or reset, or `health_failures_to_down` health checks in
a row timed out) is marked down, and every request in flight on it ends at once: 502 `replica_failed`, or in-band
(an error event, then `data: [DONE]`) once its stream has begun. New requests go to the other replicas. The pool
(replicas.py: Ray restarts the actor) brings the replica back; it is routed to again once its /health answers 200.
A replica whose engine loop failed (`engine_failed`, which only a restart mends) is restarted by the router.
This module does not import Ray: the pool is an interface (`ReplicaPool`).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import socket
from abc import ABC, abstractmethod
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from specdec.server.app import CLIENT_CLOSED_REQUEST, SHUTDOWN_BACKSTOP_S, read_body
from specdec.server.protocol import APIError, RequestLimits
from specdec.server.responses import sse

logger = logging.getLogger(__name__)
REPLICA_HEADER = "x-specdec-replica"  # which replica served a response (its index)
AFFINITY_PATHS = ("/v1/completions", "/v1/chat/completions")
# request headers not passed on (hop-by-hop, or recomputed by the client library)
DROPPED_REQUEST_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
                           "proxy-connection"}
DROPPED_RESPONSE_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}
CUMULATIVE_TYPES = ("counter", "histogram", "summary")  # metric families whose samples only grow


@dataclass(frozen=True)
class RouterConfig:
    affinity_prefix_chars: int = 256  # characters of the prompt that pick the replica; 0: least loaded replica
    load_factor: float = 1.25  # a replica takes a key's request while its in-flight count < load_factor x the mean
    health_interval_s: float = 1.0  # how often each replica's /health is checked
    health_timeout_s: float = 5.0  # a health check without an answer by then counts as timed out
    health_failures_to_down: int = 3  # timed-out health checks in a row that mark a replica down
    connect_timeout_s: float = 5.0
    restart_timeout_s: float = 600.0  # how long one wait for a restarted replica may take (the model loads)
    max_body_bytes: int = RequestLimits.max_body_bytes  # bodies over this get 413 at the router (the replicas' own)
    shutdown_timeout_s: float = 30.0  # the replicas' own; the router waits a little longer for their answers

    def __post_init__(self) -> None:
        if self.affinity_prefix_chars < 0:
            raise ValueError(f"affinity_prefix_chars must be >= 0, got {self.affinity_prefix_chars}")
        if not self.load_factor > 1.0:
            raise ValueError(f"load_factor must be > 1, got {self.load_factor!r}")
        if self.health_failures_to_down < 1:
            raise ValueError(f"health_failures_to_down must be >= 1, got {self.health_failures_to_down}")


@dataclass(frozen=True)
class ReplicaAddress:
    """Where one incarnation of a replica serves, as the replica reports it."""

    index: int
    url: str  # http://host:port of its server
    pid: int
    node: str  # the node's IP address
    threads: int  # torch threads
    cores: tuple[int, ...] | None  # the cores it is pinned to; None: not pinned


class ReplicaUnavailable(Exception):
    """The replica cannot answer now (it is restarting); asking again later may succeed."""


class ReplicaDead(Exception):
    """The replica will never serve again (its start failed, or it ran out of restarts)."""


class ReplicaPool(ABC):
    """The processes behind the router: started, restarted and stopped by whatever runs them (replicas.py: Ray)."""

    @abstractmethod
    async def address(self, index: int) -> ReplicaAddress:
        """The replica's current address once it serves (waiting for a restart to finish); ReplicaUnavailable while
        it cannot be reached, ReplicaDead when it never will be."""

    @abstractmethod
    def restart(self, index: int) -> None:
        """Ends the replica's process; the pool starts a new one."""

    @abstractmethod
    def begin_shutdown(self) -> None:
        """Tells every replica that a shutdown began (503 shutting_down for new requests; running ones end by the
        shutdown timeout)."""


class ReplicaLost(Exception):
    """The replica serving a request was marked down while the request waited on it."""


class ClientGone(Exception):
    """The client of a non-streamed request disconnected while the replica worked on it."""


@dataclass
class ReplicaState:
    """The router's view of one replica (touched only on the router's event loop)."""

    index: int
    address: ReplicaAddress | None = None
    state: str = "starting"  # up, unhealthy (its /health is not 200), down (restarting), dead
    message: str = ""  # why it is not up
    in_flight: int = 0  # requests forwarded to it and not yet answered in full
    routed: int = 0  # requests it answered (at least began to), ever
    restarts: int = 0  # new processes seen since the router started
    health_timeouts: int = 0  # timed-out health checks in a row
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # set when this incarnation is lost
    last_cumulative: dict[str, dict[str, float]] = field(default_factory=dict)  # family -> sample -> value, as
    # last scraped (cumulative families only)

    def report(self) -> dict[str, Any]:
        address = asdict(self.address) if self.address else {}
        return {"index": self.index, "state": self.state, "message": self.message, "url": address.get("url"),
                "pid": address.get("pid"), "node": address.get("node"), "threads": address.get("threads"),
                "cores": address.get("cores"), "in_flight": self.in_flight, "requests": self.routed,
                "restarts": self.restarts}


def affinity_key(path: str, body: bytes, prefix_chars: int) -> str | None:
    """The first prefix_chars characters of what the prompt begins with: the prompt (the first of a batch), or the
    chat messages' roles and contents serialized in order, so that a conversation's next turn (the same messages
    and more) has the same key. None: no key (not a generation request, not JSON, affinity off)."""
    if prefix_chars == 0 or path not in AFFINITY_PATHS:
        return None
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    if not isinstance(payload, dict):
        return None
    if path == "/v1/chat/completions":
        messages = payload.get("messages")
        if not isinstance(messages, list):
            return None
        turns = [[m.get("role"), m.get("content")] if isinstance(m, dict) else m for m in messages]
        text = json.dumps(turns, ensure_ascii=False, separators=(",", ":"))
    else:
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: its first prompt
        text = prompt if isinstance(prompt, str) else json.dumps(prompt, separators=(",", ":"))
    return text[:prefix_chars]


def rendezvous_order(key: str, indices: list[int]) -> list[int]:
    """The replica indices by their rendezvous (highest random weight) score for the key, best first: the same order
    in every process, and a replica that leaves moves only its own keys."""
    def score(index: int) -> int:
        return int.from_bytes(hashlib.blake2b(f"{index}\0{key}".encode(), digest_size=8).digest(), "big")

    return sorted(indices, key=score, reverse=True)


def choose_replica(live: list[ReplicaState], key: str | None, load_factor: float) -> ReplicaState:
    """The key's first replica in rendezvous order whose in-flight count is below load_factor x the mean (with this
    request); without a key, the least loaded. Some replica is always below the bound, as the bound times the
    number of replicas exceeds the requests in flight."""
    if key is None:
        return min(live, key=lambda replica: (replica.in_flight, replica.index))
    by_index = {replica.index: replica for replica in live}
    total = sum(replica.in_flight for replica in live)
    bound = max(1, math.ceil(load_factor * (total + 1) / len(live)))
    order = rendezvous_order(key, list(by_index))
    return next(by_index[index] for index in order if by_index[index].in_flight < bound)


class Router:
    """The replicas' states, the choice of a replica, the health checks and the recovery of lost replicas."""

    def __init__(self, pool: ReplicaPool, addresses: list[ReplicaAddress], config: RouterConfig,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        """transport: how HTTP reaches the replicas (None: the network; tests pass a mock)."""
        self.pool = pool
        self.transport = transport
        self.config = config
        self.replicas = [ReplicaState(address.index, address, "up") for address in addresses]
        self.retired_cumulative: dict[str, dict[str, float]] = {}  # earlier incarnations' cumulative samples
        self.client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False

    # ---- lifecycle (on the router's event loop) ---------------------------------------------------------------
    async def start(self) -> None:
        timeout = httpx.Timeout(connect=self.config.connect_timeout_s, read=None, write=60.0, pool=None)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, transport=self.transport)
        self._spawn(self._monitor())

    async def stop(self) -> None:
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.client is not None:
            await self.client.aclose()

    def begin_shutdown(self) -> None:
        self._stopping = True
        self.pool.begin_shutdown()

    def _spawn(self, coroutine: Awaitable) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- routing ----------------------------------------------------------------------------------------------
    def choose(self, key: str | None, exclude: set[int]) -> ReplicaState:
        live = [r for r in self.replicas if r.state == "up" and r.index not in exclude]
        if not live:
            states = ", ".join(f"{r.index}: {r.state}" for r in self.replicas)
            raise APIError(503, f"no replica can take the request now ({states}); retry later", "service_unavailable",
                           code="no_replica_available")
        return choose_replica(live, key, self.config.load_factor)

    # ---- health -----------------------------------------------------------------------------------------------
    async def _monitor(self) -> None:
        while True:
            checked = [r for r in self.replicas if r.state in ("up", "unhealthy")]
            results = await asyncio.gather(*(self.check(r) for r in checked), return_exceptions=True)
            for replica, result in zip(checked, results):
                if isinstance(result, Exception):  # a bug in a check must not end the checks
                    logger.error("the health check of replica %d raised", replica.index, exc_info=result)
            await asyncio.sleep(self.config.health_interval_s)

    async def check(self, replica: ReplicaState) -> None:
        """One health check: 200 up, another status unhealthy (engine_failed: restarted), no answer down."""
        address = replica.address
        try:
            response = await self.client.get(address.url + "/health", timeout=self.config.health_timeout_s)
        except httpx.TimeoutException:
            replica.health_timeouts += 1
            if replica.health_timeouts >= self.config.health_failures_to_down:
                self.mark_down(replica, f"{replica.health_timeouts} health checks in a row timed out")
            return
        except httpx.TransportError as error:
            self.mark_down(replica, f"its server does not answer ({type(error).__name__}: {error})")
            return
        replica.health_timeouts = 0
        if replica.address is not address or replica.state not in ("up", "unhealthy"):
            return  # marked down, or replaced, meanwhile
        if response.status_code == 200:
            replica.state, replica.message = "up", ""
            return
        error = _error_of(response)
        replica.state, replica.message = "unhealthy", error.get("message", f"/health answered {response.status_code}")
        if error.get("code") == "engine_failed":
            logger.warning("replica %d: its engine loop failed (%s); restarting it", replica.index, replica.message)
            self.pool.restart(replica.index)
            self.mark_down(replica, f"restarted after its engine failed: {replica.message}")

    def mark_down(self, replica: ReplicaState, reason: str) -> None:
        """The replica's current incarnation is lost: its requests in flight end now, and the recovery begins."""
        if replica.state in ("down", "dead") or self._stopping:
            return
        logger.warning("replica %d is down: %s", replica.index, reason)
        replica.state, replica.message = "down", reason
        replica.gone.set()
        self._spawn(self._recover(replica))

    async def _recover(self, replica: ReplicaState) -> None:
        """Waits for the pool's next incarnation of the replica; routes to it again once its /health says ok."""
        lost = replica.address
        while not self._stopping:
            try:
                address = await asyncio.wait_for(self.pool.address(replica.index), self.config.restart_timeout_s)
            except ReplicaDead as error:
                replica.state, replica.message = "dead", f"it will not be restarted: {error}"
                logger.error("replica %d is dead: %s", replica.index, error)
                return
            except (ReplicaUnavailable, asyncio.TimeoutError):
                await asyncio.sleep(self.config.health_interval_s)
                continue
            if not await self._healthy(address):
                await asyncio.sleep(self.config.health_interval_s)
                continue
            if address.pid != lost.pid or address.url != lost.url:
                replica.restarts += 1
                self._retire(replica)
            replica.address, replica.gone, replica.health_timeouts = address, asyncio.Event(), 0
            replica.state, replica.message = "up", ""
            logger.info("replica %d is up again (pid %d, %s)", replica.index, address.pid, address.url)
            return

    async def _healthy(self, address: ReplicaAddress) -> bool:
        try:
            response = await self.client.get(address.url + "/health", timeout=self.config.health_timeout_s)
        except httpx.TransportError:
            return False
        return response.status_code == 200

    def _retire(self, replica: ReplicaState) -> None:
        """Keeps a lost incarnation's cumulative samples (as last scraped), so that the sums stay monotonic."""
        for name, samples in replica.last_cumulative.items():
            retired = self.retired_cumulative.setdefault(name, {})
            for key, value in samples.items():
                retired[key] = retired.get(key, 0.0) + value
        replica.last_cumulative = {}

    # ---- reports ----------------------------------------------------------------------------------------------
    def health(self) -> tuple[int, dict[str, Any]]:
        up = sum(r.state == "up" for r in self.replicas)
        status = "ok" if up == len(self.replicas) else "degraded" if up else "unavailable"
        return (200 if up else 503), {"status": status, "replicas": [r.report() for r in self.replicas]}

    async def metrics(self) -> str:
        """The replicas' /metrics summed sample by sample (plus earlier incarnations' cumulative samples), then the
        router's own: replicas by state, and per replica up, restarts, requests routed and in flight."""
        scraped = await asyncio.gather(*(self._scrape(r) for r in self.replicas if r.state in ("up", "unhealthy")))
        families = merge_metric_texts([text for text in scraped if text is not None], self.retired_cumulative)
        return render_families(families) + "\n".join(self._router_metric_lines()) + "\n"

    async def _scrape(self, replica: ReplicaState) -> str | None:
        try:
            response = await self.client.get(replica.address.url + "/metrics", timeout=self.config.health_timeout_s)
        except httpx.TransportError:
            return None
        if response.status_code != 200:
            return None
        families = merge_metric_texts([response.text], {})
        replica.last_cumulative = {name: {key: value for key, (value, _) in family.samples.items()}
                                   for name, family in families.items() if family.kind in CUMULATIVE_TYPES}
        return response.text

    def _router_metric_lines(self) -> list[str]:
        states = ("up", "unhealthy", "down", "dead")
        lines = ["# HELP specdec:replicas Replicas by state.", "# TYPE specdec:replicas gauge"]
        lines += [f'specdec:replicas{{state="{s}"}} {sum(r.state == s for r in self.replicas)}' for s in states]
        for name, kind, help_text, value in (
            ("replica_up", "gauge", "1 while the replica takes requests.", lambda r: int(r.state == "up")),
            ("replica_restarts_total", "counter", "New processes of the replica.", lambda r: r.restarts),
            ("replica_requests_total", "counter", "Requests the replica began to answer.", lambda r: r.routed),
            ("replica_requests_in_flight", "gauge", "Requests on the replica now.", lambda r: r.in_flight),
        ):
            family = "specdec:" + name.removesuffix("_total")
            lines += [f"# HELP {family} {help_text}", f"# TYPE {family} {kind}"]
            lines += [f'specdec:{name}{{replica="{r.index}"}} {value(r)}' for r in self.replicas]
        return lines

    async def status(self) -> dict[str, Any]:
        """app.py's /status summed over the replicas that answer, with each replica's own beside it."""
        answers = await asyncio.gather(*(self._get_json(r, "/status") for r in self.replicas))
        statuses = [answer for answer in answers if answer is not None]
        summed = {name: sum(s.get(name, 0) for s in statuses) for name in
                  ("num_requests_running", "num_requests_waiting", "kv_cache_free_slots", "kv_cache_total_slots")}
        first = statuses[0] if statuses else {}
        alive = bool(statuses) and all(s["engine_alive"] for s in statuses)
        return {"model": first.get("model"), "engine_alive": alive, **summed,
                "max_model_len": first.get("max_model_len"),
                "replicas": [{**r.report(), "status": answer} for r, answer in zip(self.replicas, answers)]}

    async def _get_json(self, replica: ReplicaState, path: str) -> dict | None:
        if replica.state not in ("up", "unhealthy"):
            return None
        try:
            response = await self.client.get(replica.address.url + path, timeout=self.config.health_timeout_s)
        except httpx.TransportError:
            return None
        return response.json() if response.status_code == 200 else None

    # ---- forwarding -------------------------------------------------------------------------------------------
    async def forward(self, request: Request) -> Response:
        """The request on the replica its key picks (another one if that one refuses the connection)."""
        body = await read_body(request, self.config.max_body_bytes) if request.method in ("POST", "PUT") else b""
        key = affinity_key(request.url.path, body, self.config.affinity_prefix_chars)
        tried: set[int] = set()
        while True:
            replica = self.choose(key, tried)
            try:
                return await self._forward_to(replica, request, body)
            except httpx.ConnectError as error:  # it never saw the request: another replica may take it
                tried.add(replica.index)
                await self.check(replica)
                logger.warning("replica %d refused a connection (%s); trying another", replica.index, error)

    async def _forward_to(self, replica: ReplicaState, request: Request, body: bytes) -> Response:
        address, gone = replica.address, replica.gone
        headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED_REQUEST_HEADERS}
        upstream_request = self.client.build_request(request.method, address.url + request.url.path,
                                                     params=request.query_params, headers=headers, content=body)
        replica.in_flight += 1
        streaming = False
        try:
            upstream = await self._wait(self.client.send(upstream_request, stream=True), gone, request)
            replica.routed += 1
            try:
                response_headers = {k: v for k, v in upstream.headers.items()
                                    if k.lower() not in DROPPED_RESPONSE_HEADERS}
                response_headers[REPLICA_HEADER] = str(replica.index)
                if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                    streaming = True
                    return RelayedStream(self._relay(replica, upstream, gone), upstream.status_code, response_headers,
                                         on_close=lambda: self._stream_closed(replica, upstream))
                content = await self._wait(upstream.aread(), gone, request)
                return Response(content, upstream.status_code, response_headers)
            finally:
                if not streaming:
                    await upstream.aclose()
        except ClientGone:
            logger.info("client disconnected while replica %d served %s", replica.index, request.url.path)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except httpx.ConnectError:
            raise
        except (httpx.TransportError, ReplicaLost) as error:
            self._spawn(self.check(replica))
            return _json_error(replica_failed_error(replica.index, error), replica.index)
        finally:
            if not streaming:
                replica.in_flight -= 1

    async def _wait(self, awaitable: Awaitable, gone: asyncio.Event, request: Request | None) -> Any:
        """The awaitable's result; ReplicaLost once the replica is marked down, ClientGone once the client left."""
        task = asyncio.ensure_future(awaitable)
        lost = asyncio.ensure_future(gone.wait())
        try:
            while True:
                done, _ = await asyncio.wait({task, lost}, timeout=0.25, return_when=asyncio.FIRST_COMPLETED)
                if task in done:
                    return task.result()
                if lost in done:
                    raise ReplicaLost("the replica was marked down")
                if request is not None and await request.is_disconnected():
                    raise ClientGone()
        finally:
            lost.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _relay(self, replica: ReplicaState, upstream: httpx.Response,
                     gone: asyncio.Event) -> AsyncIterator[bytes]:
        """The replica's stream, whole events at a time; if the replica is lost mid-stream, an error event and
        `data: [DONE]` end it (the events relayed so far are all complete)."""
        chunks = upstream.aiter_raw()
        pending = b""
        try:
            while (chunk := await self._wait(anext(chunks, None), gone, None)) is not None:
                complete, separator, pending = (pending + chunk).rpartition(b"\n\n")
                if separator:
                    yield complete + separator
            if pending:
                yield pending
        except (httpx.TransportError, ReplicaLost) as error:
            self._spawn(self.check(replica))
            yield (sse(replica_failed_error(replica.index, error).body()) + "data: [DONE]\n\n").encode()

    @staticmethod
    async def _stream_closed(replica: ReplicaState, upstream: httpx.Response) -> None:
        replica.in_flight -= 1
        with anyio.CancelScope(shield=True):  # also when the stream ended by cancellation (the client left)
            await upstream.aclose()


class RelayedStream(StreamingResponse):
    """A StreamingResponse that runs `on_close` once it is over, however it ended: Starlette may cancel a stream
    before its iterator starts (a client that left at once), and then the iterator's own cleanup would never run."""

    def __init__(self, content: AsyncIterator[bytes], status_code: int, headers: dict[str, str],
                 on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, status_code, headers)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


def replica_failed_error(index: int, error: Exception) -> APIError:
    return APIError(502, f"replica {index} failed while serving this request ({type(error).__name__}: {error}); "
                         "it is being restarted, and a retry goes to a live replica", "internal_server_error",
                    code="replica_failed")


def _json_error(error: APIError, index: int | None = None) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status_code in (502, 503) else {}
    if index is not None:
        headers[REPLICA_HEADER] = str(index)
    return JSONResponse(error.body(), status_code=error.status_code, headers={**headers, **error.headers})


def _error_of(response: httpx.Response) -> dict[str, Any]:
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return {}
    return error if isinstance(error, dict) else {}


# ---- /metrics: the replicas' Prometheus texts summed ------------------------------------------------------------
@dataclass
class MetricFamily:
    help_line: str
    kind: str  # counter, gauge, histogram, summary, untyped
    samples: dict[str, tuple[float, bool]] = field(default_factory=dict)  # 'name{labels}' -> (sum, all integers)


def merge_metric_texts(texts: list[str], retired: dict[str, dict[str, float]]) -> dict[str, MetricFamily]:
    """Families by name in first-seen order, each sample summed over the texts; then `retired` (family -> sample ->
    value) added to the cumulative families the texts have, so that their sums do not drop when a replica
    restarts with its counters at zero."""
    families: dict[str, MetricFamily] = {}
    family: MetricFamily | None = None
    for text in texts:
        for line in text.splitlines():
            if line.startswith("# HELP "):
                name = line.split(" ", 3)[2]
                family = families.setdefault(name, MetricFamily(line, "untyped"))
            elif line.startswith("# TYPE ") and family is not None:
                family.kind = line.split(" ", 3)[3].strip()
            elif line and not line.startswith("#") and family is not None:
                key, _, value_text = line.rpartition(" ")
                total, integral = family.samples.get(key, (0.0, True))
                family.samples[key] = (total + float(value_text), integral and value_text.lstrip("-").isdigit())
    for name, samples in retired.items():
        family = families.get(name)
        if family is None or family.kind not in CUMULATIVE_TYPES:
            continue
        for key, value in samples.items():
            total, integral = family.samples.get(key, (0.0, True))
            family.samples[key] = (total + value, integral and float(value).is_integer())
    return families


def render_families(families: dict[str, MetricFamily]) -> str:
    lines = []
    for name, family in families.items():
        lines += [family.help_line, f"# TYPE {name} {family.kind}"]
        for key, (value, integral) in family.samples.items():
            lines.append(f"{key} {int(value) if integral else _float_text(value)}")
    return "\n".join(lines) + "\n" if lines else ""


def _float_text(value: float) -> str:
    return "+Inf" if value == math.inf else repr(value)


# ---- the app ----------------------------------------------------------------------------------------------------
def create_router_app(router: Router, on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    """/health, /metrics, /status and /v1/specdec/info answered from all replicas; every other path forwarded.
    on_shutdown: called when the app stops, after the router (e.g. to stop the replicas)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()
            if on_shutdown is not None:
                on_shutdown()

    app = FastAPI(title="specdec router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return _json_error(error)

    @app.get("/health")
    async def health():
        status_code, body = router.health()
        return JSONResponse(body, status_code=status_code)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(await router.metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/status")
    async def status():
        return await router.status()

    @app.get("/v1/specdec/info")
    async def spec_info(request: Request):
        response = await router.forward(request)  # a replica's own answer (it checks the API key)
        if response.status_code != 200:
            return response
        info = json.loads(response.body)
        info["replicas"] = [r.report() for r in router.replicas]
        info["routing"] = {"affinity_prefix_chars": router.config.affinity_prefix_chars,
                           "load_factor": router.config.load_factor}
        return JSONResponse(info, headers={REPLICA_HEADER: response.headers[REPLICA_HEADER]})

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD", "PATCH"])
    async def forwarded(request: Request):
        return await router.forward(request)

    return app


class RouterServer(uvicorn.Server):
    """uvicorn's server, which tells the replicas when a shutdown begins (as app.py's GracefulServer tells its app):
    they refuse new requests and end running ones by their shutdown timeout; the router waits a little longer."""

    def __init__(self, config: uvicorn.Config) -> None:
        self.router: Router = config.app.state.router
        if config.timeout_graceful_shutdown is None:
            config.timeout_graceful_shutdown = self.router.config.shutdown_timeout_s + 2 * SHUTDOWN_BACKSTOP_S
        super().__init__(config)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.router.begin_shutdown()
        await super().shutdown(sockets)
