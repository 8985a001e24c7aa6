"""Benchmark questions from Spec-Bench and HumanEval JSONL files.

Spec-Bench rows: ``{"question_id": ..., "category": ..., "turns": ["first user message", "second", ...]}``.
A question with several turns is a conversation: every method answers turn 1, then gets
``[user t1, assistant <its own answer 1>, user t2]`` through the chat template, and so on.

HumanEval rows: ``{"task_id": ..., "prompt": "def f(...):\\n    \\"\\"\\"doc\\"\\"\\"\\n", ...}``; category
``humaneval``. The function stub goes into a chat user message with an instruction to complete it
(``HUMANEVAL_INSTRUCTION``), since the benchmarked models are instruct models used through their chat template.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

HUMANEVAL_CATEGORY = "humaneval"
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in a single Python code block.\n\n"
    "```python\n{prompt}```"
)


@dataclass(frozen=True)
class Question:
    """One benchmark item: a conversation of user turns (a single turn for most items)."""

    dataset: str  # file stem the question came from
    question_id: str
    category: str
    turns: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.turns or not all(isinstance(turn, str) and turn for turn in self.turns):
            raise ValueError(f"question {self.question_id!r} of {self.dataset}: turns must be non-empty strings")


def is_held_out(index: int, holdout_every: int) -> bool:
    """Whether the question at 0-based file index `index` is one that `specdec train-draft --holdout-every n`
    leaves out of its training data (every n-th question of each file)."""
    return holdout_every > 0 and index % holdout_every == holdout_every - 1


def load_questions(path: str | os.PathLike[str], categories: Iterable[str] | None = None,
                   limit: int | None = None, held_out_of: int = 0) -> list[Question]:
    """Questions of a Spec-Bench or HumanEval JSONL file, in file order.

    categories: keep only these categories (None = all). limit: keep the first ``limit`` questions of each
    category (so every category stays represented in a short run). held_out_of: n > 0 keeps only the
    questions a draft head trained with ``--holdout-every n`` never saw (`is_held_out`), before the other filters.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such dataset file: {path}")
    wanted = set(categories) if categories is not None else None
    questions: list[Question] = []
    per_category: Counter[str] = Counter()
    index = -1  # of the question in the file
    for line_number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        question = parse_row(_json_row(line, path, line_number), path, line_number)
        index += 1
        if held_out_of and not is_held_out(index, held_out_of):
            continue
        if wanted is not None and question.category not in wanted:
            continue
        if limit is not None and per_category[question.category] >= limit:
            continue
        per_category[question.category] += 1
        questions.append(question)
    return questions


def parse_row(row: dict, path: Path, line_number: int) -> Question:
    """A Spec-Bench row (has ``turns``) or a HumanEval row (has ``task_id`` and ``prompt``)."""
    where = f"{path}:{line_number}"
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
        if "category" not in row or "question_id" not in row:
            raise ValueError(f"{where}: a Spec-Bench row needs 'question_id' and 'category'")
        return Question(path.stem, str(row["question_id"]), str(row["category"]), tuple(turns))
    if "task_id" in row and "prompt" in row:
        message = HUMANEVAL_INSTRUCTION.format(prompt=row["prompt"])
        return Question(path.stem, str(row["task_id"]), HUMANEVAL_CATEGORY, (message,))
    raise ValueError(f"{where}: neither a Spec-Bench row (question_id, category, turns) "
                     f"nor a HumanEval row (task_id, prompt); keys: {sorted(row)}")


def _json_row(line: str, path: Path, line_number: int) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{line_number}: malformed JSON: {error}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{line_number}: expected a JSON object, got {type(row).__name__}")
    return row
