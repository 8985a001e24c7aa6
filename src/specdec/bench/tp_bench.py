"""Tensor parallel against one process: per-token latency, all-reduce time per forward, communication's share.

    python -m specdec.bench.tp_bench [--model qwen2.5-coder-1.5b-instruct] [--sizes 1,2] \\
        [--methods plain,ngram,draft_model] [--prompts 4] [--max-tokens 64] [--out bench_results/tp-bench]

For each tensor-parallel size the target is loaded once (split over that many processes, this one rank 0, each rank
with cores / size torch threads) and shared by one LLM per method: plain decoding, ngram (prompt lookup) and the
draft model (default Qwen2.5-Coder-0.5B-Instruct, unsplit on rank 0), all greedy, at a fixed draft length k (draft
policy "fixed", chains). Prompts are the first turns of the dataset's first questions in the chat template, one
request at a time (batch 1), after one warm-up generation per LLM.

Per (size, method): output tokens, per-token latency (wall time / tokens, prefill included), forwards of the target,
and on size > 1 the leader's all-reduce time per forward (two per layer; it includes the wait for the slower rank),
its command broadcast time per forward (a forward's inputs sent to the workers), and communication's share of the
wall time. Speculative rows say whether every output is identical to plain decoding's at the same size (it must be:
the command exits with 1 otherwise). Then, across sizes: each size's plain outputs against the first size's
(identical or not, and where they diverge), and the target's logits over the first prompt against the first size's
(max |difference|, relative to the largest logit, and the share of rows with the same argmax).

Separately, the all-reduce alone on this machine (`--all-reduce-rows`): spawned ranks time the fixed-order all-reduce
of [rows, hidden] fp32 messages and fit latency α and bandwidth β of t = α + bytes / β, the cost model
`specdec plan --tensor-parallel-size` uses (with its own α and β for NVLink, PCIe, Ethernet).

On one 2-core machine tensor parallelism has nothing to gain: the 2 ranks share the 2 cores the single process had,
each streams half the weights at half the threads, and every forward adds 2 · layers all-reduces and a broadcast.
The figures show that overhead; they check correctness and measure the all-reduce, they are not a speed-up. Run on an
otherwise idle machine: the all-reduce time includes waiting for the other rank, which another process's load
inflates.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdec.config import SamplingParams

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT_MODEL = "qwen2.5-coder-0.5b-instruct"
DEFAULT_DATASET = os.path.join(os.environ.get("SPECDEC_DATA", "/work/shared/data"), "humaneval_dev.jsonl")
METHODS = ("plain", "ngram", "draft_model")
EXIT_NOT_EXACT = 1
WARMUP_TOKENS = 8
DISCLAIMER = ("on one 2-core machine the ranks share the cores one process had: tensor parallelism shows its "
              "overhead here (all-reduces, broadcasts, half the threads per rank), not a speed-up")


@dataclass(frozen=True)
class Row:
    """One (tensor-parallel size, method)."""

    size: int
    method: str
    tokens: int
    wall_s: float
    forwards: int  # target forwards (counted by the leader's command channel: 0 at size 1)
    all_reduce_s: float
    command_s: float
    acceptance_rate: float | None
    identical_to_plain: bool | None

    @property
    def ms_per_token(self) -> float:
        return 1e3 * self.wall_s / self.tokens if self.tokens else float("nan")

    @property
    def all_reduce_ms_per_forward(self) -> float:
        return 1e3 * self.all_reduce_s / self.forwards if self.forwards else 0.0

    @property
    def command_ms_per_forward(self) -> float:
        return 1e3 * self.command_s / self.forwards if self.forwards else 0.0

    @property
    def communication_share(self) -> float:
        return (self.all_reduce_s + self.command_s) / self.wall_s if self.wall_s else 0.0


@dataclass(frozen=True)
class AllReduceFit:
    """t = latency_s + bytes / bandwidth (bytes of one rank's message), fitted to the medians per message size."""

    latency_s: float
    bandwidth: float  # bytes/s
    samples: list[tuple[int, float]]  # (bytes, median seconds)


# ---- the all-reduce alone ---------------------------------------------------------------------------------------
def _time_all_reduce_rank(rank: int, world_size: int, port: int, hidden: int, rows: list[int], repeats: int,
                          out_path: str) -> None:
    from specdec.models.parallel import TensorParallel

    parallel = TensorParallel.connect(world_size, rank, port)
    medians = []
    for count in rows:
        message = torch.randn(count, hidden)  # [rows, hidden]
        for _ in range(3):
            parallel.all_reduce(message)
        seconds = []
        for _ in range(repeats):
            parallel.all_ok(True)  # every rank starts the timed all-reduce together
            start = time.perf_counter()
            parallel.all_reduce(message)
            seconds.append(time.perf_counter() - start)
        medians.append((count * hidden * 4, statistics.median(seconds)))
    if rank == 0:
        Path(out_path).write_text(json.dumps(medians))


def measure_all_reduce(world_size: int, hidden: int, rows: list[int], repeats: int = 50) -> AllReduceFit:
    """Times the fixed-order all-reduce of [rows, hidden] fp32 over world_size spawned processes; fits α and β."""
    from specdec.engine.tensor_parallel import free_port

    with tempfile.TemporaryDirectory() as directory:
        out_path = os.path.join(directory, "all_reduce.json")
        torch.multiprocessing.spawn(_time_all_reduce_rank,
                                    (world_size, free_port(), hidden, rows, repeats, out_path), nprocs=world_size)
        samples = [tuple(sample) for sample in json.loads(Path(out_path).read_text())]
    return fit_latency_bandwidth(samples)


def fit_latency_bandwidth(samples: list[tuple[int, float]]) -> AllReduceFit:
    """Least squares of t = α + bytes / β over (bytes, seconds) samples (β infinite when t does not grow)."""
    sizes = torch.tensor([float(size) for size, _ in samples], dtype=torch.float64)
    seconds = torch.tensor([t for _, t in samples], dtype=torch.float64)
    design = torch.stack([torch.ones_like(sizes), sizes], dim=1)  # [samples, 2]
    alpha, per_byte = torch.linalg.lstsq(design, seconds[:, None]).solution[:, 0].tolist()
    return AllReduceFit(max(alpha, 0.0), 1 / per_byte if per_byte > 0 else float("inf"), list(samples))


# ---- the engine at each size -------------------------------------------------------------------------------------
def speculative_config(method: str, draft_model: str, k: int) -> dict | None:
    if method == "plain":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k}
    return {"method": "draft_model", "model": draft_model, "num_speculative_tokens": k, "num_draft_branches": 1}


@dataclass(frozen=True)
class SizeResult:
    size: int
    rows: list[Row]
    outputs: dict[str, list[list[int]]]  # method -> output token ids per prompt
    logits: torch.Tensor  # [first prompt's tokens, vocab] the target's logits
    hidden_size: int


def run_size(args: argparse.Namespace, size: int, prompts: list[str]) -> SizeResult:
    """Rows of one tensor-parallel size, the outputs per method, and the target's logits over the first prompt."""
    from specdec.llm import LLM
    from specdec.models.batch import ForwardBatch
    from specdec.runtime import configure_threads, load_target

    if size == 1:
        configure_threads(args.threads)
    model, tokenizer, group = load_target(args.model, args.weight_format, "cpu", size)
    try:
        rows, outputs = [], {}
        for method in args.methods:
            spec_config = speculative_config(method, args.draft_model, args.k)
            llm = LLM(loaded=(model, tokenizer), speculative_config=spec_config, max_num_seqs=1,
                      max_model_len=args.max_model_len, draft_policy="fixed", device="cpu")
            token_lists = [llm.encode_prompt(prompt, chat=tokenizer.chat_template is not None) for prompt in prompts]
            llm.generate([token_lists[0]], SamplingParams(max_tokens=WARMUP_TOKENS))
            row, outputs[method] = _timed(llm, size, method, token_lists, args.max_tokens, outputs.get("plain"))
            rows.append(row)
            print(f"[size {size} {method}: {row.ms_per_token:.1f} ms/token]", file=sys.stderr)
        cache = _logit_cache(model, len(token_lists[0]))
        logits = model.forward(ForwardBatch.build([token_lists[0]], [0], [0], all_logits=True), cache)
        return SizeResult(size, rows, outputs, logits, model.config.hidden_size)
    finally:
        if group is not None:
            group.close()


def _logit_cache(model, length: int):
    """A one-slot cache for `length` tokens (this rank's heads, mirrored on the other ranks)."""
    from specdec.cache.kv_cache import KVCache
    from specdec.engine.tensor_parallel import mirrored_caches

    if model.parallel is None:
        return KVCache(model.config, 1, length + 1, model.device, dtype=model.kv_cache_dtype)
    return mirrored_caches(model, 1, length + 1, model.kv_cache_dtype, 0)[0]


def _timed(llm, size: int, method: str, token_lists: list[list[int]], max_tokens: int,
           plain_outputs: list | None) -> tuple[Row, list]:
    comm = llm.model.parallel.comm if llm.model.parallel is not None else None
    if comm is not None:
        comm.reset()
    start = time.perf_counter()
    results = [llm.generate([tokens], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
               for tokens in token_lists]
    wall_s = time.perf_counter() - start
    outputs = [list(result.token_ids) for result in results]
    drafted = sum(result.metrics.drafted_tokens for result in results)
    accepted = sum(result.metrics.accepted_tokens for result in results)
    return Row(size, method, sum(len(output) for output in outputs), wall_s, comm.forwards if comm else 0,
               comm.all_reduce_s if comm else 0.0, comm.command_s if comm else 0.0,
               accepted / drafted if method != "plain" and drafted else None,
               None if plain_outputs is None else outputs == plain_outputs), outputs


def divergence(first: list[int], second: list[int]) -> int | None:
    """Index of the first differing token (None: identical)."""
    for index, (a, b) in enumerate(zip(first, second)):
        if a != b:
            return index
    return None if len(first) == len(second) else min(len(first), len(second))


# ---- report -----------------------------------------------------------------------------------------------------
def table(rows: list[Row]) -> str:
    lines = ["size | method      | tokens | ms/token | forwards | all-reduce ms/fwd | command ms/fwd | comm share | "
             "acceptance | identical to plain",
             "-----|-------------|--------|----------|----------|-------------------|----------------|------------|"
             "------------|-------------------"]
    for row in rows:
        acceptance = "-" if row.acceptance_rate is None else f"{row.acceptance_rate:.2f}"
        identical = "-" if row.identical_to_plain is None else ("yes" if row.identical_to_plain else "NO")
        comm = ("-",) * 4 if row.size == 1 else (str(row.forwards), f"{row.all_reduce_ms_per_forward:.2f}",
                                                 f"{row.command_ms_per_forward:.2f}", f"{row.communication_share:.1%}")
        lines.append(f"{row.size:4d} | {row.method:11s} | {row.tokens:6d} | {row.ms_per_token:8.1f} | "
                     f"{comm[0]:>8s} | {comm[1]:>17s} | {comm[2]:>14s} | {comm[3]:>10s} | {acceptance:>10s} | "
                     f"{identical}")
    return "\n".join(lines)


def compare_sizes(reference: SizeResult, other: SizeResult) -> dict:
    """Plain outputs and logits of one size against the reference size's."""
    difference = (other.logits - reference.logits).abs()  # [prompt tokens, vocab]
    plain_ref, plain = reference.outputs["plain"], other.outputs["plain"]
    return {
        "sizes": [reference.size, other.size],
        "max_abs_logit_diff": float(difference.max()),
        "relative_logit_diff": float(difference.max() / reference.logits.abs().max()),
        "same_argmax_rows": float((other.logits.argmax(-1) == reference.logits.argmax(-1)).float().mean()),
        "plain_outputs_identical": sum(a == b for a, b in zip(plain_ref, plain)),
        "plain_outputs": len(plain),
        "first_divergence": [divergence(a, b) for a, b in zip(plain_ref, plain)],
    }


def load_prompts(path: str, count: int) -> list[str]:
    from specdec.datasets import load_questions

    questions = load_questions(path)[:count]
    if len(questions) < count:
        raise ValueError(f"{path} holds {len(questions)} questions, fewer than --prompts {count}")
    return [question.turns[0] for question in questions]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m specdec.bench.tp_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT_MODEL)
    parser.add_argument("--weight-format", default="auto", choices=["auto", "q4", "q8", "fp32"])
    parser.add_argument("--sizes", default="1,2", help="tensor-parallel sizes, the first is the reference")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated of {', '.join(METHODS)}")
    parser.add_argument("--dataset", default=DEFAULT_DATASET)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4, help="draft length (fixed)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None, help="torch threads at size 1 (default: all cores)")
    parser.add_argument("--all-reduce-rows", default="1,4,16,64",
                        help="message rows for the all-reduce alone (empty: skip it)")
    parser.add_argument("--all-reduce-hidden", type=int, default=None,
                        help="message columns (default: the model's hidden size)")
    parser.add_argument("--out", default="bench_results/tp-bench")
    args = parser.parse_args(argv)
    args.sizes = [int(size) for size in args.sizes.split(",")]
    args.methods = [method for method in args.methods.split(",") if method]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown or "plain" not in args.methods or args.methods[0] != "plain":
        parser.error(f"--methods: plain first, then any of {', '.join(METHODS[1:])}; got {','.join(args.methods)}")
    return args


def main(argv: list[str] | None = None) -> int:
    from specdec.bench.provenance import cpu_name
    from specdec.bench.runner import _git_commit

    args = parse_args(argv)
    prompts = load_prompts(args.dataset, args.prompts)
    print(f"[{DISCLAIMER}]", file=sys.stderr)
    per_size = []
    for size in args.sizes:
        per_size.append(run_size(args, size, prompts))
        gc.collect()
    rows = [row for result in per_size for row in result.rows]
    comparisons = [compare_sizes(per_size[0], other) for other in per_size[1:]]
    fit = None
    if args.all_reduce_rows and max(args.sizes) > 1:
        hidden = args.all_reduce_hidden or per_size[0].hidden_size
        fit = measure_all_reduce(max(args.sizes), hidden, [int(r) for r in args.all_reduce_rows.split(",")])
    print(table(rows))
    for comparison in comparisons:
        print(f"size {comparison['sizes'][1]} against {comparison['sizes'][0]}: logits max |diff| "
              f"{comparison['max_abs_logit_diff']:.3g} (relative {comparison['relative_logit_diff']:.2g}), same "
              f"argmax in {comparison['same_argmax_rows']:.0%} of rows; plain outputs identical "
              f"{comparison['plain_outputs_identical']}/{comparison['plain_outputs']}, first divergence "
              f"{comparison['first_divergence']}")
    if fit is not None:
        print(f"all-reduce alone ({max(args.sizes)} ranks): t = {fit.latency_s * 1e6:.0f} us + bytes / "
              f"{fit.bandwidth / 1e9:.2f} GB/s; samples (bytes, us): "
              + ", ".join(f"({size}, {seconds * 1e6:.0f})" for size, seconds in fit.samples))
    print(f"note: {DISCLAIMER}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"cpu": cpu_name(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"), "commit": _git_commit(),
              "command": sys.argv, "options": {key: value for key, value in vars(args).items()},
              "rows": [{**asdict(row), "ms_per_token": row.ms_per_token,
                        "all_reduce_ms_per_forward": row.all_reduce_ms_per_forward,
                        "command_ms_per_forward": row.command_ms_per_forward,
                        "communication_share": row.communication_share} for row in rows],
              "comparisons": comparisons, "all_reduce": None if fit is None else asdict(fit), "note": DISCLAIMER}
    (out / "tp_bench.json").write_text(json.dumps(record, indent=2))
    print(f"[wrote {out / 'tp_bench.json'}]", file=sys.stderr)
    exact = all(row.identical_to_plain is not False for row in rows)
    return 0 if exact else EXIT_NOT_EXACT


if __name__ == "__main__":
    sys.exit(main())
