"""Parity with HF transformers on the real GGUF weights, fp32: logits and greedy continuations.

Bound: max |logit difference| <= 2e-3 (measured about 6e-5 on Gemma-3-270M; both sides dequantize the
same GGUF to fp32, so only the order of floating-point operations differs).
"""
import gc

import pytest
import torch

from specdec.cache.kv_cache import KVCache
from specdec.config import SamplingParams
from specdec.models.batch import ForwardBatch
from specdec.llm import LLM
from specdec.models.loader import load_checkpoint
from specdec.models.transformer import Transformer
from real_models import gguf_dequantize_with_torch, one_gguf_reader, real_model_path

LOGIT_BOUND = 2e-3
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Translate to German: The weather is lovely today, and we are going for a walk in the park.",
    "Once upon a time, in a village by the sea, there lived an old fisherman who",
]


def hf_model(path):
    from transformers import AutoModelForCausalLM

    with one_gguf_reader(), gguf_dequantize_with_torch():
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def check_parity(name: str, greedy_tokens: int = 32) -> None:
    path = real_model_path(name)
    checkpoint = load_checkpoint(path)
    ours = Transformer(checkpoint.config, checkpoint.tensors, weight_format="fp32")
    tokenizer = checkpoint.tokenizer
    del checkpoint
    reference = hf_model(path)
    llm = LLM(loaded=(ours, tokenizer), max_model_len=512, max_num_seqs=1)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        logits = ours.forward(ForwardBatch.build([ids], [0], [0], all_logits=True), KVCache(ours.config, 1, 256))
        with torch.inference_mode():
            reference_logits = reference(torch.tensor([ids])).logits[0]
            reference_ids = reference.generate(torch.tensor([ids]), max_new_tokens=greedy_tokens, do_sample=False,
                                               eos_token_id=sorted(tokenizer.eos_token_ids))[0, len(ids):].tolist()
        assert (logits - reference_logits).abs().max().item() <= LOGIT_BOUND, prompt
        ours_ids = llm.generate([ids], SamplingParams(max_tokens=greedy_tokens))[0].token_ids
        assert list(ours_ids) == reference_ids, prompt
    del reference, ours, llm
    gc.collect()


@pytest.mark.real
@pytest.mark.parametrize("name", ["gemma-3-270m", "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_fp32_logits_and_greedy_continuation_match_transformers(name):
    check_parity(name)


@pytest.mark.real
@pytest.mark.slow
def test_qwen_1_5b_matches_transformers():
    check_parity("qwen2.5-coder-1.5b-instruct", greedy_tokens=16)
