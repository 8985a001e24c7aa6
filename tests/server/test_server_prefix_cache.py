"""A server with a prefix cache: usage reports the cached prompt tokens, /metrics counts them, outputs do not change."""
import json

import openai
import pytest

from server_helpers import MAX_MODEL_LEN, MODEL, start_server
from specdec.config import SamplingParams
from specdec.llm import LLM

FIRST = "the same long preamble, then a question: "
SECOND = FIRST + "and a different ending"


@pytest.fixture(scope="module")
def cached_server(make_tiny_model, tiny_tokenizer):
    llm = LLM(loaded=(make_tiny_model("llama"), tiny_tokenizer), max_model_len=MAX_MODEL_LEN, max_num_seqs=2,
              prefix_cache_tokens=4096, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    running = start_server(llm)
    yield running
    running.stop()


def test_usage_and_metrics_report_the_cached_prompt_tokens(cached_server, make_tiny_model, tiny_tokenizer):
    client = openai.OpenAI(base_url=cached_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    first = client.completions.create(model=MODEL, prompt=FIRST, max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=MODEL, prompt=SECOND, max_tokens=8, temperature=0)
    shared = len(tiny_tokenizer.encode(FIRST))  # byte-level: SECOND's tokens start with all of FIRST's
    assert second.usage.prompt_tokens_details.cached_tokens == shared
    plain = LLM(loaded=(make_tiny_model("llama"), tiny_tokenizer), max_model_len=MAX_MODEL_LEN)
    (expected,) = plain.generate(SECOND, SamplingParams(max_tokens=8))
    assert second.choices[0].text == expected.text
    metrics = cached_server.metrics()
    assert metrics["specdec:prefix_cache_hits_total"] == shared
    assert metrics["specdec:prefix_cache_queries_total"] == shared + len(tiny_tokenizer.encode(SECOND))


def test_load_test_levels_do_not_resend_each_others_prompts(cached_server, tmp_path):
    """Prompts continue round-robin across levels: with 6 prompts and 3 requests per level, the second level sends
    the other 3 and finds nothing of them in the cache; a third level wraps around and does, and says so."""
    from specdec.bench import load_test

    prompts = tmp_path / "prompts.jsonl"
    rows = [
        {
            "question_id": i,
            "category": "summarization",
            "turns": [f"{letter} is the first letter of this rather long prompt"],
        }
        for i, letter in enumerate("uvwxyz")
    ]
    prompts.write_text("\n".join(json.dumps(row) for row in rows))
    output = tmp_path / "report.json"
    assert load_test.main(["--url", cached_server.url, "--concurrency", "1,1,1", "--prompts", str(prompts),
                           "--max-tokens", "4", "--requests", "3", "--output", str(output)]) == 0
    levels = json.loads(output.read_text())["levels"]
    assert [level["requests"] for level in levels] == [3, 3, 3]
    assert levels[0]["cached_prompt_tokens"] == levels[1]["cached_prompt_tokens"] == 0
    assert levels[2]["cached_prompt_tokens"] > 0.8 * levels[2]["prompt_tokens"]
