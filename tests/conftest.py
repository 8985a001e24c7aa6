from pathlib import Path

import pytest
import torch

from specdec.models.tokenizer import Tokenizer
from specdec.models.transformer import Transformer
from tiny_models import tiny_config, tiny_tensors, write_tiny_qwen2_dir, write_tiny_tokenizer

ARCHITECTURES = ("llama", "qwen2", "gemma3")


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_hf_dir(write_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer")))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random-weight Qwen2 HF checkpoint directory, loadable by path like any model."""
    pytest.importorskip("transformers")
    return write_tiny_qwen2_dir(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def make_tiny_model():
    """make_tiny_model(architecture, seed=0, weight_format="q8", **config overrides) -> Transformer (cached)."""
    built = {}

    def make(architecture: str, seed: int = 0, weight_format: str = "q8", **overrides) -> Transformer:
        key = (architecture, seed, weight_format, tuple(sorted(overrides.items())))
        if key not in built:
            config = tiny_config(architecture, **overrides)
            built[key] = Transformer(config, tiny_tensors(config, seed), weight_format=weight_format)
        return built[key]

    return make


@pytest.fixture(autouse=True)
def _two_threads():
    torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _quiet_machine_for_cost_profiles(monkeypatch):
    """Cost profiles are saved only when no other process kept the CPU busy (profile_store.ForeignLoad); the tests
    that save one must not depend on what else runs on the machine, so they see a machine without /proc/stat.
    tests/engine/test_cost_model.py drives ForeignLoad with synthetic readings."""
    from specdec.engine.draft_length import profile_store

    monkeypatch.setattr(profile_store, "_machine_busy_s", lambda: None)
