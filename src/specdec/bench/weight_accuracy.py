"""Accuracy of the weight formats against the fp32 reference, on held-out text, beside llama.cpp on the same GGUF.

    python -m specdec.bench.weight_accuracy --model qwen2.5-coder-1.5b-instruct \\
        --dataset ../shared/data/spec_bench_dev.jsonl --dataset ../shared/data/humaneval_dev.jsonl \\
        --texts 12 --max-tokens 384 [--llama-cpp] [--out bench_results/accuracy-qwen1.5b.json]

The reference is the model in fp32 (the file's weights dequantized, torch's matmul). Every format reads the same
text, teacher-forced (one forward over the whole text, every position's logits):

* ``auto``: the default: a Q4_K tensor as q4 (its blocks kept, lossless), every other tensor as q8;
* ``q8``: every tensor int8 (a Q4_K tensor requantized to int8 per row);
* ``q4-requantized``: every layer whose width allows it quantized to q4 at load from the fp32 values, as
  ``--weight-format q4`` does for fp16 / bf16 safetensors (here on top of the file's own quantization);
* ``llama.cpp`` (``--llama-cpp``, needs llama-cpp-python): llama.cpp's own kernels on the same GGUF file and
  the same token ids.

Per format: the mean KL divergence KL(reference || format) of the next-token distribution over all positions,
the top-1 agreement with the reference's argmax, and the perplexity of the text itself (the reference's too).
The texts are the held-out questions (``--held-out-of 4``, as the heads' training leaves them out), longest
first: summaries and RAG contexts are articles, HumanEval prompts are code.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdec.cache.kv_cache import KVCache
from specdec.datasets import load_questions
from specdec.models.batch import ForwardBatch
from specdec.models.catalog import resolve_model
from specdec.models.layers import TensorStorage
from specdec.models.loader import load_checkpoint
from specdec.models.transformer import Transformer

POSITION_CHUNK = 128  # positions whose log-probabilities are compared at a time (vocabularies reach 262k)


@dataclass
class FormatAccuracy:
    """Sums over positions; the means are properties."""

    name: str
    positions: int = 0
    kl_sum: float = 0.0
    top1_agree: int = 0
    nll_sum: float = 0.0  # of the text's own next tokens
    nll_positions: int = 0
    linear_bytes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / max(self.positions, 1)

    @property
    def top1(self) -> float:
        return self.top1_agree / max(self.positions, 1)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / max(self.nll_positions, 1))

    def to_dict(self) -> dict:
        return {**asdict(self), "mean_kl": self.mean_kl, "top1_agreement": self.top1, "perplexity": self.perplexity}


def held_out_texts(datasets: list[str], count: int, held_out_of: int) -> list[str]:
    """The ``count`` longest held-out first turns of the question files."""
    texts = [question.turns[0] for path in datasets for question in load_questions(path, held_out_of=held_out_of)]
    return sorted(texts, key=len, reverse=True)[:count]


def all_logits(model: Transformer, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab] fp32: every position's logits, one forward."""
    cache = KVCache(model.config, 1, len(token_ids) + 1, model.device, dtype=model.kv_cache_dtype)
    batch = ForwardBatch.build([token_ids], [0], [0], all_logits=True, device=model.device)
    return model.forward(batch, cache).float()


def accumulate(result: FormatAccuracy, reference_logits: torch.Tensor, logits: torch.Tensor,
               token_ids: list[int]) -> None:
    """Adds one text's positions: reference_logits and logits [len, vocab]."""
    next_tokens = torch.tensor(token_ids[1:], dtype=torch.long)  # [len - 1]
    for start in range(0, logits.shape[0], POSITION_CHUNK):
        end = min(start + POSITION_CHUNK, logits.shape[0])
        reference_logprobs = torch.log_softmax(reference_logits[start:end].double(), dim=-1)  # [chunk, vocab]
        logprobs = torch.log_softmax(logits[start:end].double(), dim=-1)  # [chunk, vocab]
        kl = (reference_logprobs.exp() * (reference_logprobs - logprobs)).sum(dim=-1)  # [chunk]
        result.kl_sum += float(kl.sum())
        result.top1_agree += int((reference_logprobs.argmax(-1) == logprobs.argmax(-1)).sum())
        result.positions += end - start
        scored = min(end, len(token_ids) - 1) - start  # the last position has no next token
        if scored > 0:
            nll = -logprobs[:scored].gather(1, next_tokens[start:start + scored, None]).squeeze(1)  # [scored]
            result.nll_sum += float(nll.sum())
            result.nll_positions += scored


def _llama_cpp_logits(gguf_path: Path, token_ids: list[int], threads: int, llama_cache: dict) -> torch.Tensor:
    from llama_cpp import Llama

    context = 4096
    if "model" not in llama_cache:
        llama_cache["model"] = Llama(model_path=str(gguf_path), n_ctx=context, n_batch=512, logits_all=True,
                                     n_threads=threads, verbose=False)
    llama = llama_cache["model"]
    llama.reset()
    llama.eval(token_ids)
    return torch.from_numpy(llama.scores[: len(token_ids)].copy()).float()  # [len, vocab]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="catalogue name or .gguf path")
    parser.add_argument("--dataset", action="append", default=None,
                        help="question file (repeatable; default ../shared/data/spec_bench_dev.jsonl and humaneval)")
    parser.add_argument("--held-out-of", type=int, default=4)
    parser.add_argument("--texts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=384, help="tokens of each text read (its start)")
    parser.add_argument("--formats", default="auto,q8,q4-requantized")
    parser.add_argument("--llama-cpp", action="store_true", help="also llama.cpp on the same GGUF (llama-cpp-python)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    from specdec.runtime import configure_threads

    threads = configure_threads(args.threads)
    datasets = args.dataset or ["../shared/data/spec_bench_dev.jsonl", "../shared/data/humaneval_dev.jsonl"]
    path = resolve_model(args.model)
    checkpoint = load_checkpoint(path, keep_block_bytes=True)
    tokenizer = checkpoint.tokenizer
    texts = [tokenizer.encode(text)[: args.max_tokens] for text in held_out_texts(datasets, args.texts,
                                                                                  args.held_out_of)]
    reference = Transformer(checkpoint.config, checkpoint.tensors, "fp32")
    reference_logits = [all_logits(reference, token_ids) for token_ids in texts]
    reference_result = FormatAccuracy("fp32 (reference)", linear_bytes=reference.linear_bytes())
    for token_ids, logits in zip(texts, reference_logits):
        accumulate(reference_result, logits, logits, token_ids)
    del reference
    builders = {
        "auto": lambda: Transformer(checkpoint.config, checkpoint.tensors, "auto", storage=checkpoint.storage),
        "q8": lambda: Transformer(checkpoint.config, checkpoint.tensors, "q8"),
        "q4-requantized": lambda: Transformer(checkpoint.config, checkpoint.tensors, "q4", storage=TensorStorage()),
    }
    results = [reference_result]
    for name in args.formats.split(","):
        if name not in builders:
            parser.error(f"unknown format {name!r}; choose from {', '.join(builders)}")
        model = builders[name]()
        result = FormatAccuracy(name, linear_bytes=model.linear_bytes())
        started = time.perf_counter()
        for token_ids, logits in zip(texts, reference_logits):
            accumulate(result, logits, all_logits(model, token_ids), token_ids)
        result.seconds = time.perf_counter() - started
        results.append(result)
        del model
    if args.llama_cpp:
        llama_cache: dict = {}
        result = FormatAccuracy("llama.cpp (same GGUF)")
        started = time.perf_counter()
        for token_ids, logits in zip(texts, reference_logits):
            accumulate(result, logits, _llama_cpp_logits(path, token_ids, threads, llama_cache), token_ids)
        result.seconds = time.perf_counter() - started
        results.append(result)
    positions = sum(len(token_ids) for token_ids in texts)
    print(f"{args.model}: {len(texts)} held-out texts, {positions} positions, {threads} threads", file=sys.stderr)
    print("| format | weights (MB) | mean KL vs fp32 | top-1 agreement | perplexity |")
    print("|---|---|---|---|---|")
    for result in results:
        weights = " + ".join(f"{name} {nbytes / 1e6:.0f}" for name, nbytes in sorted(result.linear_bytes.items()))
        print(f"| {result.name} | {weights or '(its own)'} | {result.mean_kl:.5f} | {result.top1:.4f} | "
              f"{result.perplexity:.3f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"model": args.model, "texts": len(texts), "positions": positions,
                                              "threads": threads, "results": [r.to_dict() for r in results]},
                                             indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
