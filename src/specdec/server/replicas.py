"""`specdec serve MODEL --replicas N`: N engines behind one endpoint, each in a Ray actor (Ray is an optional extra).

    specdec serve process                                  Ray actor i (one per replica)
    ray.init (local) or ray.init(address=...)              ReplicaServer: pins itself to its cores, sets
    RayReplicaPool: creates the actors  ──────────────►     torch's threads, builds LLM(...) and runs app.py's
    router.py's app on --host:--port   ──── HTTP ────►     server on its own port (loopback on a local Ray)

Ray restarts an actor whose process died (max_restarts=-1): the new process loads the model again and serves on a
new port; the router (router.py) finds it through `RayReplicaPool.address`. An actor whose start raised (a bad
model path) is not restarted: at start that stops the command with the replica's error.

Cores: on a local Ray each replica is pinned (sched_setaffinity) to its own `threads` cores out of the cores this
process may use, when they suffice; on an existing cluster (`--ray-address`) Ray places the actors, each reserving
`threads` CPUs, and they are not pinned.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import uvicorn

from specdec.kernels.report import announce_kernels
from specdec.llm import LLM
from specdec.server.app import GracefulServer, ServerConfig, create_app
from specdec.server.router import (ReplicaAddress, ReplicaDead, ReplicaPool, ReplicaUnavailable, Router, RouterConfig,
                                   RouterServer, create_router_app)

logger = logging.getLogger(__name__)
RAY_EXTRA_HINT = "pip install 'specdec[ray]'"
OBJECT_STORE_BYTES = 128 * 2**20  # a local Ray's object store: only small objects (addresses) pass through it
REPLICA_START_TIMEOUT_S = 900.0  # loading a large model from a cold disk takes minutes


def require_ray() -> Any:
    """The ray module, or a RuntimeError that says how to install it."""
    try:
        import ray
    except ImportError:
        raise RuntimeError(f"--replicas runs the replicas on Ray, which is not installed: {RAY_EXTRA_HINT}") from None
    return ray


@dataclass(frozen=True)
class ReplicaSpec:
    """What one replica's process builds: `LLM(**llm_options)` served by `create_app(llm, server_config)`."""

    llm_options: dict[str, Any]
    server_config: ServerConfig
    threads: int  # torch threads
    cores: tuple[int, ...] | None  # cores to pin the process to; None: not pinned
    host: str | None  # address its server binds; None: the node's IP address (replicas on other machines)
    log_level: str = "warning"
    announce_kernels: bool = False  # print the kernel path (one replica does, as `specdec serve` does)


def core_shares(num_replicas: int, threads: int, cores: list[int]) -> list[tuple[int, ...] | None]:
    """Replica i gets cores[i*threads:(i+1)*threads]; when the cores do not suffice, no replica is pinned (the
    operating system then shares them)."""
    if num_replicas * threads > len(cores):
        return [None] * num_replicas
    return [tuple(cores[i * threads:(i + 1) * threads]) for i in range(num_replicas)]


def pin_process(cores: tuple[int, ...]) -> None:
    """Every thread of this process, and the threads it starts later, on these cores (Linux)."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


class ReplicaServer:
    """The body of the Ray actor of one replica (`ray.remote` is applied by the pool, so that Ray stays optional)."""

    def __init__(self, index: int, spec: ReplicaSpec) -> None:
        if spec.cores is not None and hasattr(os, "sched_setaffinity"):
            pin_process(spec.cores)
        torch.set_num_threads(spec.threads)
        _log_to_stderr(spec.log_level)
        llm = LLM(**spec.llm_options)
        if spec.announce_kernels:
            announce_kernels(llm.model.device, spec.llm_options.get("weight_format", "auto"),
                             linear_bytes=llm.model.linear_bytes())
        self._app = create_app(llm, spec.server_config)
        node = _node_address()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((spec.host or node, 0))
        # uvicorn's own lines at warning and above: the router logs the requests, and N start-up banners say nothing
        self._server = GracefulServer(uvicorn.Config(self._app, log_level="warning", access_log=False))
        thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="specdec-replica-http",
                                  daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"replica {index}: its HTTP server did not start")
            time.sleep(0.01)
        host, port = sock.getsockname()[:2]
        self._address = ReplicaAddress(index, f"http://{host}:{port}", os.getpid(), node, spec.threads, spec.cores)

    def address(self) -> ReplicaAddress:
        return self._address

    def begin_shutdown(self) -> None:
        self._app.state.server.begin_shutdown()


def _node_address() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _log_to_stderr(level: str) -> None:
    """specdec's log lines of this process on stderr (Ray passes them on to the driver's terminal)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    specdec_logger = logging.getLogger("specdec")
    specdec_logger.handlers = [handler]
    specdec_logger.setLevel(logging.DEBUG if level.lower() == "trace" else level.upper())


class RayReplicaPool(ReplicaPool):
    """One Ray actor per replica, restarted by Ray whenever its process dies."""

    def __init__(self, specs: list[ReplicaSpec]) -> None:
        self._ray = require_ray()
        actor_class = self._ray.remote(ReplicaServer)
        self._actors = [actor_class.options(num_cpus=spec.threads, max_restarts=-1, max_task_retries=0).remote(i, spec)
                        for i, spec in enumerate(specs)]

    def start(self, timeout_s: float = REPLICA_START_TIMEOUT_S) -> list[ReplicaAddress]:
        """Every replica's address once all serve; a RuntimeError with the cause when one fails to start."""
        exceptions = self._ray.exceptions
        addresses = []
        deadline = time.monotonic() + timeout_s
        for index, actor in enumerate(self._actors):
            try:
                addresses.append(self._ray.get(actor.address.remote(), timeout=max(1.0, deadline - time.monotonic())))
            except exceptions.RayActorError as error:
                raise RuntimeError(f"replica {index} failed to start: {_actor_error(error)}") from None
            except exceptions.GetTimeoutError:
                raise RuntimeError(f"replica {index} did not start within {timeout_s:g} s") from None
        return addresses

    async def address(self, index: int) -> ReplicaAddress:
        exceptions = self._ray.exceptions
        try:
            return await self._actors[index].address.remote()
        except exceptions.ActorUnavailableError as error:  # restarting; a later call reaches the new process
            raise ReplicaUnavailable(str(error)) from None
        except exceptions.RayActorError as error:  # died for good (its start raised, or restarts ran out)
            raise ReplicaDead(_actor_error(error)) from None

    def restart(self, index: int) -> None:
        self._ray.kill(self._actors[index], no_restart=False)

    def begin_shutdown(self) -> None:
        for actor in self._actors:
            actor.begin_shutdown.remote()  # not awaited: a replica that is down has nothing to end

    def close(self) -> None:
        for actor in self._actors:
            self._ray.kill(actor, no_restart=True)


def _actor_error(error: Exception) -> str:
    """The last line of a Ray actor error: the replica's own exception (e.g. FileNotFoundError: ...)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


@dataclass(frozen=True)
class ReplicaOptions:
    replicas: int
    threads: int | None = None  # per replica; None: the cores this process may use, divided among the replicas
    ray_address: str | None = None  # an existing cluster; None: start a local Ray
    affinity_prefix_chars: int = RouterConfig.affinity_prefix_chars

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if self.affinity_prefix_chars < 0:
            raise ValueError(f"--affinity-prefix-chars must be >= 0, got {self.affinity_prefix_chars}")


class ReplicaDeployment:
    """Ray connected, the replicas started and serving, and the router app in front of them (not yet listening)."""

    def __init__(self, options: ReplicaOptions, llm_options: dict[str, Any], server_config: ServerConfig,
                 log_level: str = "warning") -> None:
        device = llm_options.get("device")
        if device not in (None, "cpu"):
            raise ValueError(f"--replicas runs replicas on CPU cores; --device {device} is not supported with it")
        if llm_options.get("tensor_parallel_size", 1) != 1:
            raise ValueError("--replicas with --tensor-parallel-size > 1 is not supported: each replica is one "
                             "process with its share of the cores")
        self.ray = require_ray()
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
        threads = options.threads or max(1, len(cores) // options.replicas)
        local = options.ray_address is None
        self._connect(options.ray_address, options.replicas * threads)
        shares = core_shares(options.replicas, threads, cores) if local else [None] * options.replicas
        specs = [ReplicaSpec(llm_options, server_config, threads, shares[i], "127.0.0.1" if local else None,
                             log_level, announce_kernels=i == 0) for i in range(options.replicas)]
        self.pool: RayReplicaPool | None = None
        try:
            self.pool = RayReplicaPool(specs)
            addresses = self.pool.start()
        except BaseException:
            self.close()
            raise
        config = RouterConfig(affinity_prefix_chars=options.affinity_prefix_chars,
                              max_body_bytes=server_config.limits.max_body_bytes,
                              shutdown_timeout_s=server_config.shutdown_timeout_s)
        self.app = create_router_app(Router(self.pool, addresses, config), on_shutdown=self.close)
        self.threads, self.shares = threads, shares

    def _connect(self, address: str | None, num_cpus: int) -> None:
        """A local Ray (address None) or the cluster at address. Ray's driver takes SIGTERM over (its handler exits
        with status 15); the handler before it is put back, so that uvicorn's graceful shutdown handles SIGTERM
        as `specdec serve` without replicas does (the app's shutdown then closes the replicas and Ray)."""
        in_main_thread = threading.current_thread() is threading.main_thread()
        sigterm_handler = signal.getsignal(signal.SIGTERM) if in_main_thread else None
        with warnings.catch_warnings():  # Ray's notice of a future change to CUDA_VISIBLE_DEVICES (replicas use CPUs)
            warnings.simplefilter("ignore", FutureWarning)
            if address is None:
                self.ray.init(num_cpus=num_cpus, include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES)
            else:
                self.ray.init(address=address)
        if in_main_thread:
            signal.signal(signal.SIGTERM, sigterm_handler)

    def close(self) -> None:
        """Stops the replicas and disconnects from Ray (a local Ray stops with it); a second call does nothing."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.ray.is_initialized():
            self.ray.shutdown()


def add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=None,
                        help="serve N replicas of the engine behind this endpoint, each in its own process on Ray "
                             f"(needs {RAY_EXTRA_HINT}); default: one engine in this process")
    parser.add_argument("--ray-address", default=None,
                        help="with --replicas: the Ray cluster to run them on (default: start a local Ray)")
    parser.add_argument("--affinity-prefix-chars", type=int, default=RouterConfig.affinity_prefix_chars,
                        help="with --replicas: requests whose prompts (or chat messages) agree in their first this "
                             "many characters go to the same replica; 0 = the least loaded replica "
                             f"(default {RouterConfig.affinity_prefix_chars})")


def serve_replicas(args: argparse.Namespace, server_config: ServerConfig, llm_options: dict[str, Any]) -> int:
    """`specdec serve --replicas N`: starts the replicas, then serves the router until Ctrl-C or SIGTERM."""
    options = ReplicaOptions(args.replicas, args.threads, args.ray_address, args.affinity_prefix_chars)
    deployment = ReplicaDeployment(options, llm_options, server_config, args.log_level)
    try:
        pinned = ", ".join(f"{i}: cores {','.join(map(str, share))}" if share else f"{i}: not pinned"
                           for i, share in enumerate(deployment.shares))
        print(f"[{options.replicas} replica(s) of {llm_options['model']}, {deployment.threads} thread(s) each "
              f"({pinned}); serving on http://{args.host}:{args.port}]", file=sys.stderr)
        RouterServer(uvicorn.Config(deployment.app, host=args.host, port=args.port, log_level=args.log_level)).run()
    finally:
        deployment.close()
    return 0
