"""Tensor-parallel processes: the launcher, the workers' loop, and the leader's caches that mirror their
operations on the workers.

Rank 0 (the leader) is the calling process: it runs the engine (scheduler, drafter, verifier) over its own shard of
the target. Ranks 1 .. N-1 are processes it spawns (torch.multiprocessing, "spawn"); they join a gloo group (NCCL
on CUDA) through a tcp rendezvous on 127.0.0.1:<free port>, build their shard of the same model and then run
`serve_shard`: every command the leader broadcasts (models/parallel.py) is run on their shard, against their copy
of the cache it names:

* a forward (the leader's Transformer sends it from `_trunk`, so every forward of the target is mirrored,
  whoever calls it: the engine, the cost profiler);
* the engine's cache operations that move keys/values outside a forward: tree-path compaction (`MirroredKVCache`)
  and the prefix cache's reuse / keep (`MirroredPrefixCache`; its store keeps each rank's heads and makes the same
  decisions on every rank because it sees the same calls).

The drafter runs on the leader only, unsharded (a draft model is a separate single-process Transformer).
"""
from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import traceback
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specdec.cache.kv_cache import KVCache
from specdec.cache.prefix_store import PrefixCache
from specdec.models.parallel import Envelope, TensorParallel, TrunkCommand
from specdec.models.tokenizer import Tokenizer
from specdec.models.transformer import Transformer

JOIN_TIMEOUT_S = 30.0  # seconds a worker gets to leave after the stop command before it is terminated


# ---- commands besides the forward --------------------------------------------------------------------------------
@dataclass(frozen=True)
class CompactCommand:
    """KVCache.compact on the workers' copy of the cache."""

    slot: int
    src_positions: list[int]
    dst_positions: list[int]


@dataclass(frozen=True)
class PrefixCommand:
    """A call of the leader's PrefixCache (method "reuse" or "keep") on the workers' prefix cache of the same KV
    cache, made with the same limits when first used."""

    method: str
    slot: int
    token_ids: tuple[int, ...]
    max_tokens: int
    min_match: int


@dataclass(frozen=True)
class StopCommand:
    """The workers leave their loop."""


# ---- the leader's mirrored caches -----------------------------------------------------------------------------------
class MirroredKVCache(KVCache):
    """The leader's KV cache (its heads); compaction is sent to the workers' copies before it runs here."""

    def __init__(self, model: Transformer, num_slots: int, max_len: int, dtype: torch.dtype) -> None:
        super().__init__(model.shard_config, num_slots, max_len, model.device, dtype=dtype)
        self.parallel = model.parallel

    def compact(self, slot: int, src_positions: list[int], dst_positions: list[int]) -> None:
        self.parallel.send(CompactCommand(slot, list(src_positions), list(dst_positions)), self)
        super().compact(slot, src_positions, dst_positions)


class MirroredPrefixCache(PrefixCache):
    """The leader's prefix cache: each lookup and save is sent to the workers (whose stores hold their heads)
    before it runs here; the stores see the same calls, so they keep and drop the same entries."""

    def __init__(self, parallel: TensorParallel, max_tokens: int, min_match: int = 16) -> None:
        super().__init__(max_tokens, min_match)
        self.parallel = parallel

    def _mirror(self, method: str, cache: KVCache, slot: int, token_ids: Sequence[int]) -> None:
        self.parallel.send(PrefixCommand(method, slot, tuple(token_ids), self.store.max_tokens,
                                         self.store.min_match), cache)

    def reuse(self, cache: KVCache, slot: int, token_ids: Sequence[int]) -> int:
        self._mirror("reuse", cache, slot, token_ids)
        return super().reuse(cache, slot, token_ids)

    def keep(self, cache: KVCache, slot: int, token_ids: Sequence[int]) -> None:
        self._mirror("keep", cache, slot, token_ids)
        super().keep(cache, slot, token_ids)

    def match_length(self, token_ids: Sequence[int]) -> int:
        raise NotImplementedError("match_length moves the store's entries without a KV cache to name; "
                                  "under tensor parallelism the engine uses reuse and keep only")


def mirrored_caches(model: Transformer, num_slots: int, max_len: int, dtype: torch.dtype,
                    prefix_cache_tokens: int) -> tuple[MirroredKVCache, MirroredPrefixCache | None]:
    """The leader's engine caches: its KV cache (its heads) and prefix cache (None: off), mirrored on the workers."""
    if model.parallel is None or not model.parallel.is_leader:
        raise ValueError("mirrored caches belong to the leader (rank 0) of a tensor-parallel group")
    cache = MirroredKVCache(model, num_slots, max_len, dtype)
    return cache, MirroredPrefixCache(model.parallel, prefix_cache_tokens) if prefix_cache_tokens else None


# ---- the workers ---------------------------------------------------------------------------------------------------
@dataclass
class _WorkerCaches:
    """A worker's copies of the leader's caches, by the leader's keys."""

    model: Transformer
    kv: dict[int, KVCache]
    prefix: dict[int, PrefixCache]

    def apply(self, envelope: Envelope) -> None:
        for key in envelope.dropped_caches:
            self.kv.pop(key, None)
            self.prefix.pop(key, None)
        spec = envelope.new_cache
        if spec is not None:
            self.kv[spec.key] = KVCache(self.model.shard_config, spec.num_slots, spec.max_len, self.model.device,
                                        dtype=spec.dtype)

    def prefix_cache(self, key: int, command: PrefixCommand) -> PrefixCache:
        if key not in self.prefix:
            self.prefix[key] = PrefixCache(command.max_tokens, command.min_match)
        return self.prefix[key]


def serve_shard(model: Transformer) -> None:
    """A worker's loop: runs each command of the leader on this rank's shard until the stop command."""
    caches = _WorkerCaches(model, {}, {})
    while True:
        try:
            envelope = model.parallel.receive()
        except RuntimeError:  # the leader closed its connections (it exited without the stop command)
            return
        caches.apply(envelope)
        command = envelope.command
        if isinstance(command, StopCommand):
            return
        cache = caches.kv[envelope.cache_key]
        if isinstance(command, TrunkCommand):
            model.forward_shard(command, cache)
        elif isinstance(command, CompactCommand):
            cache.compact(command.slot, command.src_positions, command.dst_positions)
        elif isinstance(command, PrefixCommand):
            prefix = caches.prefix_cache(envelope.cache_key, command)
            if command.method == "reuse":
                prefix.reuse(cache, command.slot, command.token_ids)
            else:
                prefix.keep(cache, command.slot, command.token_ids)
        else:
            raise TypeError(f"unknown tensor-parallel command {type(command).__name__}")


BuildModel = Callable[[TensorParallel], tuple[Transformer, Tokenizer | None]]


def _worker_main(rank: int, world_size: int, port: int, build_model: BuildModel, device: str, threads: int) -> None:
    """A spawned rank: joins the group, builds its shard, tells every rank whether that worked, then serves."""
    # Ctrl-C reaches the whole process group: the leader decides how to shut down and sends the stop command (or
    # closes its connections by exiting)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    parallel = TensorParallel.connect(world_size, rank, port, device)
    try:
        model, _ = build_model(parallel)
    except Exception:
        traceback.print_exc(file=sys.stderr)
        parallel.all_ok(False)
        raise SystemExit(1) from None
    if parallel.all_ok(True):
        serve_shard(model)
    # Nothing of a worker outlives it but its output: leave without the interpreter's teardown (seconds of
    # destructors for the model and the process group).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---- the launcher ---------------------------------------------------------------------------------------------------
class TensorParallelGroup:
    """The leader's handle on its worker processes; `close` stops them (called at the leader's exit if not before;
    the workers are daemon processes besides)."""

    def __init__(self, parallel: TensorParallel, processes: list, restore_threads: int) -> None:
        self.parallel = parallel
        self.processes = processes
        self._restore_threads = restore_threads
        self.closed = False
        atexit.register(self.close)

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    def close(self) -> None:
        """Stops the workers and restores the leader's torch thread count."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        if all(process.is_alive() for process in self.processes):
            self.parallel.send(StopCommand())
        for process in self.processes:
            process.join(JOIN_TIMEOUT_S)
            if process.is_alive():
                process.terminate()
        torch.set_num_threads(self._restore_threads)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def default_threads(world_size: int) -> int:
    """Torch threads per rank: this machine's cores shared evenly (at least 1)."""
    return max(1, (os.cpu_count() or 1) // world_size)


def launch(world_size: int, build_model: BuildModel, device: torch.device | str = "cpu",
           threads: int | None = None) -> tuple[Transformer, Tokenizer | None, TensorParallelGroup]:
    """Starts ranks 1 .. world_size-1 and makes this process rank 0; every rank calls build_model(parallel) (a
    picklable callable: the workers run it too) and keeps its shard. Returns the leader's model and tokenizer and
    the group's handle. threads: torch threads per rank (default: cores / world_size; set in this process too).

    Raises RuntimeError when a rank fails to build its shard (its error is printed by its process)."""
    if world_size < 2:
        raise ValueError(f"launch needs a tensor-parallel size >= 2, got {world_size}")
    threads = threads or default_threads(world_size)
    device = str(torch.device(device))
    port = free_port()
    context = torch.multiprocessing.get_context("spawn")
    processes = [context.Process(target=_worker_main, args=(rank, world_size, port, build_model, device, threads),
                                 daemon=True, name=f"specdec-tp-rank{rank}") for rank in range(1, world_size)]
    for process in processes:
        process.start()
    restore_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    parallel = TensorParallel.connect(world_size, 0, port, device)
    try:
        model, tokenizer = build_model(parallel)
    except Exception:
        parallel.all_ok(False)
        _reap(processes, restore_threads)
        raise
    if not parallel.all_ok(True):
        _reap(processes, restore_threads)
        raise RuntimeError(f"a worker of the tensor-parallel group (size {world_size}) failed to build its shard; "
                           "its error is printed above")
    return model, tokenizer, TensorParallelGroup(parallel, processes, restore_threads)


def _reap(processes: list, restore_threads: int) -> None:
    for process in processes:
        process.join(JOIN_TIMEOUT_S)
        if process.is_alive():
            process.terminate()
    torch.set_num_threads(restore_threads)
