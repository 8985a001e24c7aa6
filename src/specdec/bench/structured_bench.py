"""Structured output under speculation: what a JSON-schema constraint costs each drafter, and whether it stays exact.

    python -m specdec.bench.structured_bench [--drafters ngram,suffix,draft_model] [--per-category 1] \\
        [--tool-prompts 3] [--max-tokens 64] [--k 4] [--draft-policy fixed] [--limit N] \\
        [--out bench_results/structured-bench]

Prompts: the first --per-category questions of every category of the Spec-Bench file (--dataset), each followed by
"Answer with JSON only, in this form: {"title": <string, at most 60 characters>, ...}", the form sketched from a JSON
schema written for its category (CATEGORY_SCHEMAS: bounded strings and lists), then --tool-prompts tool-call
requests whose schema is a call of one of three tools: {"name": the tool, "arguments": its arguments} (TOOLS, one
anyOf branch per tool). Each is one user turn in the model's chat template. --limit N keeps at most N prompts of
each kind (a quick check).

One target (default Qwen2.5-Coder-1.5B-Instruct) is loaded once and shared. Cases: plain decoding and each drafter
(ngram, suffix, and draft_model with Qwen2.5-Coder-0.5B-Instruct), each constrained (SamplingParams.guided with the
prompt's schema) and unconstrained (the same prompt), greedy, batch 1, every case its own LLM (the suffix drafter's
memory of finished requests never holds another case's answer). Drafters draft chains of a fixed k = --k tokens at
every step (--draft-policy fixed, the default; adaptive: at most k, chosen per step), so acceptance does not depend
on the machine's speed. Every prompt goes through every case before the next prompt, the order rotating, after one
warm-up generation per case.

Per (method, constrained): tok/s (median over the prompts of output tokens / wall time, prefill and the grammar's
compilation included), speed-up (the ratio of that median to plain decoding's under the same constraint), kept
speed-up (constrained speed-up / unconstrained speed-up of the same drafter; the aim is >= 0.9), acceptance rate
(accepted / drafted), mean accepted length (1 + accepted / verify steps), grammar mask time per output token (the
allowed-token masks: one per verify row, GrammarMatcher.mask_time_s) and grammar time per output token (all of the
grammar engine's time after compilation: masks, emitted tokens consumed, drafts validated, forced tokens).

Checks: every constrained output that ended (not cut by --max-tokens) must parse as JSON and validate against its
schema (jsonschema); unconstrained outputs are checked the same way for information (a ```json fence stripped).
Greedy speculative output must equal plain output of the same constraint, prompt by prompt (where the kernel
report's bit_exact is true). An invalid constrained output or a differing output is printed, and the command exits
with 1. Writes structured_bench.json (rows, per-generation records with the texts, the CPU, the kernel report).

Run it on an otherwise idle machine (see sampling_bench: oversubscribed cores slow tok/s several-fold).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdec.bench.provenance import run_metadata
from specdec.bench.sampling_bench import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET
from specdec.config import DRAFT_POLICIES, GuidedDecoding, SamplingParams

DEFAULT_DATASET = "../shared/data/spec_bench_dev.jsonl"
DRAFTERS = ("ngram", "suffix", "draft_model")
PLAIN = "plain"
TOOL_CATEGORY = "tool_call"
EXIT_FAILED = 1
WARMUP_TEXT = ("Name three colours, and for each one say which fruit, which flower and which mood it brings to mind. "
               "Keep it short.")  # no benchmark prompt: the suffix drafter keeps finished requests
WARMUP_TOKENS = 8
VALID, INVALID, TRUNCATED = "valid", "invalid", "truncated"


def _text(max_length: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length}


def _list(items: dict[str, Any], max_items: int) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": 1, "maxItems": max_items}


def _object(**properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


_NUMBER = {"type": "number"}
# one schema per Spec-Bench category; its strings and lists bounded to about 150 characters of content (about 60
# tokens with the JSON around them at most), so that answers close within the default 64 new tokens
CATEGORY_SCHEMAS: dict[str, dict[str, Any]] = {
    "writing": _object(title=_text(40), text=_text(110)),
    "roleplay": _object(character=_text(20), reply=_text(120)),
    "reasoning": _object(steps=_list(_text(50), 2), answer=_text(40)),
    "math": _object(working=_text(100), answer=_NUMBER),
    "coding": _object(language={"enum": ["python", "javascript", "c++", "java", "other"]}, code=_text(120),
                      explanation=_text(30)),
    "extraction": _object(items=_list(_object(name=_text(15), value=_text(10)), 3)),
    "stem": _object(concept=_text(30), explanation=_text(90), related_terms=_list(_text(15), 2)),
    "humanities": _object(thesis=_text(60), points=_list(_text(45), 2)),
    "translation": _object(source_language=_text(15), translation=_text(140)),
    "summarization": _object(summary=_text(120), keywords=_list(_text(15), 2)),
    "qa": _object(answer=_text(80), confidence={"enum": ["low", "medium", "high"]}),
    "math_reasoning": _object(working=_text(120), answer=_NUMBER),
    "rag": _object(answer=_text(100), evidence=_text(60)),
}

TOOLS: dict[str, tuple[str, dict[str, Any]]] = {  # name: (what it does, its arguments' schema)
    "get_weather": ("the current weather of a city", _object(city=_text(40), unit={"enum": ["celsius",
                                                                                            "fahrenheit"]})),
    "search_web": ("a web search", _object(query=_text(80), max_results={"type": "integer", "minimum": 1,
                                                                         "maximum": 10})),
    "send_email": ("sends an email", _object(to=_text(40), subject=_text(60), body=_text(120))),
}
TOOL_REQUESTS = (
    "What is the weather in Paris right now, in celsius?",
    "Find me five recent articles about speculative decoding for language models.",
    "Email bob@example.com that the design review moves to Friday at 3 pm.",
    "Is it cold in Toronto today? Use fahrenheit.",
    "Look up who won the 2022 Fields Medal; two results are enough.",
    "Tell alice@example.com the report is ready.",
)


def tool_call_schema() -> dict[str, Any]:
    """A call of one of TOOLS: {"name": the tool, "arguments": its arguments}, one anyOf branch per tool."""
    return {"anyOf": [_object(name={"const": name}, arguments=arguments) for name, (_, arguments) in TOOLS.items()]}


def sketch(schema: dict[str, Any]) -> str:
    """A schema as a compact JSON template, for the prompt: {"title": <string, at most 60 characters>, ...}."""
    if "enum" in schema:
        return " | ".join(json.dumps(value) for value in schema["enum"])
    if "const" in schema:
        return json.dumps(schema["const"])
    kind = schema["type"]
    if kind == "object":
        return "{" + ", ".join(f"{json.dumps(name)}: {sketch(prop)}" for name, prop in schema["properties"].items()) \
            + "}"
    if kind == "array":
        return f"[{sketch(schema['items'])}, ... (at most {schema['maxItems']})]"
    if kind == "string":
        return f"<string, at most {schema['maxLength']} characters>" if "maxLength" in schema else "<string>"
    bounds = f" from {schema['minimum']} to {schema['maximum']}" if "minimum" in schema else ""
    return f"<{kind}{bounds}>"


def json_instruction(question: str, schema: dict[str, Any]) -> str:
    return f"{question}\n\nAnswer with JSON only, in this form: {sketch(schema)}"


def tool_instruction(request: str) -> str:
    tools = "\n".join(f"- {name} ({description}), arguments {sketch(arguments)}"
                      for name, (description, arguments) in TOOLS.items())
    return (f"Tools:\n{tools}\n\nCall one tool for this request, with JSON only, in the form "
            f'{{"name": <tool>, "arguments": {{...}}}}: {request}')


@dataclass(frozen=True)
class StructuredPrompt:
    key: str  # "spec_bench/81", "tool/0"
    category: str  # the Spec-Bench category, or TOOL_CATEGORY
    text: str  # the user turn
    schema: dict[str, Any]


def load_prompts(dataset: str, per_category: int, tool_prompts: int, limit: int | None = None,
                 categories: list[str] | None = None) -> list[StructuredPrompt]:
    """The Spec-Bench prompts (first per_category questions of each category, file order), then the tool prompts;
    limit keeps at most that many of each kind. A category without a schema is an error."""
    from specdec.datasets import load_questions

    questions = load_questions(dataset, categories=categories, limit=per_category)
    missing = sorted({q.category for q in questions} - set(CATEGORY_SCHEMAS))
    if missing:
        raise ValueError(f"no JSON schema for the categories {missing} of {dataset} (CATEGORY_SCHEMAS has "
                         f"{', '.join(CATEGORY_SCHEMAS)})")
    if tool_prompts > len(TOOL_REQUESTS):
        raise ValueError(f"--tool-prompts {tool_prompts}: there are {len(TOOL_REQUESTS)} tool requests")
    bench = [StructuredPrompt(f"{q.dataset}/{q.question_id}", q.category,
                              json_instruction(q.turns[0], CATEGORY_SCHEMAS[q.category]), CATEGORY_SCHEMAS[q.category])
             for q in questions]
    tools = [StructuredPrompt(f"tool/{i}", TOOL_CATEGORY, tool_instruction(request), tool_call_schema())
             for i, request in enumerate(TOOL_REQUESTS[:tool_prompts])]
    return bench[:limit] + tools[:limit] if limit is not None else bench + tools


def check_output(text: str, schema: dict[str, Any], finish_reason: str) -> tuple[str, str | None]:
    """(VALID | INVALID | TRUNCATED, the error): an output cut by max tokens is TRUNCATED (not checked); else it
    must parse as JSON (a markdown code fence around it is stripped) and validate against the schema."""
    import jsonschema

    if finish_reason == "length":
        return TRUNCATED, None
    fenced = re.search(r"```(?:json)?\s*(.*?)```", text, re.DOTALL)
    try:
        value = json.loads(fenced.group(1) if fenced else text)
    except json.JSONDecodeError as error:
        return INVALID, f"not JSON: {error}"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as error:
        return INVALID, f"schema: {error.message}"
    return VALID, None


@dataclass(frozen=True)
class Case:
    method: str  # PLAIN or a drafter
    constrained: bool

    @property
    def label(self) -> str:
        return f"{self.method}/{'constrained' if self.constrained else 'free'}"


@dataclass
class BenchSetup:
    target: str = DEFAULT_TARGET
    draft_model: str = DEFAULT_DRAFT_MODEL
    drafters: list[str] = field(default_factory=lambda: list(DRAFTERS))
    dataset: str = DEFAULT_DATASET
    per_category: int = 1
    tool_prompts: int = 3
    limit: int | None = None
    categories: list[str] | None = None
    max_tokens: int = 64
    num_speculative_tokens: int = 4
    draft_policy: str = "fixed"
    max_model_len: int = 4096


def cases(setup: BenchSetup) -> list[Case]:
    return [Case(method, constrained) for method in (PLAIN, *setup.drafters) for constrained in (True, False)]


def speculative_config(drafter: str, setup: BenchSetup) -> dict[str, Any]:
    """Chains (one branch) of num_speculative_tokens drafts; the draft model for draft_model."""
    config: dict[str, Any] = {"method": drafter, "num_speculative_tokens": setup.num_speculative_tokens,
                              "num_draft_branches": 1}
    if drafter == "draft_model":
        config["model"] = setup.draft_model
    return config


def build_llms(loaded, setup: BenchSetup) -> dict[Case, Any]:
    """One LLM per case, all sharing the loaded (target, tokenizer); batch 1."""
    from specdec.llm import LLM

    common = dict(loaded=loaded, max_num_seqs=1, max_model_len=setup.max_model_len)
    return {case: LLM(**common) if case.method == PLAIN else
            LLM(speculative_config=speculative_config(case.method, setup), draft_policy=setup.draft_policy, **common)
            for case in cases(setup)}


def params_for(case: Case, schema: dict[str, Any], max_tokens: int) -> SamplingParams:
    guided = GuidedDecoding(json_schema=schema) if case.constrained else None
    return SamplingParams(max_tokens=max_tokens, guided=guided)


def warm_up(llms: dict[Case, Any], tokenizer) -> None:
    """One short generation per LLM, on a JSON prompt like the benchmark's (kernels, buffers, the grammar engine's
    tokenizer view), excluded from the figures."""
    schema = CATEGORY_SCHEMAS["qa"]
    prompt = tokenizer.encode_chat([{"role": "user", "content": json_instruction(WARMUP_TEXT, schema)}])
    for case, llm in llms.items():
        llm.generate([prompt], params_for(case, schema, WARMUP_TOKENS))


def run_prompts(llms: dict[Case, Any], prompts: list[StructuredPrompt], tokenizer,
                max_tokens: int) -> list[dict[str, Any]]:
    """Every prompt through every case, the order rotating from prompt to prompt; one record per generation."""
    records = []
    order = list(llms)
    for index, prompt in enumerate(prompts):
        prompt_ids = tokenizer.encode_chat([{"role": "user", "content": prompt.text}])
        shift = index % len(order)
        outputs = {case: generate_once(llms[case], prompt_ids, params_for(case, prompt.schema, max_tokens))
                   for case in order[shift:] + order[:shift]}
        for case in order:
            output, wall_s, ttft_s = outputs[case]
            plain_ids = outputs[Case(PLAIN, case.constrained)][0].token_ids
            records.append(make_record(case, prompt, output, wall_s, ttft_s, plain_ids))
        print(f"[{index + 1}/{len(prompts)} {prompt.key}]", file=sys.stderr, flush=True)
    return records


def generate_once(llm, prompt_ids: list[int], params: SamplingParams) -> tuple[Any, float, float]:
    """(the output, wall time, time to the first token)."""
    first_output_at: list[float] = []
    started = time.perf_counter()
    (output,) = llm.generate([prompt_ids], params,
                             on_output=lambda _: first_output_at or first_output_at.append(time.perf_counter()))
    return output, time.perf_counter() - started, first_output_at[0] - started


def make_record(case: Case, prompt: StructuredPrompt, output, wall_s: float, ttft_s: float,
                plain_ids: tuple[int, ...]) -> dict[str, Any]:
    status, error = check_output(output.text, prompt.schema, output.finish_reason)
    metrics = output.metrics
    return {"method": case.method, "constrained": case.constrained, "prompt": prompt.key,
            "category": prompt.category, "new_tokens": len(output.token_ids), "wall_s": wall_s, "ttft_s": ttft_s,
            "drafted_tokens": metrics.drafted_tokens, "accepted_tokens": metrics.accepted_tokens,
            "verify_steps": metrics.verify_steps, "grammar_mask_time_s": output.grammar_mask_time_s,
            "grammar_masks": output.grammar_masks, "grammar_time_s": output.grammar_time_s,
            "finish_reason": output.finish_reason, "status": status, "error": error,
            "identical": tuple(output.token_ids) == tuple(plain_ids), "text": output.text}


@dataclass(frozen=True)
class Row:
    method: str
    constrained: bool
    outputs: int
    tokens: int
    tokens_per_s: float  # median over the prompts of output tokens / wall time (prefill included)
    plain_tokens_per_s: float  # the same for plain decoding under the same constraint, same run
    speedup: float  # tokens_per_s / plain_tokens_per_s
    kept_speedup: float | None  # constrained drafter rows: speedup / the unconstrained speedup of the drafter
    acceptance_rate: float | None  # accepted / drafted
    mean_accepted_length: float | None  # 1 + accepted / verify steps
    mask_us_per_token: float | None  # constrained rows: grammar mask time / output tokens
    grammar_us_per_token: float | None  # constrained rows: all grammar engine time / output tokens
    valid: int  # outputs that parse and validate against their schema
    invalid: int  # outputs that ended but do not (a bug on constrained rows)
    truncated: int  # outputs cut by max tokens (not checked)
    identical: int  # outputs equal to plain decoding's under the same constraint


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def summarize(records: list[dict[str, Any]]) -> list[Row]:
    """One row per (method, constrained), plain first, then the drafters in DRAFTERS order; constrained first."""
    groups: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((record["method"], record["constrained"]), []).append(record)
    speeds = {key: statistics.median(r["new_tokens"] / r["wall_s"] if r["wall_s"] > 0 else 0.0 for r in group)
              for key, group in groups.items()}
    rows = []
    for (method, constrained), group in groups.items():
        plain_speed = speeds[(PLAIN, constrained)]
        speedup = speeds[(method, constrained)] / plain_speed if plain_speed else 0.0
        free_speedup = _ratio(speeds.get((method, False)), speeds.get((PLAIN, False)))
        kept = _ratio(speedup, free_speedup) if constrained and method != PLAIN else None
        tokens = sum(r["new_tokens"] for r in group)
        drafted, accepted = sum(r["drafted_tokens"] for r in group), sum(r["accepted_tokens"] for r in group)
        steps = sum(r["verify_steps"] for r in group)
        mask_s, grammar_s = (sum(r[key] for r in group) for key in ("grammar_mask_time_s", "grammar_time_s"))
        statuses = [r["status"] for r in group]
        rows.append(Row(method, constrained, len(group), tokens, speeds[(method, constrained)], plain_speed, speedup,
                        kept, _ratio(accepted, drafted), 1 + accepted / steps if steps else None,
                        _ratio(1e6 * mask_s, tokens) if constrained else None,
                        _ratio(1e6 * grammar_s, tokens) if constrained else None, statuses.count(VALID),
                        statuses.count(INVALID), statuses.count(TRUNCATED), sum(r["identical"] for r in group)))
    method_order = (PLAIN, *DRAFTERS)
    return sorted(rows, key=lambda row: (method_order.index(row.method), not row.constrained))


def failures(records: list[dict[str, Any]], bit_exact: bool) -> list[str]:
    """The lines to print for each bug: a constrained output that ended and does not validate, and (with bit-exact
    kernels) a speculative output that differs from plain decoding's under the same constraint."""
    lines = []
    for r in records:
        where = f"{r['method']} {'constrained' if r['constrained'] else 'free'} {r['prompt']}"
        if r["constrained"] and r["status"] == INVALID:
            lines.append(f"INVALID constrained output ({where}): {r['error']}; text {r['text']!r}")
        if bit_exact and r["method"] != PLAIN and not r["identical"]:
            lines.append(f"NOT IDENTICAL to plain decoding ({where})")
    return lines


def _value(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(rows: list[Row]) -> str:
    lines = ["| method | constrained | tok/s | speed-up | kept speed-up | acceptance rate | mean accepted length | "
             "mask µs/token | grammar µs/token | valid / invalid / truncated | identical to plain |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row.method} | {'yes' if row.constrained else 'no'} | {row.tokens_per_s:.1f} | "
                     f"{row.speedup:.2f}x | {_value(row.kept_speedup, '.2f')} | {_value(row.acceptance_rate, '.2f')} "
                     f"| {_value(row.mean_accepted_length, '.2f')} | {_value(row.mask_us_per_token, '.0f')} | "
                     f"{_value(row.grammar_us_per_token, '.0f')} | {row.valid} / {row.invalid} / {row.truncated} | "
                     f"{row.identical}/{row.outputs} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET, help="catalogue name, .gguf path or HF directory")
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT_MODEL, help="draft_model's draft model")
    parser.add_argument("--drafters", default=",".join(DRAFTERS), help=f"comma list of {', '.join(DRAFTERS)}")
    parser.add_argument("--dataset", default=DEFAULT_DATASET, help="Spec-Bench JSONL file")
    parser.add_argument("--per-category", type=int, default=1, help="questions per Spec-Bench category")
    parser.add_argument("--categories", default=None, help="comma list of categories to keep (default: all)")
    parser.add_argument("--tool-prompts", type=int, default=3, help=f"tool-call prompts (0 to {len(TOOL_REQUESTS)})")
    parser.add_argument("--limit", type=int, default=None, help="at most N Spec-Bench and N tool prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (drafted at every step when fixed)")
    parser.add_argument("--draft-policy", default="fixed", choices=DRAFT_POLICIES)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="bench_results/structured-bench")
    return parser.parse_args(argv)


def setup_from_args(args: argparse.Namespace) -> BenchSetup:
    drafters = [name.strip() for name in args.drafters.split(",") if name.strip()]
    unknown = [name for name in drafters if name not in DRAFTERS]
    if unknown:
        raise ValueError(f"--drafters must name some of {', '.join(DRAFTERS)}, got {args.drafters!r}")
    if args.per_category < 1 or args.max_tokens < 1 or args.k < 1 or (args.limit is not None and args.limit < 1):
        raise ValueError("--per-category, --max-tokens, --k and --limit must be >= 1")
    if not 0 <= args.tool_prompts <= len(TOOL_REQUESTS):
        raise ValueError(f"--tool-prompts must be in [0, {len(TOOL_REQUESTS)}], got {args.tool_prompts}")
    categories = [name.strip() for name in args.categories.split(",")] if args.categories else None
    return BenchSetup(args.target, args.draft_model, drafters, args.dataset, args.per_category, args.tool_prompts,
                      args.limit, categories, args.max_tokens, args.k, args.draft_policy)


def run(setup: BenchSetup, loaded, threads: int, kernels: dict[str, Any],
        argv: list[str] | None = None) -> dict[str, Any]:
    """Builds the LLMs on the loaded target, runs every prompt through them; returns the results document."""
    prompts = load_prompts(setup.dataset, setup.per_category, setup.tool_prompts, setup.limit, setup.categories)
    llms = build_llms(loaded, setup)
    warm_up(llms, loaded[1])
    records = run_prompts(llms, prompts, loaded[1], setup.max_tokens)
    rows = summarize(records)
    metadata = {"setup": asdict(setup), "prompts": [prompt.key for prompt in prompts],
                **run_metadata(threads, kernels, argv)}
    return {"metadata": metadata, "rows": [asdict(row) for row in rows],
            "failures": failures(records, kernels["bit_exact"]), "records": records}


def main(argv: list[str] | None = None) -> int:
    from specdec.kernels.report import announce_kernels
    from specdec.runtime import configure_threads, load_model

    args = parse_args(argv)
    setup = setup_from_args(args)
    threads = configure_threads(args.threads)
    loaded = load_model(setup.target)
    kernels = announce_kernels("cpu", "auto", linear_bytes=loaded[0].linear_bytes()).to_dict()
    results = run(setup, loaded, threads, kernels, argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured_bench.json").write_text(json.dumps(results, indent=2))
    print(format_table([Row(**row) for row in results["rows"]]))
    print(f"[{setup.target}, {len(results['metadata']['prompts'])} prompts x {setup.max_tokens} tokens, greedy, "
          f"k = {setup.num_speculative_tokens} ({setup.draft_policy}), {threads} threads, "
          f"{results['metadata']['cpu']}, bit_exact {kernels['bit_exact']}; wrote {out / 'structured_bench.json'}]",
          file=sys.stderr)
    for line in results["failures"]:
        print(f"[{line}]", file=sys.stderr)
    return EXIT_FAILED if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
