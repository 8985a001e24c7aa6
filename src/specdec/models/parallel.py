"""Tensor parallelism: which part of the model each rank holds, the fixed-order all-reduce, and the leader's
command channel.

A decoder layer is split over N ranks as in Megatron-LM:

* column-parallel (output rows split): ``qkv_proj`` (rank r holds its num_heads/N query heads and
  num_kv_heads/N key/value heads, so its attention and its KV cache cover those heads only) and ``gate_up_proj``
  (its slice of the intermediate dimension);
* row-parallel (input columns split): ``o_proj`` (the inputs of the same heads) and ``down_proj`` (the same
  intermediate slice). Each rank's output is a partial sum [rows, hidden]; one all-reduce after each
  row-parallel layer adds them up.

The embedding, the norms and the residual stream are replicated (every rank computes the same bits); the output
layer (lm_head) lives on rank 0 only, the leader, which runs the engine (scheduler, drafter, verifier). The other
ranks run a worker loop (engine/tensor_parallel.py) that receives every forward's inputs from the leader over
this module's command channel and runs their shard of the same forward.

Exactness. torch.distributed's all_reduce may add the ranks' partial sums in an order that depends on the message
size (gloo's ring and halving-doubling algorithms), so a row's sum could differ between a decode step and a
verify block. `TensorParallel.all_reduce` gathers every rank's partial sum instead and adds them in rank order
0, 1, ..., N-1 on every rank: elementwise fp32 additions in one fixed order, so the result is the same on every
rank and a row's result does not depend on the other rows of the call. The partial products are row invariant
because the kernels are; hence a row's logits are bitwise the same alone or in a verify block at a given N, and
greedy speculation equals plain decoding. Across different N the reduction order of a linear's inputs changes, so
N = 2 is close to N = 1, not bitwise equal (docs/tensor-parallel.md gives the measured closeness).

Splits follow the weight formats' blocks, so a rank holds exactly the same quantized weights as the unsplit
model: a row-parallel layer's input dimension is cut at multiples of 32 (q8: one fp16 scale per block of 32
inputs, and the activations are quantized per block of 32) or 256 (q4, q6: Q4_K, Q6_K super-blocks). The intermediate
dimension is cut in such units as evenly as possible; the heads' inputs of o_proj must fall on them, else
`ShardPlan` raises naming the layer.
"""
from __future__ import annotations

import dataclasses
import pickle
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from specdec.models.batch import ForwardBatch
from specdec.models.config import ModelConfig
from specdec.models.layers import TensorStorage

# inputs per unit of a row-parallel split, by the format the layer runs in
SPLIT_UNITS = {"q8": 32, "q4": 256, "q5": 32, "q6": 256, "fp32": 1}
# A worker waits for the leader's next command as long as the engine idles; a peer that dies closes its sockets,
# which fails the wait at once, so the timeout only bounds a peer that hangs.
GROUP_TIMEOUT = timedelta(days=30)
# (inputs, bytes) of one GGUF block of one row, by type: Q4_K and Q6_K super-blocks, Q5_0 blocks
STORAGE_BLOCKS = {"Q4_K": (256, 144), "Q6_K": (256, 210), "Q8_0": (32, 34), "Q5_0": (32, 22), "Q4_0": (32, 18)}


# ---- what each rank holds --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardPlan:
    """The slices of the checkpoint one rank holds: query heads [head_start, head_end), key/value heads
    [kv_head_start, kv_head_end), and per layer the intermediate columns [start, end)."""

    world_size: int
    rank: int
    head_dim: int
    head_start: int
    head_end: int
    kv_head_start: int
    kv_head_end: int
    intermediate: tuple[tuple[int, int], ...]  # per layer: [start, end) of the intermediate dimension

    @classmethod
    def build(cls, config: ModelConfig, world_size: int, rank: int, storage: TensorStorage,
              weight_format: str) -> "ShardPlan":
        """The plan for ``rank`` of ``world_size``; ValueError when the model cannot be split so."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}) of a tensor-parallel size >= 1, got rank {rank}")
        if config.num_heads % world_size or config.num_kv_heads % world_size:
            raise ValueError(
                f"tensor_parallel_size {world_size} must divide the attention heads ({config.num_heads}) and the "
                f"key/value heads ({config.num_kv_heads}) of {config.name or config.architecture}: each rank holds "
                f"whole heads")
        heads, kv_heads = config.num_heads // world_size, config.num_kv_heads // world_size
        for layer in range(config.num_layers):
            _check_split(f"layers.{layer}.o_proj", heads * config.head_dim, config.num_heads * config.head_dim,
                         world_size, storage, weight_format)
        return cls(world_size, rank, config.head_dim, rank * heads, (rank + 1) * heads, rank * kv_heads,
                   (rank + 1) * kv_heads,
                   tuple(_intermediate_range(f"layers.{layer}.down_proj", config.intermediate_size, world_size, rank,
                                             storage, weight_format) for layer in range(config.num_layers)))

    def shard_config(self, config: ModelConfig) -> ModelConfig:
        """The config of this rank's part: its heads (the KV cache and the attention kernels see only those)."""
        return dataclasses.replace(config, num_heads=self.head_end - self.head_start,
                                   num_kv_heads=self.kv_head_end - self.kv_head_start)

    def rows_of(self, name: str) -> slice | None:
        """The output rows of tensor ``name`` this rank holds (a column-parallel weight or its bias), else None."""
        layer, leaf = _layer_leaf(name)
        if layer is None:
            return None
        leaf = leaf.removesuffix(".bias")
        if leaf == "q_proj":
            return slice(self.head_start * self.head_dim, self.head_end * self.head_dim)
        if leaf in ("k_proj", "v_proj"):
            return slice(self.kv_head_start * self.head_dim, self.kv_head_end * self.head_dim)
        if leaf in ("gate_proj", "up_proj"):
            return slice(*self.intermediate[layer])
        return None

    def columns_of(self, name: str) -> slice | None:
        """The input columns of tensor ``name`` this rank holds (a row-parallel weight), else None."""
        layer, leaf = _layer_leaf(name)
        if leaf == "o_proj":
            return slice(self.head_start * self.head_dim, self.head_end * self.head_dim)
        if leaf == "down_proj":
            return slice(*self.intermediate[layer])
        return None

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name`` (the whole tensor for replicated ones)."""
        rows, columns = self.rows_of(name), self.columns_of(name)
        if rows is not None:
            return tensor[rows]
        if columns is not None:
            return tensor[:, columns]
        return tensor

    def shard_block_bytes(self, name: str, raw: torch.Tensor, storage_type: str) -> torch.Tensor:
        """This rank's part of a block-quantized tensor's raw bytes (STORAGE_BLOCKS) [out, in/block_inputs *
        block_bytes]: whole blocks of its rows or columns (the columns fall on blocks: `build` checked it)."""
        rows, columns = self.rows_of(name), self.columns_of(name)
        if rows is not None:
            return raw[rows]
        if columns is not None:
            block_inputs, block_bytes = STORAGE_BLOCKS[storage_type]
            first, last = columns.start // block_inputs, columns.stop // block_inputs
            return raw[:, first * block_bytes : last * block_bytes]
        return raw

    def storage(self, storage: TensorStorage) -> TensorStorage:
        """The checkpoint's storage record with this rank's part of its block-quantized tensors' bytes."""
        shard = lambda name, raw: self.shard_block_bytes(name, raw, storage.types[name])  # noqa: E731
        return TensorStorage(types=storage.types,
                             block_bytes=_ShardedMapping(storage.block_bytes, shard))  # type: ignore

    def tensors(self, tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The checkpoint's tensors as this rank holds them, sliced when read (a lazy GGUF mapping stays lazy)."""
        return _ShardedMapping(tensors, self.shard)


def _layer_leaf(name: str) -> tuple[int | None, str]:
    """"layers.3.q_proj.bias" -> (3, "q_proj.bias"); names outside the layers -> (None, name)."""
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit():
        return int(parts[1]), parts[2]
    return None, name


def _layer_format(name: str, in_features: int, storage: TensorStorage, weight_format: str) -> str:
    return storage.linear_format([name], in_features, weight_format)


def _check_split(name: str, shard_inputs: int, in_features: int, world_size: int, storage: TensorStorage,
                 weight_format: str, aligned: bool = False) -> None:
    """A row-parallel layer's cut between ranks must fall on its format's blocks (so that each rank holds the same
    quantized weights and quantizes the same activation blocks as unsplit), and its shard must run in the format
    the whole layer does. aligned: the cuts fall on blocks by construction."""
    layer_format = _layer_format(name, in_features, storage, weight_format)
    unit = SPLIT_UNITS[layer_format]
    if not aligned and shard_inputs % unit:
        raise ValueError(
            f"tensor_parallel_size {world_size} gives each rank {shard_inputs} of the {in_features} inputs of "
            f"{name}, not a multiple of {unit} ({layer_format} splits at blocks of {unit} inputs); choose another "
            f"tensor_parallel_size" + (" or weight_format='q8'" if layer_format in ("q4", "q6") else ""))
    shard_format = _layer_format(name, shard_inputs, storage, weight_format)
    if shard_format != layer_format:
        raise ValueError(f"{name}: a shard of {shard_inputs} of its {in_features} inputs would run as {shard_format}, "
                         f"the whole layer as {layer_format}; choose another tensor_parallel_size or weight_format")


def _intermediate_range(name: str, intermediate_size: int, world_size: int, rank: int, storage: TensorStorage,
                        weight_format: str) -> tuple[int, int]:
    """[start, end) of the intermediate dimension on ``rank``: cut at whole blocks of down_proj's format; when the
    blocks do not divide evenly the later ranks get one more (rank 0 also runs the output layer and the engine)."""
    unit = SPLIT_UNITS[_layer_format(name, intermediate_size, storage, weight_format)]
    units = -(-intermediate_size // unit)
    if units < world_size:
        raise ValueError(f"{name} has {intermediate_size} inputs, {units} blocks of {unit}: too few for "
                         f"tensor_parallel_size {world_size}")
    bounds = [min(intermediate_size, unit * (units * r // world_size)) for r in range(world_size + 1)]
    start, end = bounds[rank], bounds[rank + 1]
    _check_split(name, end - start, intermediate_size, world_size, storage, weight_format, aligned=True)
    return start, end


class _ShardedMapping(Mapping):
    """A read-only view of a name -> tensor mapping whose values pass through shard(name, tensor) when read."""

    def __init__(self, full: Mapping[str, torch.Tensor], shard) -> None:
        self._full = full
        self._shard = shard

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._shard(name, self._full[name])

    def __contains__(self, name: object) -> bool:
        return name in self._full

    def __iter__(self) -> Iterator[str]:
        return iter(self._full)

    def __len__(self) -> int:
        return len(self._full)


# ---- communication -----------------------------------------------------------------------------------------------
@dataclass
class CommStats:
    """Communication counted by one rank (benchmarks read and reset it): the all-reduces after the row-parallel
    layers and, on the leader, the commands it broadcast."""

    all_reduces: int = 0
    all_reduce_s: float = 0.0  # includes waiting for the slowest rank to reach the all-reduce
    all_reduce_bytes: int = 0  # bytes of the partial sums this rank contributed
    commands: int = 0
    command_s: float = 0.0
    forwards: int = 0  # of the commands, forwards (TrunkCommand)

    def reset(self) -> None:
        self.all_reduces, self.all_reduce_s, self.all_reduce_bytes = 0, 0.0, 0
        self.commands, self.command_s, self.forwards = 0, 0.0, 0


@dataclass(frozen=True)
class CacheSpec:
    """A KV cache the leader made: the workers make theirs (their heads) under the same key."""

    key: int
    num_slots: int
    max_len: int
    dtype: torch.dtype


@dataclass(frozen=True)
class Envelope:
    """One command from the leader, with the cache it applies to (None: no cache) and the cache bookkeeping."""

    command: object
    cache_key: int | None
    new_cache: CacheSpec | None  # the leader's cache is new to the workers: make it first
    dropped_caches: tuple[int, ...]  # keys of caches the leader has released: free them


@dataclass(frozen=True)
class TrunkCommand:
    """Run the decoder layers over this batch (Transformer.forward_shard)."""

    batch: ForwardBatch
    out_rows: torch.Tensor | None  # [n] int64, see Transformer._trunk


@dataclass
class _CacheRegistry:
    """The leader's keys for the caches it has run forwards with (weak: a cache the leader drops is freed on the
    workers with the next command)."""

    entries: dict[int, tuple[int, weakref.ref]] = field(default_factory=dict)  # id(cache) -> (key, ref)
    next_key: int = 0

    def key(self, cache) -> tuple[int, CacheSpec | None]:
        entry = self.entries.get(id(cache))
        if entry is not None and entry[1]() is cache:
            return entry[0], None
        key, self.next_key = self.next_key, self.next_key + 1
        self.entries[id(cache)] = (key, weakref.ref(cache))
        return key, CacheSpec(key, cache.num_slots, cache.max_len, cache.dtype)

    def dropped(self) -> tuple[int, ...]:
        dead = [cache_id for cache_id, (_, ref) in self.entries.items() if ref() is None]
        return tuple(self.entries.pop(cache_id)[0] for cache_id in dead)


class TensorParallel:
    """This process's place in a tensor-parallel group: rank, world size and the process group, the fixed-order
    all-reduce, and the leader's (rank 0's) command channel to the workers."""

    def __init__(self, world_size: int, rank: int, process_group=None, device: torch.device | str = "cpu",
                 store=None) -> None:
        """process_group: a torch.distributed backend (ProcessGroupGloo, ProcessGroupNCCL) of world_size ranks;
        None only for world_size 1. store: the rendezvous store it was made with (kept alive with it)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}) of a tensor-parallel size >= 1, got rank {rank}")
        if world_size > 1 and process_group is None:
            raise ValueError(f"a tensor-parallel size of {world_size} needs a process group")
        self.world_size = world_size
        self.rank = rank
        self.device = torch.device(device)
        self.comm = CommStats()
        self._group = process_group
        self._store = store
        self._caches = _CacheRegistry()

    @classmethod
    def connect(cls, world_size: int, rank: int, port: int, device: torch.device | str = "cpu",
                host: str = "127.0.0.1", timeout: timedelta = GROUP_TIMEOUT) -> "TensorParallel":
        """Joins the group whose rank 0 listens on host:port (tcp rendezvous): gloo on CPU, NCCL on CUDA. The
        process group is this object's own, not torch.distributed's default group: a process may hold several."""
        import torch.distributed as dist

        device = torch.device(device)
        store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
        if device.type == "cuda":
            group = dist.ProcessGroupNCCL(store, rank, world_size)
        else:
            group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        return cls(world_size, rank, group, device, store)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """partial [rows, hidden] fp32 (this rank's partial sum) -> the sum over the ranks, added in rank order
        0, 1, ..., N-1: the same bits on every rank, and a row's sum independent of the other rows."""
        if self.world_size == 1 or partial.numel() == 0:  # every rank takes the same branch: same shapes
            return partial
        start = time.perf_counter()
        partial = partial.contiguous()
        gathered = [torch.empty_like(partial) for _ in range(self.world_size)]  # each [rows, hidden]
        self._group.allgather([gathered], [partial]).wait()
        total = gathered[0]
        for part in gathered[1:]:
            total = total + part
        self.comm.all_reduces += 1
        self.comm.all_reduce_s += time.perf_counter() - start
        self.comm.all_reduce_bytes += partial.numel() * partial.element_size()
        return total

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank reports ok (each rank calls it once at the same point: after building its shard)."""
        if self.world_size == 1:
            return ok
        flags = [torch.zeros(1, dtype=torch.int32, device=self.device) for _ in range(self.world_size)]
        self._group.allgather([flags], [torch.tensor([int(ok)], dtype=torch.int32, device=self.device)]).wait()
        return all(int(flag) == 1 for flag in flags)

    # ---- the leader's command channel ----
    def send(self, command: object, cache=None) -> None:
        """Leader only: broadcasts a command for the workers to run (with the cache it applies to)."""
        if not self.is_leader:
            raise RuntimeError(f"rank {self.rank} is a worker: only rank 0 sends commands")
        start = time.perf_counter()
        key, new_cache = (None, None) if cache is None else self._caches.key(cache)
        data = pickle.dumps(Envelope(command, key, new_cache, self._caches.dropped()), pickle.HIGHEST_PROTOCOL)
        self._broadcast(torch.tensor([len(data)], dtype=torch.int64))
        self._broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.comm.commands += 1
        self.comm.forwards += isinstance(command, TrunkCommand)
        self.comm.command_s += time.perf_counter() - start

    def receive(self) -> Envelope:
        """Workers: waits for the leader's next command."""
        size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size)
        payload = torch.empty(int(size), dtype=torch.uint8)
        self._broadcast(payload)
        return pickle.loads(payload.numpy().tobytes())

    def _broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's tensor into every rank's (in place; through the device on NCCL)."""
        if self.device.type == "cpu":
            self._group.broadcast(tensor, 0).wait()
            return
        on_device = tensor.to(self.device)
        self._group.broadcast(on_device, 0).wait()
        tensor.copy_(on_device.cpu())
