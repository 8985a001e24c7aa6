"""Access to the embedded real models in tests (CI pulls them first; a missing file fails, never skips)."""
from __future__ import annotations

import contextlib
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
