"""Loading a model for inference: resolve a name or path, read the checkpoint, build the transformer."""
from __future__ import annotations

import functools
import os

import torch

from specdec.engine.tensor_parallel import TensorParallelGroup, launch
from specdec.models.catalog import resolve_model
from specdec.models.layers import check_weight_format
from specdec.models.loader import load_checkpoint
from specdec.models.parallel import TensorParallel
from specdec.models.tokenizer import Tokenizer
from specdec.models.transformer import Transformer


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def configure_threads(num_threads: int | None = None) -> int:
    """Uses every core for torch's intra-op pool unless told otherwise (SPECDEC_THREADS)."""
    threads = num_threads or int(os.environ.get("SPECDEC_THREADS", "0")) or os.cpu_count() or 1
    torch.set_num_threads(threads)
    return threads


def load_model(
    name_or_path: str, weight_format: str = "auto", device: torch.device | str = "cpu",
    parallel: TensorParallel | None = None,
) -> tuple[Transformer, Tokenizer]:
    """weight_format: auto (q4 where the file stores Q4_K, q6 where Q6_K, q8 elsewhere), q4, q4-all, q5, q8 or fp32
    (models/layers.py).
    parallel: this process's rank in a tensor-parallel group (it keeps its shard; see engine/tensor_parallel.py)."""
    check_weight_format(weight_format)
    keep_block_bytes = weight_format in ("auto", "q4", "q4-all", "q5")
    checkpoint = load_checkpoint(resolve_model(name_or_path), keep_block_bytes=keep_block_bytes)
    model = Transformer(checkpoint.config, checkpoint.tensors, weight_format=weight_format, device=device,
                        source=str(name_or_path), storage=checkpoint.storage, parallel=parallel)
    return model, checkpoint.tokenizer


def load_target(
    name_or_path: str, weight_format: str = "auto", device: torch.device | str = "cpu", tensor_parallel_size: int = 1,
) -> tuple[Transformer, Tokenizer, TensorParallelGroup | None]:
    """load_model, split over tensor_parallel_size processes when > 1: this process becomes rank 0 and holds its
    shard, the others are spawned (engine/tensor_parallel.py); the caller closes the returned group (None: one
    process)."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if tensor_parallel_size == 1:
        return (*load_model(name_or_path, weight_format, device), None)
    check_weight_format(weight_format)  # before any process starts
    build = functools.partial(load_model, name_or_path, weight_format, str(torch.device(device)))
    return launch(tensor_parallel_size, build, device)
