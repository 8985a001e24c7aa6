"""In-process servers, one per test run, on tiny models (ngram drafter, draft-model drafter)."""
import pytest

from server_helpers import MAX_MODEL_LEN, ngram_tiny_server, start_server, tiny_llm
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.engine.engine import Engine


@pytest.fixture(scope="session")
def ngram_server(make_tiny_model, tiny_tokenizer):
    with ngram_tiny_server(make_tiny_model, tiny_tokenizer) as running:
        yield running


@pytest.fixture(scope="session")
def draft_server(make_tiny_model, tiny_tokenizer):
    """A draft_model drafter (tiny model, other seed): LLM builds the engine, we swap in one with the drafter."""
    llm = tiny_llm(make_tiny_model, tiny_tokenizer)
    drafter = DraftModelDrafter(make_tiny_model("llama", seed=1), max_num_seqs=4, max_model_len=MAX_MODEL_LEN)
    llm.engine = Engine(llm.model, tiny_tokenizer, max_num_seqs=4, max_model_len=MAX_MODEL_LEN, drafter=drafter,
                        num_speculative_tokens=3)
    running = start_server(llm)
    yield running
    running.stop()
