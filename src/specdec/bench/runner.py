"""`specdec bench`: Spec-Bench-style benchmark of our methods (and peers) on one target, with a lossless check.

Protocol (greedy, batch 1):
  * one LLM per method, all sharing one loaded target; ``none`` (plain decoding) is the reference and is
    added when not listed;
  * methods run interleaved prompt by prompt (the order rotates from one question to the next) so machine
    drift hits all of them alike; one warm-up generation per runner and round is excluded;
  * multi-turn questions: every runner answers turn 1, then gets [user t1, assistant <its own answer>, user t2]
    through the model's chat template; turns are compared per turn;
  * ``--repeats R`` runs R rounds over all prompts, each with freshly built runners (so cross-request drafter
    caches such as the suffix cache never see a prompt twice); a prompt's wall time is its median over rounds;
  * lossless check: every output must equal its reference's output (ours: ``none``; peers: their own plain
    row) token for token; mismatches are listed and, for our methods, make the command exit with 1.
Outputs in --out: results.json, results.md, speedup.png, acceptance_by_position.png, tokens_per_s.png.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import platform
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdec.datasets import Question, load_questions
from specdec.config import DRAFT_POLICIES
from specdec.bench.methods import Generation, MethodSpec, Runner, draft_model_of, parse_methods

WARMUP_MESSAGES = [{"role": "user", "content": "Say hello and name three colours."}]
WARMUP_TOKENS = 16
EXIT_MISMATCH = 1


@dataclass
class BenchOptions:
    model: str
    methods: list[str]
    datasets: list[str]
    out: Path = Path("bench_results")
    limit: int | None = None
    held_out_of: int = 0  # > 0: only the questions `train-draft --holdout-every N` leaves out
    max_new_tokens: int = 128
    repeats: int = 1
    peers: list[str] = field(default_factory=list)
    categories: list[str] | None = None
    threads: int | None = None
    weight_format: str = "auto"
    draft_policy: str = "adaptive"
    max_model_len: int = 4096
    device: str | None = None
    plots: bool = True
    progress: bool = True
    tensor_parallel_size: int = 1  # processes the target is split over (this one is rank 0)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")
        if self.held_out_of < 0:
            raise ValueError(f"--held-out-of must be >= 0, got {self.held_out_of}")
        if not self.datasets:
            raise ValueError("give at least one --dataset")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from specdec.models.catalog import DEFAULT_MODEL

    parser.add_argument("--model", default=DEFAULT_MODEL, help="target: catalogue name, .gguf path or HF directory")
    parser.add_argument("--methods", action="append", default=None,
                        help='comma-separated methods, each NAME or NAME:{json config}, e.g. '
                             'none,ngram:{"num_speculative_tokens":7},suffix,draft_model (default: none,ngram,suffix)')
    parser.add_argument("--dataset", action="append", required=True,
                        help="Spec-Bench or HumanEval JSONL file (repeatable)")
    parser.add_argument("--limit", type=int, default=None, help="first N questions of each category")
    parser.add_argument("--categories", default=None, help="comma-separated categories to keep")
    parser.add_argument("--held-out-of", type=int, default=0, metavar="N",
                        help="keep only the questions `specdec train-draft --holdout-every N` leaves out of training")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="rounds over all prompts; wall time = median")
    parser.add_argument("--out", default="bench_results", help="output directory")
    parser.add_argument("--peer", action="append", default=[], choices=["transformers", "llama-cpp", "vllm"],
                        help="also run a peer engine (repeatable)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--weight-format", default="auto", choices=["auto", "q4", "q8", "fp32"])
    parser.add_argument("--draft-policy", default="adaptive", choices=DRAFT_POLICIES,
                        help="adaptive: k per step from acceptance and measured costs; fixed: always the method's k")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--device", default=None)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="split the target over N processes (gloo on CPU, NCCL on CUDA; docs/tensor-parallel.md)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    return BenchOptions(
        model=args.model, methods=args.methods or ["none,ngram,suffix"], datasets=list(args.dataset),
        out=Path(args.out), limit=args.limit, held_out_of=args.held_out_of, max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        peers=list(args.peer), categories=args.categories.split(",") if args.categories else None,
        threads=args.threads, weight_format=args.weight_format, draft_policy=args.draft_policy,
        max_model_len=args.max_model_len, device=args.device, plots=not args.no_plots, progress=not args.no_progress,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def run_bench(options: BenchOptions, argv: list[str] | None = None) -> int:
    """Runs the benchmark, writes the outputs; returns 0, or EXIT_MISMATCH when one of our methods was not lossless."""
    from specdec.bench import report
    from specdec.kernels.report import announce_kernels
    from specdec.runtime import configure_threads, default_device, load_target

    threads = configure_threads(options.threads)
    questions = _load_all_questions(options)
    specs = parse_methods(options.methods, options.model)
    peers = _available_peers(options.peers)  # a missing package fails before the (slow) model load
    started = time.perf_counter()
    device = options.device or str(default_device())
    model, tokenizer, parallel_group = load_target(options.model, options.weight_format, device,
                                                   options.tensor_parallel_size)
    loaded = (model, tokenizer)
    load_s = time.perf_counter() - started
    kernels = announce_kernels(device, options.weight_format, linear_bytes=loaded[0].linear_bytes())
    try:
        peer_runners = _build_peer_runners(options, peers, specs, loaded[1], threads)
        records, runner_descriptions = _run_rounds(options, questions, specs, loaded, peer_runners)
    finally:
        if parallel_group is not None:
            parallel_group.close()
    mismatches = check_lossless(records)
    metadata = {**_metadata(options, specs, threads, load_s, argv, device), **kernels.to_dict()}
    results = report.build_results(metadata, runner_descriptions, records, mismatches)
    written = report.write_outputs(results, options.out, plots=options.plots)
    print(report.speedup_table(results), file=sys.stdout)
    print(f"[wrote {', '.join(str(path) for path in written)}]", file=sys.stderr)
    return _exit_status(mismatches)


def _load_all_questions(options: BenchOptions) -> list[Question]:
    questions = [q for path in options.datasets
                 for q in load_questions(path, options.categories, options.limit, options.held_out_of)]
    if not questions:
        raise ValueError(f"no questions selected from {', '.join(options.datasets)}"
                         + (f" for categories {', '.join(options.categories)}" if options.categories else ""))
    return questions


def _available_peers(names: list[str]) -> list:
    if not names:
        return []
    from specdec.bench.peers import make_peer

    return [make_peer(name) for name in names]


def _build_peer_runners(options: BenchOptions, peers: list, specs: list[MethodSpec], tokenizer,
                        threads: int) -> list[Runner]:
    if not peers:
        return []
    from specdec.bench.peers import PeerContext
    from specdec.models.catalog import resolve_model

    draft = draft_model_of(specs)
    context = PeerContext(model=options.model, model_path=resolve_model(options.model),
                          draft_path=resolve_model(draft) if draft else None, methods=specs,
                          eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)), threads=threads,
                          max_model_len=options.max_model_len)
    return [runner for peer in peers for runner in peer.build_runners(context)]


def _run_rounds(options: BenchOptions, questions: list[Question], specs: list[MethodSpec], loaded,
                peer_runners: list[Runner]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from tqdm import tqdm

    from specdec.bench.methods import SpecdecRunner

    num_runners = len(specs) + len(peer_runners)
    total = sum(len(q.turns) for q in questions) * num_runners * options.repeats
    records: list[dict[str, Any]] = []
    descriptions: list[dict[str, Any]] = []
    with tqdm(total=total, desc="bench", unit="gen", disable=not options.progress, file=sys.stderr) as progress:
        for round_index in range(options.repeats):
            runners = [SpecdecRunner(spec, loaded, options.weight_format, options.max_model_len, options.device,
                                     options.draft_policy)
                       for spec in specs] + peer_runners
            descriptions = [runner.describe() for runner in runners]
            for runner in runners:
                runner.generate(loaded[1].encode_chat(WARMUP_MESSAGES), min(WARMUP_TOKENS, options.max_new_tokens))
            records += run_round(round_index, questions, runners, loaded[1], options.max_new_tokens, progress)
            del runners  # frees the round's drafters (and draft model) before the next round builds new ones
    return records, descriptions


def run_round(round_index: int, questions: list[Question], runners: list[Runner], tokenizer, max_new_tokens: int,
              progress) -> list[dict[str, Any]]:
    """Every question through every runner, interleaved; each runner continues its own conversation."""
    records = []
    for question_index, question in enumerate(questions):
        shift = question_index % len(runners)
        order = runners[shift:] + runners[:shift]
        conversations: dict[str, list[dict[str, str]]] = {runner.label: [] for runner in runners}
        for turn_index, turn in enumerate(question.turns):
            for runner in order:
                messages = conversations[runner.label] + [{"role": "user", "content": turn}]
                prompt_ids = tokenizer.encode_chat(messages)
                generation = runner.generate(prompt_ids, max_new_tokens)
                answer = tokenizer.decode(generation.token_ids, skip_special_tokens=True)
                conversations[runner.label] = messages + [{"role": "assistant", "content": answer}]
                records.append(make_record(round_index, runner, question, turn_index, prompt_ids, generation, answer))
                progress.set_postfix_str(f"{question.category} {runner.label}", refresh=False)
                progress.update(1)
    return records


def make_record(round_index: int, runner: Runner, question: Question, turn_index: int, prompt_ids: list[int],
                generation: Generation, text: str) -> dict[str, Any]:
    new_tokens = len(generation.token_ids)
    record = {
        "round": round_index, "method": runner.label, "family": runner.family, "reference": runner.reference,
        "strict": runner.strict,
        "dataset": question.dataset, "question_id": question.question_id, "category": question.category,
        "turn": turn_index, "prompt_tokens": len(prompt_ids), "new_tokens": new_tokens,
        "wall_s": generation.wall_s,
        "tokens_per_s": new_tokens / generation.wall_s if generation.wall_s > 0 else 0.0,
        "finish_reason": generation.finish_reason,
        **_counters(generation),
        "peak_rss_mib": peak_rss_mib(),
        "identical": None, "first_mismatch": None,
        "token_ids": list(generation.token_ids), "text": text,
    }
    return record


def _counters(generation: Generation) -> dict[str, Any]:
    counters = {key: value for key, value in asdict(generation).items() if key not in ("token_ids", "wall_s",
                                                                                        "finish_reason", "extra")}
    drafted, accepted, steps = generation.drafted_tokens, generation.accepted_tokens, generation.verify_steps
    counters["acceptance_rate"] = accepted / drafted if drafted and accepted is not None else None
    counters["mean_accepted_length"] = 1 + accepted / steps if steps and accepted is not None else None
    if generation.drafted_per_position is not None and generation.accepted_per_position is not None:
        counters["position_acceptance_rates"] = [
            a / d if d else 0.0 for a, d in zip(generation.accepted_per_position, generation.drafted_per_position)]
    else:
        counters["position_acceptance_rates"] = None
    return counters


def peak_rss_mib() -> float:
    """The process's peak resident set size so far (high-water mark, not the current size)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def check_lossless(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Marks every record with a reference as identical or not; returns the mismatches (first differing index)."""
    by_key = {(r["round"], r["method"], r["dataset"], r["question_id"], r["turn"]): r for r in records}
    mismatches = []
    for record in records:
        if record["reference"] is None:
            continue
        key = (record["round"], record["reference"], record["dataset"], record["question_id"], record["turn"])
        reference = by_key.get(key)
        if reference is None:
            raise ValueError(f"no {record['reference']!r} output for {key} to check {record['method']!r} against")
        index = first_difference(reference["token_ids"], record["token_ids"])
        record["identical"] = index is None
        record["first_mismatch"] = index
        if index is not None:
            mismatches.append(_mismatch(record, reference, index))
    return mismatches


def first_difference(expected: list[int], actual: list[int]) -> int | None:
    """Index of the first differing token (the shorter length when one is a prefix of the other); None if equal."""
    for index, (a, b) in enumerate(zip(expected, actual)):
        if a != b:
            return index
    return None if len(expected) == len(actual) else min(len(expected), len(actual))


def _mismatch(record: dict[str, Any], reference: dict[str, Any], index: int) -> dict[str, Any]:
    at = lambda ids: ids[index] if index < len(ids) else None  # noqa: E731
    return {
        "method": record["method"], "reference": record["reference"], "family": record["family"],
        "strict": record["strict"], "round": record["round"], "dataset": record["dataset"],
        "question_id": record["question_id"], "category": record["category"], "turn": record["turn"],
        "first_mismatch": index, "reference_token": at(reference["token_ids"]), "token": at(record["token_ids"]),
        "reference_tokens": len(reference["token_ids"]), "tokens": len(record["token_ids"]),
    }


def _exit_status(mismatches: list[dict[str, Any]]) -> int:
    strict = [m for m in mismatches if m["strict"]]
    for m in mismatches:
        kind = "LOSSLESS VIOLATION" if m["strict"] else "peer mismatch (reported only)"
        print(f"[{kind}: {m['method']} vs {m['reference']} on {m['dataset']}/{m['question_id']} turn {m['turn'] + 1} "
              f"(round {m['round']}): first difference at token {m['first_mismatch']} "
              f"({m['reference_token']} -> {m['token']})]", file=sys.stderr)
    return EXIT_MISMATCH if strict else 0


def _metadata(options: BenchOptions, specs: list[MethodSpec], threads: int, load_s: float,
              argv: list[str] | None, device: str) -> dict[str, Any]:
    import torch

    return {
        "model": options.model, "datasets": options.datasets, "categories": options.categories,
        "limit": options.limit, "max_new_tokens": options.max_new_tokens, "repeats": options.repeats,
        "methods": [asdict(spec) for spec in specs], "peers": options.peers, "weight_format": options.weight_format,
        "threads": threads, "device": device, "torch_version": torch.__version__,
        "specdec_version": package_version("specdec"), "python": platform.python_version(),
        "platform": platform.platform(), "processor": platform.processor(), "git_commit": _git_commit(),
        "model_load_s": load_s, "command_line": list(argv) if argv is not None else sys.argv,
        "options": {key: str(value) if isinstance(value, Path) else value for key, value in asdict(options).items()},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def package_version(package: str) -> str | None:
    """The installed version of a distribution, None when it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                cwd=Path(__file__).parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None if result.returncode == 0 else None


def cmd_bench(args: argparse.Namespace) -> int:
    return run_bench(options_from_args(args), getattr(args, "argv", None))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="specdec bench")
    add_bench_arguments(parser)
    sys.exit(cmd_bench(parser.parse_args()))
