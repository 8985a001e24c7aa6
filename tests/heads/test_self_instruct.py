"""Self-instructed training questions: what the target is asked, which answers become questions, which seeds may
be imitated, and the resumable, settings-checked question directory; the warm start of a head."""
import json

import pytest
import torch

from specdec.datasets import HUMANEVAL_CATEGORY, HUMANEVAL_INSTRUCTION, Question, load_questions
from specdec.runtime import load_model
from specdec.train.self_instruct import (META_FILE, QUESTIONS_FILE, SelfInstructSpec, humaneval_stub, question_row,
                                         request_message, training_seeds, write_self_instruct_questions)

STUB = 'def add(a, b):\n    """Add a and b.\n    >>> add(1, 2)\n    3\n    """\n'
CODE_SEED = Question("humaneval", "HumanEval/0", HUMANEVAL_CATEGORY, (HUMANEVAL_INSTRUCTION.format(prompt=STUB),))
QA_SEED = Question("spec_bench", "7", "qa", ("Who wrote Hamlet, and when was it first performed?",))


def test_the_target_is_asked_for_a_question_like_the_seed():
    assert humaneval_stub(CODE_SEED) == STUB
    assert STUB in request_message(CODE_SEED) and "no implementation" in request_message(CODE_SEED)
    assert QA_SEED.turns[0] in request_message(QA_SEED) and "different subject" in request_message(QA_SEED)
    with pytest.raises(ValueError, match="not a HumanEval task"):
        humaneval_stub(QA_SEED)


def test_answers_become_rows_of_the_seeds_kind_or_are_dropped():
    fenced = "Here it is:\n```python\ndef mul(a, b):\n    \"\"\"Multiply.\"\"\"\n```\nDone."
    assert question_row(CODE_SEED, fenced, 3) == {"task_id": "self-instruct/3",
                                                  "prompt": 'def mul(a, b):\n    """Multiply."""\n'}
    assert question_row(CODE_SEED, "def sub(a, b):\n    '''Subtract b from a.'''", 4)["prompt"].startswith("def sub")
    assert question_row(CODE_SEED, "I cannot write that task for you, sorry.", 5) is None  # no def
    assert question_row(QA_SEED, "  Who painted the Mona Lisa, and where is it now?  ", 6) == {
        "question_id": "self-instruct-6",
        "category": "qa",
        "turns": ["Who painted the Mona Lisa, and where is it now?"],
    }
    assert question_row(QA_SEED, "Why?", 7) is None  # too short


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_seeds_are_the_short_training_questions(tiny_model_dir, tmp_path):
    _, tokenizer = load_model(str(tiny_model_dir))
    spec_bench_file = _write_jsonl(tmp_path / "spec_bench.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem about the sea.", "Now make it shorter."]},
        {"question_id": 82, "category": "qa", "turns": ["What is 2+2? 2+2 2+2 2+2"]},
        {"question_id": 83, "category": "qa", "turns": ["Who wrote Hamlet?"]}])
    humaneval_file = _write_jsonl(tmp_path / "humaneval.jsonl", [{"task_id": "HumanEval/0", "prompt": STUB}])
    files = [str(spec_bench_file), str(humaneval_file)]
    every = [q.question_id for path in files for q in load_questions(path)]
    assert [q.question_id for q in training_seeds(files, 0, tokenizer, 1000)] == every
    # --holdout-every 2 holds out index 1 of each file: question 82 of the Spec-Bench file
    assert [q.question_id for q in training_seeds(files, 2, tokenizer, 1000)] == ["81", "83", "HumanEval/0"]
    shortest = min(len(tokenizer.encode(q.turns[0], add_special_tokens=False)) for q in load_questions(spec_bench_file))
    kept = training_seeds([str(spec_bench_file)], 0, tokenizer, shortest)
    assert kept and all(len(tokenizer.encode(q.turns[0], add_special_tokens=False)) <= shortest for q in kept)


def _spec(**changes) -> SelfInstructSpec:
    fields = dict(target_fingerprint="t", seed_files=("a.jsonl",), holdout_every=0, count=6, temperature=1.0,
                  top_p=0.95, max_tokens=24, seed=0)
    return SelfInstructSpec(**{**fields, **changes})


def test_question_directory_resumes_after_its_last_batch_and_refuses_other_settings(tiny_model_dir, tmp_path):
    target, tokenizer = load_model(str(tiny_model_dir))
    seeds = [QA_SEED, Question("spec_bench", "8", "writing", ("Write a short poem about the sea and the wind.",))]
    whole = write_self_instruct_questions(target, tokenizer, seeds, tmp_path / "whole", _spec(), batch_size=2)
    rows = whole.read_text().splitlines()
    assert rows and json.loads((tmp_path / "whole" / META_FILE).read_text())["done"] == 6
    assert {json.loads(row)["category"] for row in rows} <= {"qa", "writing"}

    # the same run stopped after its first batch: the rerun writes only the rest, to the same file
    part = tmp_path / "part"
    write_self_instruct_questions(target, tokenizer, seeds, part, _spec(count=6), batch_size=2)
    first_batch = [row for row in rows if int(json.loads(row)["question_id"].rsplit("-", 1)[1]) < 2]
    (part / QUESTIONS_FILE).write_text("".join(row + "\n" for row in first_batch))
    meta = json.loads((part / META_FILE).read_text())
    (part / META_FILE).write_text(json.dumps({**meta, "done": 2}))
    assert write_self_instruct_questions(target, tokenizer, seeds, part, _spec(), batch_size=2).read_text() == \
        whole.read_text()
    # a question already in the file (under any id) is not written again when a resumed run produces it
    again = tmp_path / "again"
    write_self_instruct_questions(target, tokenizer, seeds, again, _spec(), batch_size=2)
    kept = [json.loads(row) for row in rows]
    renamed = [{**row, "question_id": f"earlier-{i}"} for i, row in enumerate(kept)]
    (again / QUESTIONS_FILE).write_text("".join(json.dumps(row) + "\n" for row in renamed))
    (again / META_FILE).write_text(json.dumps({**meta, "done": 2}))
    resumed = write_self_instruct_questions(target, tokenizer, seeds, again, _spec(), batch_size=2)
    assert [json.loads(row) for row in resumed.read_text().splitlines()] == renamed
    with pytest.raises(ValueError, match=r"other settings \(temperature differ\)"):
        write_self_instruct_questions(target, tokenizer, seeds, part, _spec(temperature=0.7), batch_size=2)
    with pytest.raises(ValueError, match="at least one seed"):
        write_self_instruct_questions(target, tokenizer, [], tmp_path / "none", _spec())


def test_a_warm_started_trainer_starts_from_the_given_weights(trained_heads, make_tiny_model):
    from specdec.train.trainer import Trainer, TrainSettings

    trained = trained_heads("llama", "eagle")
    state = {name: tensor.clone() for name, tensor in trained.head.state_dict().items()}
    warm = Trainer(trained.config, trained.parts, trained.sequences, TrainSettings(steps=1), initial_state=state)
    assert all(torch.equal(warm.head.state_dict()[name], tensor) for name, tensor in state.items())
    cold = Trainer(trained.config, trained.parts, trained.sequences, TrainSettings(steps=1))
    assert not all(torch.equal(cold.head.state_dict()[name], tensor) for name, tensor in state.items())
