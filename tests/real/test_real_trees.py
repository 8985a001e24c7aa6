"""Gemma-3-270M with token trees: greedy output identical to plain decoding (fixed k, so that trees are drafted
whatever this machine's costs)."""
import pytest

from specdec.llm import LLM
from test_real_exactness import PROMPTS, assert_lossless, loaded_models  # noqa: F401 (fixture)


@pytest.mark.real
@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("batch", [1, 4])
def test_gemma_greedy_tree_speculation_is_lossless(loaded_models, method, batch):  # noqa: F811
    loaded = loaded_models("gemma-3-270m")
    config = {"method": method, "num_speculative_tokens": 5, "num_draft_branches": 4}
    llm = LLM(loaded=loaded, speculative_config=config, max_num_seqs=4, max_model_len=1024, draft_policy="fixed")
    assert_lossless(llm, PROMPTS[:batch], max_tokens=96)
