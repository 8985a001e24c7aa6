"""Self-instructed training prompts: the target writes new questions modelled on the dev questions.

A draft head learns from the target's continuations of prompts, and the dev files hold only a few hundred
prompts; a head trained on them fits those prompts (first-draft agreement 0.69 on training batches against
0.37 on held-out ones for the Qwen2.5-Coder-1.5B head). More of the target's own text needs more prompts, and
the only other text we may train on is text the project generates itself. So the target writes them
(self-instruct): for every seed, one of the training questions (never a held-out one) whose text fits in
`max_tokens`, it is asked for one new question of the same kind, sampled with a seed per question:

- a HumanEval task (a function stub) -> a new function stub with a docstring and examples, no body, which is
  stored as a HumanEval row and so reaches the target through the same instruction as the benchmark's tasks;
- any other question -> a new request of the same kind on another subject, stored as a Spec-Bench row of the
  seed's category.

Seeds are the fitting training questions in file order, repeated as often as needed. Answers that are empty,
too short, repeated, or (for code) hold no `def`, are dropped, so a run may keep fewer questions than asked
for. The questions go to `questions.jsonl` of their directory, batch by batch, with `self-instruct.json`
saying which settings made them and how many seeds are done: an interrupted run resumes after the last
finished batch, and a directory made with other settings is refused, not mixed.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from specdec.datasets import HUMANEVAL_CATEGORY, HUMANEVAL_INSTRUCTION, Question
from specdec.config import SamplingParams

QUESTIONS_FILE = "questions.jsonl"
META_FILE = "self-instruct.json"
MIN_CHARS = 20

CODE_REQUEST = (
    "Write a new Python programming task in the same form as the example below: imports if needed, one function "
    "signature and a docstring that states the task and gives doctest examples, and no implementation. Choose a "
    "different problem. Reply with the code only.\n\nExample:\n```python\n{stub}```"
)
GENERAL_REQUEST = (
    "Here is a request that a user sent to an AI assistant:\n\n\"\"\"\n{question}\n\"\"\"\n\nWrite one new request "
    "of the same kind, style and length about a different subject. Reply with the new request only."
)
_FENCED_CODE = re.compile(r"```(?:[A-Za-z0-9_+-]*)\n(.*?)```", re.DOTALL)
_HUMANEVAL_PREFIX, _HUMANEVAL_SUFFIX = HUMANEVAL_INSTRUCTION.split("{prompt}")


@dataclass(frozen=True)
class SelfInstructSpec:
    """The settings that made a directory's questions; another spec is refused."""

    target_fingerprint: str
    seed_files: tuple[str, ...]
    holdout_every: int
    count: int  # seeds to run (questions asked for)
    temperature: float
    top_p: float
    max_tokens: int
    seed: int


def humaneval_stub(question: Question) -> str:
    """The function stub inside a HumanEval question's chat message."""
    message = question.turns[0]
    if question.category != HUMANEVAL_CATEGORY or not message.startswith(_HUMANEVAL_PREFIX):
        raise ValueError(f"question {question.question_id!r} is not a HumanEval task")
    return message[len(_HUMANEVAL_PREFIX) : len(message) - len(_HUMANEVAL_SUFFIX)]


def request_message(question: Question) -> str:
    """What the target is asked in order to write a question like `question`."""
    if question.category == HUMANEVAL_CATEGORY:
        return CODE_REQUEST.format(stub=humaneval_stub(question))
    return GENERAL_REQUEST.format(question=question.turns[0])


def question_row(seed: Question, answer: str, index: int) -> dict | None:
    """The JSONL row of the question the target wrote (HumanEval row for a code seed, else Spec-Bench row of the
    seed's category), or None for an answer that is not usable."""
    text = answer.strip()
    if seed.category == HUMANEVAL_CATEGORY:
        fenced = _FENCED_CODE.search(text)
        code = (fenced.group(1) if fenced else text).strip("\n")
        if "def " not in code or len(code) < MIN_CHARS:
            return None
        return {"task_id": f"self-instruct/{index}", "prompt": code + "\n"}
    if len(text) < MIN_CHARS:
        return None
    return {"question_id": f"self-instruct-{index}", "category": seed.category, "turns": [text]}


def training_seeds(paths: Sequence[str], holdout_every: int, tokenizer, max_tokens: int) -> list[Question]:
    """The seeds: the questions of the files that training may use (every holdout_every-th one is held out, as in
    `load_prompts`) whose first turn (the stub, for code) is at most max_tokens tokens, i.e. examples the target can
    imitate within the length it is given; in file order."""
    from specdec.datasets import is_held_out, load_questions

    def length(question: Question) -> int:
        text = humaneval_stub(question) if question.category == HUMANEVAL_CATEGORY else question.turns[0]
        return len(tokenizer.encode(text, add_special_tokens=False))

    return [question for path in paths for index, question in enumerate(load_questions(path))
            if not is_held_out(index, holdout_every) and length(question) <= max_tokens]


def write_self_instruct_questions(target, tokenizer, seeds: Sequence[Question], directory: Path, spec: SelfInstructSpec,
                                  batch_size: int = 16,
                                  progress: Callable[[int, int], None] | None = None) -> Path:
    """Runs the spec.count seeds (cycling over `seeds`) that the directory does not have yet, batch by batch, and
    returns the questions file."""
    from specdec.engine.engine import Engine

    if not seeds:
        raise ValueError("self-instruct needs at least one seed question that fits --self-instruct-max-tokens")
    directory.mkdir(parents=True, exist_ok=True)
    done = _check_or_start(directory, spec)
    questions_path = directory / QUESTIONS_FILE
    seen = {_content(row) for row in _rows(questions_path)}  # questions already kept, by content
    prompts = [tokenizer.encode_chat([{"role": "user", "content": request_message(seed)}]) for seed in seeds]
    engine = Engine(target, tokenizer, max_num_seqs=batch_size,
                    max_model_len=max(len(prompt) for prompt in prompts) + spec.max_tokens + 1)
    for start in range(done, spec.count, batch_size):
        indices = range(start, min(start + batch_size, spec.count))
        requests = []
        for index in indices:
            seed, prompt = seeds[index % len(seeds)], prompts[index % len(seeds)]
            params = SamplingParams(temperature=spec.temperature, top_p=spec.top_p, max_tokens=spec.max_tokens,
                                    seed=spec.seed * 1_000_003 + index)
            requests.append((index, seed, engine.add_request(prompt, params)))
        while engine.has_unfinished():
            engine.step()
        rows = []
        for index, seed, sequence in requests:
            row = question_row(seed, tokenizer.decode(sequence.output_token_ids, skip_special_tokens=True), index)
            if row is not None and _content(row) not in seen:
                seen.add(_content(row))
                rows.append(row)
        with questions_path.open("a", encoding="utf-8") as file:
            file.writelines(json.dumps(row) + "\n" for row in rows)
        _write_meta(directory, spec, indices.stop)
        if progress is not None:
            progress(indices.stop, spec.count)
    questions_path.touch()
    return questions_path


def _content(row: dict) -> str:
    """A question row without its id: what makes two questions the same."""
    return json.dumps({key: value for key, value in row.items() if key not in ("task_id", "question_id")},
                      sort_keys=True)


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _check_or_start(directory: Path, spec: SelfInstructSpec) -> int:
    """Seeds already done in the directory (0 for a new one); raises for a directory made with other settings."""
    meta = directory / META_FILE
    wanted = json.loads(json.dumps(asdict(spec)))
    if not meta.is_file():
        (directory / QUESTIONS_FILE).unlink(missing_ok=True)  # rows without settings are not ours to extend
        _write_meta(directory, spec, 0)
        return 0
    found = json.loads(meta.read_text())
    done = int(found.pop("done"))
    differing = sorted(key for key in wanted if found.get(key) != wanted[key])
    if differing:
        raise ValueError(f"self-instruct directory {directory} was made with other settings ({', '.join(differing)} "
                         "differ); pass another --features-dir or delete it")
    return min(done, spec.count)


def _write_meta(directory: Path, spec: SelfInstructSpec, done: int) -> None:
    payload = {**json.loads(json.dumps(asdict(spec))), "done": done}
    partial = directory / (META_FILE + ".partial")
    partial.write_text(json.dumps(payload, indent=2) + "\n")
    partial.replace(directory / META_FILE)
