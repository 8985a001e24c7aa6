"""Small Spec-Bench / HumanEval files for the bench tests (the tiny checkpoint directory is in tests/conftest.py)."""
import json
from pathlib import Path

import pytest


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
