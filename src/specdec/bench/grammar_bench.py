"""Grammar engines' per-token mask cost on a real vocabulary, for choosing the one constrained decoding uses.

    python -m specdec.bench.grammar_bench [--model qwen2.5-coder-0.5b-instruct] [--repeats 5] \\
        [--xgrammar-path /path/with/xgrammar] [--out bench_results/grammar-bench.json]

Walks a JSON document that matches a schema token by token (the tokenizer's own encoding of it) and times, per
token, the allowed-token mask of the current state plus consuming the token: llguidance (`LLMatcher`, what
verify/grammar.py uses, mask as a bool tensor the way the engine builds it) and, when it imports, xgrammar
(`GrammarMatcher.fill_next_token_bitmask`). Compilation (the grammar and the tokenizer's tables) is timed
separately. Reports mean and p99 microseconds per token for each engine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "year": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "rating": {"type": "number"},
        "in_print": {"type": "boolean"},
        "author": {"type": "object", "properties": {"first": {"type": "string"}, "last": {"type": "string"}},
                   "required": ["first", "last"]},
    },
    "required": ["name", "year", "tags", "rating", "in_print", "author"],
}
DOCUMENT = {"name": "The Structure and Interpretation of Computer Programs", "year": 1985,
            "tags": ["lisp", "scheme", "computer science", "textbook"], "rating": 4.7, "in_print": True,
            "author": {"first": "Harold", "last": "Abelson"}}


def _summary(times_s: list[float]) -> dict[str, float]:
    ordered = sorted(times_s)
    return {"mean_us": 1e6 * sum(ordered) / len(ordered), "p99_us": 1e6 * ordered[int(0.99 * (len(ordered) - 1))],
            "tokens": len(ordered)}


def bench_llguidance(tokenizer, vocab_size: int, token_ids: list[int], repeats: int) -> dict:
    from specdec.config import GuidedDecoding
    from specdec.verify.grammar import GrammarMatcher

    guided = GuidedDecoding(json_schema=SCHEMA)
    start = time.perf_counter()
    GrammarMatcher(guided, tokenizer, vocab_size, tokenizer.eos_token_ids)  # builds the tokenizer tables once
    setup_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matcher = GrammarMatcher(guided, tokenizer, vocab_size, tokenizer.eos_token_ids)
        compile_s = time.perf_counter() - start
        for token_id in token_ids:
            start = time.perf_counter()
            mask = matcher.allowed()
            assert mask[token_id], token_id
            matcher.advance(token_id)
            times.append(time.perf_counter() - start)
    return {"engine": "llguidance", "tokenizer_setup_s": setup_s, "grammar_compile_s": compile_s, **_summary(times)}


def bench_xgrammar(tokenizer, vocab_size: int, token_ids: list[int], repeats: int) -> dict:
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    start = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                   stop_token_ids=sorted(tokenizer.eos_token_ids))
    compiler = xgrammar.GrammarCompiler(info)
    setup_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
        compile_s = time.perf_counter() - start
        matcher = xgrammar.GrammarMatcher(compiled)
        bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        for token_id in token_ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            assert matcher.accept_token(token_id), token_id
            times.append(time.perf_counter() - start)
    return {"engine": "xgrammar", "tokenizer_setup_s": setup_s,
            "grammar_compile_s": compile_s, **_summary(times)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(Path.home() / ".cache/specdec/models/qwen2.5-coder-0.5b-instruct.gguf"),
                        help="a GGUF file or HF directory whose tokenizer to use")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--xgrammar-path", help="a directory to import xgrammar from (it is not a dependency)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from specdec.models.loader import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    vocab_size = tokenizer.backend.get_vocab_size(with_added_tokens=True)
    token_ids = tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    rows = [bench_llguidance(tokenizer, vocab_size, token_ids, args.repeats)]
    if args.xgrammar_path:
        sys.path.insert(0, args.xgrammar_path)
    try:
        rows.append(bench_xgrammar(tokenizer, vocab_size, token_ids, args.repeats))
    except ImportError as error:
        rows.append({"engine": "xgrammar", "error": f"not importable: {error}"})
    report = {"model": args.model, "vocab_size": vocab_size, "document_tokens": len(token_ids), "rows": rows}
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
