"""Seeded sampling with speculation: exact acceptance against rejection sampling, beside plain seeded sampling.

    python -m specdec.bench.sampling_bench [--drafters ngram,suffix,draft_model] [--temperatures 0.3,0.7,1.0] \\
        [--prompts 6] [--max-tokens 64] [--out bench_results/sampling-bench]

One target (default Qwen2.5-Coder-1.5B-Instruct) is loaded once and shared by every LLM: plain decoding, and per
drafter one LLM with acceptance "exact" and one with "rejection" (the draft model, default
Qwen2.5-Coder-0.5B-Instruct, is loaded by each of its two LLMs); the LLMs are built afresh for every temperature.
Every speculative LLM drafts a fixed k tokens per step (draft policy "fixed", chains), so acceptance figures do not
depend on the machine's speed. The prompts are the first turns of the datasets' first questions, taken in turn from
each file, in the model's chat template; prompt i is sampled with seed --seed + i at every temperature (top-k and
top-p off unless given), by plain decoding and by every speculative LLM, interleaved prompt by prompt with the order
rotating, after one warm-up generation per LLM.

Per (drafter, temperature, acceptance): acceptance rate (accepted / drafted), mean accepted length (1 + accepted /
verify steps), output tokens per second per request (prefill included; the median over the prompts), the speed-up
over plain seeded sampling of the same prompts in the same run (the ratio of the medians), and the fraction of
outputs identical to plain seeded sampling's with the same seed. Exact acceptance must give 1.0 wherever the kernel
report's bit_exact is true: the command then exits with 1 otherwise. Writes sampling_bench.json (rows,
per-generation records, the CPU, the kernel report) to --out.

Run it on an otherwise idle machine: with more runnable threads than cores, the kernels' threads wait on each other
and tokens per second fall several-fold (the acceptance figures and the identical outputs do not change).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdec.bench.provenance import run_metadata
from specdec.config import ACCEPTANCE_METHODS, SamplingParams

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT_MODEL = "qwen2.5-coder-0.5b-instruct"
DEFAULT_DATASETS = ("../shared/data/humaneval_dev.jsonl", "../shared/data/spec_bench_dev.jsonl")
DRAFTERS = ("ngram", "suffix", "draft_model")
PLAIN = "plain"
EXIT_NOT_EXACT = 1
WARMUP_TEXT = "Say hello and name three colours."
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class Case:
    """One LLM of the benchmark: plain decoding (drafter PLAIN, acceptance None) or a drafter with an acceptance."""

    drafter: str
    acceptance: str | None = None

    @property
    def label(self) -> str:
        return self.drafter if self.acceptance is None else f"{self.drafter}/{self.acceptance}"


@dataclass
class Totals:
    """One case's sums over the prompts at one temperature."""

    tokens: int = 0
    tokens_per_s: list[float] = field(default_factory=list)  # one per request
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    identical: int = 0
    outputs: int = 0

    def add(self, record: dict[str, Any]) -> None:
        self.tokens += record["new_tokens"]
        self.tokens_per_s.append(record["new_tokens"] / record["wall_s"] if record["wall_s"] > 0 else 0.0)
        self.drafted += record["drafted_tokens"]
        self.accepted += record["accepted_tokens"]
        self.verify_steps += record["verify_steps"]
        self.identical += bool(record["identical"])
        self.outputs += 1


@dataclass(frozen=True)
class Row:
    drafter: str
    temperature: float
    acceptance: str
    acceptance_rate: float | None  # accepted / drafted
    mean_accepted_length: float | None  # 1 + accepted / verify steps
    tokens_per_s: float  # median over the requests of output tokens / wall time (prefill included)
    plain_tokens_per_s: float  # the same for plain seeded sampling of the same prompts and seeds, same run
    speedup: float  # tokens_per_s / plain_tokens_per_s
    identical_fraction: float  # outputs equal to plain seeded sampling's with the same seed
    outputs: int
    tokens: int


@dataclass
class BenchSetup:
    target: str = DEFAULT_TARGET
    draft_model: str = DEFAULT_DRAFT_MODEL
    drafters: list[str] = field(default_factory=lambda: list(DRAFTERS))
    temperatures: list[float] = field(default_factory=lambda: [0.3, 0.7, 1.0])
    top_k: int = 0
    top_p: float = 1.0
    num_speculative_tokens: int = 4
    prompts: int = 6
    max_tokens: int = 64
    seed: int = 0
    max_model_len: int = 4096
    draft_weight_format: str | None = None  # the draft model's weight format; None: its default (q4-all)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET, help="catalogue name, .gguf path or HF directory")
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT_MODEL, help="draft_model's draft model")
    parser.add_argument("--draft-weight-format", default=None,
                        help="the draft model's weight format (default: the draft model default, q4-all)")
    parser.add_argument("--drafters", default=",".join(DRAFTERS), help=f"comma list of {', '.join(DRAFTERS)}")
    parser.add_argument("--temperatures", default="0.3,0.7,1.0", help="comma list, each > 0")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens, drafted at every step")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="prompt i is sampled with seed SEED + i")
    parser.add_argument("--dataset", action="append", default=None,
                        help=f"Spec-Bench or HumanEval JSONL (repeatable; default: {', '.join(DEFAULT_DATASETS)})")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="bench_results/sampling-bench")
    return parser.parse_args(argv)


def setup_from_args(args: argparse.Namespace) -> BenchSetup:
    drafters = [name.strip() for name in args.drafters.split(",") if name.strip()]
    unknown = [name for name in drafters if name not in DRAFTERS]
    if unknown or not drafters:
        raise ValueError(f"--drafters must name some of {', '.join(DRAFTERS)}, got {args.drafters!r}")
    temperatures = [float(value) for value in args.temperatures.split(",") if value.strip()]
    if not temperatures or any(value <= 0 for value in temperatures):
        raise ValueError(f"--temperatures must be a comma list of numbers > 0, got {args.temperatures!r}")
    if args.prompts < 1 or args.max_tokens < 1:
        raise ValueError("--prompts and --max-tokens must be >= 1")
    return BenchSetup(args.target, args.draft_model, drafters, temperatures, args.top_k, args.top_p, args.k,
                      args.prompts, args.max_tokens, args.seed, draft_weight_format=args.draft_weight_format)


def speculative_config(drafter: str, acceptance: str, setup: BenchSetup) -> dict[str, Any]:
    """A chain (one branch) of num_speculative_tokens drafts with this acceptance; the draft model for draft_model."""
    config: dict[str, Any] = {"method": drafter, "num_speculative_tokens": setup.num_speculative_tokens,
                              "num_draft_branches": 1, "acceptance": acceptance}
    if drafter == "draft_model":
        config["model"] = setup.draft_model
        if setup.draft_weight_format is not None:
            config["weight_format"] = setup.draft_weight_format
    return config


def cases(setup: BenchSetup) -> list[Case]:
    return [Case(PLAIN)] + [
        Case(drafter, acceptance) for drafter in setup.drafters for acceptance in ACCEPTANCE_METHODS
    ]


def build_llms(loaded, setup: BenchSetup) -> dict[Case, Any]:
    """One LLM per case, all sharing the loaded (target, tokenizer); batch 1, fixed draft length."""
    from specdec.llm import LLM

    common = dict(loaded=loaded, max_num_seqs=1, max_model_len=setup.max_model_len)
    return {case: LLM(**common) if case.acceptance is None else
            LLM(speculative_config=speculative_config(case.drafter, case.acceptance, setup), draft_policy="fixed",
                **common)
            for case in cases(setup)}


def load_prompts(paths: list[str], count: int, tokenizer) -> list[tuple[str, list[int]]]:
    """(question id, chat prompt ids) of the first turns of the files' first questions, one file after the other."""
    from specdec.datasets import load_questions

    per_file = [load_questions(path) for path in paths]
    interleaved = [questions[i] for i in range(max(map(len, per_file), default=0))
                   for questions in per_file if i < len(questions)]
    if len(interleaved) < count:
        raise ValueError(f"--prompts {count}: only {len(interleaved)} questions in {', '.join(paths)}")
    return [(f"{q.dataset}/{q.question_id}", chat_prompt(tokenizer, q.turns[0])) for q in interleaved[:count]]


def chat_prompt(tokenizer, text: str) -> list[int]:
    """One user turn in the chat template, as LLM.encode_prompt(..., chat=True) encodes it."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


def sampling_params(setup: BenchSetup, temperature: float, seed: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_k=setup.top_k, top_p=setup.top_p, seed=seed,
                          max_tokens=max_tokens)


def generate_once(llm, prompt_ids: list[int], params: SamplingParams) -> tuple[Any, float]:
    started = time.perf_counter()
    (output,) = llm.generate([prompt_ids], params)
    return output, time.perf_counter() - started


def warm_up(llms: dict[Case, Any], setup: BenchSetup, tokenizer) -> None:
    """One short sampled generation per LLM (kernel set-up, first-call allocations), excluded from the figures."""
    prompt = chat_prompt(tokenizer, WARMUP_TEXT)
    for llm in llms.values():
        llm.generate([prompt], sampling_params(setup, setup.temperatures[0], setup.seed, WARMUP_TOKENS))


def run_temperature(llms: dict[Case, Any], prompts: list[tuple[str, list[int]]], setup: BenchSetup,
                    temperature: float) -> list[dict[str, Any]]:
    """Every prompt through every case at one temperature, interleaved with the order rotating; one record each."""
    records = []
    order = list(llms)
    for index, (question, prompt_ids) in enumerate(prompts):
        params = sampling_params(setup, temperature, setup.seed + index, setup.max_tokens)
        shift = index % len(order)
        outputs = {case: generate_once(llms[case], prompt_ids, params) for case in order[shift:] + order[:shift]}
        plain_ids = outputs[Case(PLAIN)][0].token_ids
        for case in order:
            output, wall_s = outputs[case]
            records.append(make_record(case, temperature, question, params.seed, output, wall_s, plain_ids))
    return records


def make_record(case: Case, temperature: float, question: str, seed: int, output, wall_s: float,
                plain_ids: tuple[int, ...]) -> dict[str, Any]:
    metrics = output.metrics
    return {"drafter": case.drafter, "acceptance": case.acceptance, "temperature": temperature,
            "question": question, "seed": seed, "new_tokens": len(output.token_ids), "wall_s": wall_s,
            "drafted_tokens": metrics.drafted_tokens, "accepted_tokens": metrics.accepted_tokens,
            "verify_steps": metrics.verify_steps, "finish_reason": output.finish_reason,
            "identical": tuple(output.token_ids) == tuple(plain_ids), "token_ids": list(output.token_ids)}


def summarize(records: list[dict[str, Any]]) -> list[Row]:
    """One row per (drafter, temperature, acceptance), in the records' order, with the plain figures beside it."""
    totals: dict[tuple[str, float, str | None], Totals] = {}
    for record in records:
        totals.setdefault((record["drafter"], record["temperature"], record["acceptance"]), Totals()).add(record)
    rows = []
    for (drafter, temperature, acceptance), total in totals.items():
        if acceptance is None:
            continue
        plain = totals[(PLAIN, temperature, None)]
        speed, plain_speed = statistics.median(total.tokens_per_s), statistics.median(plain.tokens_per_s)
        rows.append(Row(drafter, temperature, acceptance,
                        total.accepted / total.drafted if total.drafted else None,
                        1 + total.accepted / total.verify_steps if total.verify_steps else None,
                        speed, plain_speed, speed / plain_speed, total.identical / total.outputs, total.outputs,
                        total.tokens))
    return sorted(rows, key=lambda row: (DRAFTERS.index(row.drafter), row.temperature,
                                         ACCEPTANCE_METHODS.index(row.acceptance)))


def format_table(rows: list[Row]) -> str:
    lines = ["| drafter | temperature | acceptance | acceptance rate | mean accepted length | tok/s | plain tok/s "
             "| speed-up | identical to plain |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        rate = "-" if row.acceptance_rate is None else f"{row.acceptance_rate:.2f}"
        length = "-" if row.mean_accepted_length is None else f"{row.mean_accepted_length:.2f}"
        lines.append(f"| {row.drafter} | {row.temperature:g} | {row.acceptance} | {rate} | {length} | "
                     f"{row.tokens_per_s:.1f} | {row.plain_tokens_per_s:.1f} | {row.speedup:.2f}x | "
                     f"{row.identical_fraction:.2f} |")
    return "\n".join(lines)


def exact_rows_identical(rows: list[Row]) -> bool:
    return all(row.identical_fraction == 1.0 for row in rows if row.acceptance == "exact")


def metadata(setup: BenchSetup, threads: int, kernels: dict[str, Any], argv: list[str] | None,
             prompts: list[tuple[str, list[int]]]) -> dict[str, Any]:
    return {"setup": asdict(setup), "questions": [question for question, _ in prompts],
            "seeds": [setup.seed + i for i in range(len(prompts))], "draft_policy": "fixed",
            **run_metadata(threads, kernels, argv)}


def run(setup: BenchSetup, loaded, datasets: list[str], threads: int, kernels: dict[str, Any],
        argv: list[str] | None = None) -> dict[str, Any]:
    """Runs every temperature on the loaded target, each with freshly built LLMs (so the suffix drafter's cache of
    finished requests never holds a prompt's output from an earlier temperature); returns the results document."""
    prompts = load_prompts(datasets, setup.prompts, loaded[1])
    records = []
    for temperature in setup.temperatures:
        llms = build_llms(loaded, setup)
        warm_up(llms, setup, loaded[1])
        records += run_temperature(llms, prompts, setup, temperature)
        del llms  # frees the drafters (and draft models) before the next temperature builds new ones
        print(f"[temperature {temperature:g} done]", file=sys.stderr, flush=True)
    rows = summarize(records)
    return {"metadata": metadata(setup, threads, kernels, argv, prompts), "rows": [asdict(row) for row in rows],
            "exact_identical": exact_rows_identical(rows), "records": records}


def main(argv: list[str] | None = None) -> int:
    from specdec.kernels.report import announce_kernels
    from specdec.runtime import configure_threads, load_model

    args = parse_args(argv)
    setup = setup_from_args(args)
    threads = configure_threads(args.threads)
    loaded = load_model(setup.target)
    kernels = announce_kernels("cpu", "auto", linear_bytes=loaded[0].linear_bytes()).to_dict()
    results = run(setup, loaded, args.dataset or list(DEFAULT_DATASETS), threads, kernels, argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampling_bench.json").write_text(json.dumps(results, indent=2))
    rows = [Row(**row) for row in results["rows"]]
    print(format_table(rows))
    print(f"[{setup.target}, {len(results['metadata']['questions'])} prompts x {setup.max_tokens} tokens, k = "
          f"{setup.num_speculative_tokens}, {threads} threads, {results['metadata']['cpu']}, bit_exact "
          f"{kernels['bit_exact']}; wrote {out / 'sampling_bench.json'}]", file=sys.stderr)
    if kernels["bit_exact"] and not results["exact_identical"]:
        print("[EXACTNESS VIOLATION: an exact-acceptance output differs from plain seeded sampling]", file=sys.stderr)
        return EXIT_NOT_EXACT
    return 0


if __name__ == "__main__":
    sys.exit(main())
