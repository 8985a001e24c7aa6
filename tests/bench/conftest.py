"""Tiny HF checkpoint directories and small Spec-Bench / HumanEval files for the bench tests."""
import json
from pathlib import Path

import pytest

from tiny_models import TINY_VOCAB, write_tiny_tokenizer


def write_tiny_qwen2_dir(directory: Path, num_layers: int = 2, seed: int = 0) -> Path:
    """A random-weight Qwen2 checkpoint (config.json + model.safetensors + tokenizer.json) usable by name/path."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=256, eos_token_id=257, initializer_range=0.3)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return write_tiny_tokenizer(directory)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    return write_tiny_qwen2_dir(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture
def spec_bench_file(tmp_path) -> Path:
    rows = [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem about the sea.", "Now make it shorter."]},
        {"question_id": 82, "category": "qa", "turns": ["What is 2+2? 2+2 2+2 2+2"]},
        {"question_id": 83, "category": "qa", "turns": ["Who wrote Hamlet?"]},
    ]
    return _write_jsonl(tmp_path / "spec_bench.jsonl", rows)


@pytest.fixture
def humaneval_file(tmp_path) -> Path:
    rows = [{"task_id": "HumanEval/0", "prompt": 'def add(a, b):\n    """Add a and b."""\n', "entry_point": "add",
             "canonical_solution": "    return a + b\n", "test": ""}]
    return _write_jsonl(tmp_path / "humaneval.jsonl", rows)


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
