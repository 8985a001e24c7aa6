"""Access to the embedded real models in tests (CI pulls them first; a missing file fails, never skips)."""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import pytest

from specdec.models.catalog import models_dir


def real_model_path(name: str) -> Path:
    path = models_dir() / f"{name}.gguf"
    if not path.is_file():
        pytest.fail(f"missing {path}: run `specdec pull {name}`")
    return path


@contextlib.contextmanager
def one_gguf_reader():
    """transformers parses a GGUF file's metadata more than once when it loads a model or tokenizer from one (for the
    config, then for the tensors or the tokenizer), each parse up to half a minute for Gemma's 262k-token vocabulary:
    within this block every parse of a path gets the same gguf.GGUFReader (it is only read)."""
    import gguf

    parse = gguf.GGUFReader
    readers = {}

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = parse(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = parse


@contextlib.contextmanager
def gguf_dequantize_with_torch():
    """transformers dequantizes every tensor of a GGUF file it loads with gguf-py's numpy `dequantize` (single-threaded;
    a fifth of the parity tests' time): within this block the block types specdec's loader has torch decoders for
    are decoded by those (the loader's own dispatch, `loader._dequantize_gguf_tensor`, on gguf-py's arguments), which
    give gguf-py's values bit for bit (tests/models/test_loader.py checks random blocks of every such type and one
    tensor of each type in three real files); every other type stays with gguf-py. So a model transformers loads here
    has the weights it loads anywhere, sooner."""
    import gguf

    from specdec.models import loader

    original = gguf.dequantize

    def dequantize(data, qtype):
        type_name = gguf.GGMLQuantizationType(qtype).name
        if type_name not in loader._TORCH_DEQUANTIZERS:
            return original(data, qtype)
        block_values, block_bytes, _ = loader._TORCH_DEQUANTIZERS[type_name]
        shape = (*data.shape[:-1], data.shape[-1] // block_bytes * block_values)
        with warnings.catch_warnings():  # the reader maps the file read-only; the decoders only read it
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return loader._dequantize_with_torch(data, type_name, shape).numpy()

    gguf.dequantize = dequantize
    try:
        yield
    finally:
        gguf.dequantize = original
