"""The README's first command: the default model answers the demo prompt (type hints on two functions, every
other line kept),
and n-gram speculation gives exactly the plain answer (the draft length fixed, so that drafts exist whatever the
machine's costs)."""
import re
from pathlib import Path

import pytest

from specdec.config import SamplingParams
from specdec.llm import LLM
from specdec.models.catalog import DEFAULT_MODEL
from real_models import real_model_path

README = Path(__file__).resolve().parents[2] / "README.md"
DEMO_PROMPT = Path(__file__).resolve().parents[2] / "examples" / "demo_prompt.txt"

pytestmark = pytest.mark.real


def test_readme_first_command_names_the_demo_prompt_and_the_default_model():
    first_command = README.read_text().split("```bash\n", 1)[1].splitlines()[0]
    assert first_command.startswith("./scripts/setup.sh && .venv/bin/specdec generate --chat --compare-plain")
    assert "--model" not in first_command  # the default model
    assert "examples/demo_prompt.txt" in first_command
    assert '"method": "ngram"' in first_command


def test_demo_answer_is_sensible_and_speculation_is_lossless():
    real_model_path(DEFAULT_MODEL)
    prompt = DEMO_PROMPT.read_text()
    plain = LLM(model=DEFAULT_MODEL, max_num_seqs=1)
    params = SamplingParams(max_tokens=256)
    plain_output = plain.generate([prompt], params, chat=True)[0]
    speculative = LLM(loaded=(plain.model, plain.tokenizer), max_num_seqs=1, draft_policy="fixed",
                      speculative_config={"method": "ngram", "num_speculative_tokens": 16})
    speculative_output = speculative.generate([prompt], params, chat=True)[0]

    assert speculative_output.token_ids == plain_output.token_ids
    assert speculative_output.metrics.accepted_tokens > 0
    answer = plain_output.text
    assert plain_output.finish_reason == "stop"  # a complete answer within 256 tokens
    assert re.search(r"def merge_sorted\(\s*left: list\[int\], right: list\[int\]\) -> list\[int\]:", answer), answer
    assert re.search(r"def merge_sort\(\s*items: list\[int\]\) -> list\[int\]:", answer), answer
    assert "result.extend(right[j:])" in answer and "return merge_sorted(left, right)" in answer  # the body kept
