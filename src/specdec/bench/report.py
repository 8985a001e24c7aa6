"""Benchmark results: per method and category summaries, results.json, results.md and plots.

Definitions (per method and category; ``overall`` = all prompts of the run):
  prompt               one (question, turn); its wall time is the median over rounds (--repeats)
  tokens_per_s         median over prompts of new_tokens / wall time (prefill included)
  speedup              tokens_per_s / tokens_per_s of the method's reference in the same category and run
                       (ratio of medians; ours against ``none``, peers against their own plain row)
  ttft_s               median over prompts of the time to the first new token (prefill + first step)
  decode_tokens_per_s  median over prompts of (new_tokens - 1) / (wall time - ttft): the decode phase alone,
                       as engines that report "eval" speed measure it; None where a runner gives no ttft
  decode_speedup       decode_tokens_per_s / the reference's, as speedup
  speedup_median_of_ratios   median over prompts of the per-prompt tok/s ratio (for comparison)
  acceptance_rate      α = accepted / drafted tokens, summed over the category's prompts (round 0)
  mean_accepted_length τ = 1 + accepted tokens / verify steps, summed likewise (tokens per target forward)
  position_acceptance_rates  accepted / drafted at each draft position, summed likewise
  identical_rate       share of the method's outputs (all rounds) equal to the reference's output
  None where a value does not apply (α of ``none``, identical_rate of a reference, α of HF's peers).
"""
from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

OVERALL = "overall"
SCHEMA_VERSION = 1


def build_results(metadata: dict[str, Any], runners: list[dict[str, Any]], records: list[dict[str, Any]],
                  mismatches: list[dict[str, Any]]) -> dict[str, Any]:
    categories = category_order(records)
    methods = [runner["label"] for runner in runners]
    summary = {method: {category: summarize(records, method, category) for category in categories}
               for method in methods}
    for method in methods:
        reference = next(runner["reference"] for runner in runners if runner["label"] == method)
        for category in categories:
            _add_speedups(summary[method][category], records, method, reference, category,
                          summary.get(reference, {}).get(category))
    return {
        "schema_version": SCHEMA_VERSION, "metadata": metadata, "runners": runners, "categories": categories,
        "summary": summary, "lossless": not any(m["strict"] for m in mismatches), "mismatches": mismatches,
        "records": records,
    }


def category_order(records: list[dict[str, Any]]) -> list[str]:
    categories = list(dict.fromkeys(record["category"] for record in records))
    return [*categories, OVERALL]


def _select(records: list[dict[str, Any]], method: str, category: str) -> list[dict[str, Any]]:
    return [r for r in records if r["method"] == method and (category == OVERALL or r["category"] == category)]


def per_prompt_tokens_per_s(records: list[dict[str, Any]], phase: str = "request") -> dict[tuple, float]:
    """(dataset, question_id, turn) -> tokens / median seconds over rounds, for one phase:

    ``request``: new tokens (round 0) / wall time; ``decode``: new tokens after the first / (wall time - time to
    the first token), only for prompts whose records all carry a time to first token and >= 2 new tokens.
    """
    seconds: dict[tuple, list[float]] = defaultdict(list)
    tokens: dict[tuple, int] = {}
    skipped: set[tuple] = set()
    for record in records:
        key = (record["dataset"], record["question_id"], record["turn"])
        if phase == "decode":
            first_token_s = record.get("first_token_s")
            if first_token_s is None or record["new_tokens"] < 2:
                skipped.add(key)
                continue
            seconds[key].append(record["wall_s"] - first_token_s)
        else:
            seconds[key].append(record["wall_s"])
        if record["round"] == 0:
            tokens[key] = record["new_tokens"] - (1 if phase == "decode" else 0)
    return {key: (tokens.get(key, 0) / statistics.median(values) if statistics.median(values) > 0 else 0.0)
            for key, values in seconds.items() if key not in skipped}


def _median_ttft(records: list[dict[str, Any]]) -> float | None:
    per_prompt: dict[tuple, list[float]] = defaultdict(list)
    for record in records:
        if record.get("first_token_s") is not None:
            per_prompt[(record["dataset"], record["question_id"], record["turn"])].append(record["first_token_s"])
    return statistics.median(statistics.median(v) for v in per_prompt.values()) if per_prompt else None


def summarize(records: list[dict[str, Any]], method: str, category: str) -> dict[str, Any]:
    selected = _select(records, method, category)
    speeds = per_prompt_tokens_per_s(selected)
    decode_speeds = per_prompt_tokens_per_s(selected, phase="decode")
    first_round = [r for r in selected if r["round"] == 0]
    judged = [r["identical"] for r in selected if r["identical"] is not None]
    drafted = _sum(first_round, "drafted_tokens")
    accepted = _sum(first_round, "accepted_tokens")
    steps = _sum(first_round, "verify_steps")
    return {
        "n_prompts": len(speeds),
        "tokens_per_s": statistics.median(speeds.values()) if speeds else 0.0,
        "speedup": None,
        "speedup_median_of_ratios": None,
        "ttft_s": _median_ttft(selected),
        "decode_tokens_per_s": statistics.median(decode_speeds.values()) if decode_speeds else None,
        "decode_speedup": None,
        "acceptance_rate": accepted / drafted if drafted and accepted is not None else None,
        "mean_accepted_length": 1 + accepted / steps if steps and accepted is not None else None,
        "position_acceptance_rates": _position_rates(first_round),
        "identical_rate": sum(judged) / len(judged) if judged else None,
        "new_tokens": sum(r["new_tokens"] for r in first_round),
        "peak_rss_mib": max((r["peak_rss_mib"] for r in selected), default=None),
    }


def _sum(records: list[dict[str, Any]], key: str) -> int | None:
    values = [r[key] for r in records if r[key] is not None]
    return sum(values) if values else None


def _position_rates(records: list[dict[str, Any]]) -> list[float] | None:
    drafted: list[int] = []
    accepted: list[int] = []
    for record in records:
        if record["drafted_per_position"] is None or record["accepted_per_position"] is None:
            continue
        for position, (d, a) in enumerate(zip(record["drafted_per_position"], record["accepted_per_position"])):
            if position == len(drafted):
                drafted.append(0)
                accepted.append(0)
            drafted[position] += d
            accepted[position] += a
    if not drafted:
        return None
    return [a / d if d else 0.0 for a, d in zip(accepted, drafted)]


def _add_speedups(stats: dict[str, Any], records: list[dict[str, Any]], method: str, reference: str | None,
                  category: str, reference_stats: dict[str, Any] | None) -> None:
    if reference is None:
        stats["speedup"] = stats["speedup_median_of_ratios"] = 1.0
        stats["decode_speedup"] = 1.0 if stats["decode_tokens_per_s"] else None
        return
    if not reference_stats or not reference_stats["tokens_per_s"]:
        return
    stats["speedup"] = stats["tokens_per_s"] / reference_stats["tokens_per_s"]
    if stats["decode_tokens_per_s"] and reference_stats["decode_tokens_per_s"]:
        stats["decode_speedup"] = stats["decode_tokens_per_s"] / reference_stats["decode_tokens_per_s"]
    mine = per_prompt_tokens_per_s(_select(records, method, category))
    theirs = per_prompt_tokens_per_s(_select(records, reference, category))
    ratios = [mine[key] / theirs[key] for key in mine if theirs.get(key)]
    stats["speedup_median_of_ratios"] = statistics.median(ratios) if ratios else None


# ---- outputs ------------------------------------------------------------------------------------------------

def write_outputs(results: dict[str, Any], out: Path, plots: bool = True) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "results.json", out / "results.md"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    md_path.write_text(markdown(results))
    written = [json_path, md_path]
    if plots:
        written += write_plots(results, out)
    return written


def _fmt(value: Any, pattern: str) -> str:
    return "–" if value is None else format(value, pattern)


def _table(results: dict[str, Any], key: str, pattern: str, suffix: str = "") -> str:
    categories = results["categories"]
    lines = ["| method | " + " | ".join(categories) + " |", "|---" * (len(categories) + 1) + "|"]
    for method, per_category in results["summary"].items():
        cells = [_fmt(per_category[c][key], pattern) + (suffix if per_category[c][key] is not None else "")
                 for c in categories]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def speedup_table(results: dict[str, Any]) -> str:
    return _table(results, "speedup", ".2f", "x")


def markdown(results: dict[str, Any]) -> str:
    meta = results["metadata"]
    n_prompts = results["summary"][next(iter(results["summary"]))][OVERALL]["n_prompts"]
    sections = [
        f"# specdec bench: {meta['model']}",
        f"{n_prompts} prompts from {', '.join(Path(d).name for d in meta['datasets'])}; greedy, batch 1, "
        f"max {meta['max_new_tokens']} new tokens, {meta['repeats']} round(s); {meta['threads']} threads, "
        f"weights {meta['weight_format']}, torch {meta['torch_version']}, device {meta['device']}"
        f"{_kernels_text(meta)}.",
        "## Speed-up over the reference\n\nRatio of median tok/s (ours over `none`, peers over their own plain "
        "row).\n\n" + speedup_table(results),
        "## Tokens per second\n\nMedian over prompts of new tokens / wall time (prefill included).\n\n"
        + _table(results, "tokens_per_s", ".1f"),
        "## Decode phase\n\nSpeed-up and tok/s of the decode phase alone: new tokens after the first / (wall time "
        "- time to the first token), medians over prompts; the time to the first token (prefill + first step) "
        'is left out, as engines that report an "eval" speed do. `-` where a runner reports no first-token time.\n\n'
        + _table(results, "decode_speedup", ".2f", "x")
        + "\n\n"
        + _table(results, "decode_tokens_per_s", ".1f")
        + "\n\nMedian time to the first token (s):\n\n"
        + _table(results, "ttft_s", ".2f"),
        "## Acceptance rate α\n\naccepted / drafted tokens.\n\n" + _table(results, "acceptance_rate", ".2f"),
        "## Mean accepted length τ\n\nTokens emitted per verify step (1 + accepted / steps).\n\n"
        + _table(results, "mean_accepted_length", ".2f"),
        "## Identical to the reference\n\n" + _table(results, "identical_rate", ".0%"),
        "## Lossless check\n\n" + _mismatch_text(results),
    ]
    return "\n\n".join(sections) + "\n"


def _kernels_text(meta: dict[str, Any]) -> str:
    """", kernel path avx512" (and the warning of a slow path); empty for results written before it was recorded."""
    if "kernel_isa" not in meta:
        return ""
    warning = f" (**{meta['kernel_warning']}**)" if meta.get("kernel_warning") else ""
    variant = " with AVX-VNNI" if meta.get("kernel_avx_vnni") else ""
    return f", kernel path {meta['kernel_isa']}{variant}{warning}"


def _mismatch_text(results: dict[str, Any]) -> str:
    if not results["mismatches"]:
        return "Every output equals its reference's output token for token."
    lines = ["| method | reference | question | turn | round | first differing token | reference -> method |",
             "|---|---|---|---|---|---|---|"]
    for m in results["mismatches"]:
        strict = "" if m["strict"] else " (peer, reported only)"
        lines.append(
            f"| {m['method']}{strict} | {m['reference']} | {m['dataset']}/{m['question_id']} | "
            f"{m['turn'] + 1} | {m['round']} | {m['first_mismatch']} | {m['reference_token']} -> {m['token']} |"
        )
    return "\n".join(lines)


# ---- plots --------------------------------------------------------------------------------------------------

def write_plots(results: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, draw in (("speedup.png", plot_speedup), ("acceptance_by_position.png", plot_position_acceptance),
                       ("tokens_per_s.png", plot_tokens_per_s)):
        figure = draw(results, plt)
        path = out / name
        figure.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(figure)
        paths.append(path)
    return paths


def _speculative_methods(results: dict[str, Any]) -> list[str]:
    return [runner["label"] for runner in results["runners"] if runner["reference"] is not None]


def plot_speedup(results: dict[str, Any], plt):
    methods, categories = _speculative_methods(results), results["categories"]
    figure, axes = plt.subplots(figsize=(max(6.0, 0.6 * len(categories) * max(1, len(methods)) + 2), 4.5))
    width = 0.8 / max(1, len(methods))
    for index, method in enumerate(methods):
        values = [results["summary"][method][c]["speedup"] or 0.0 for c in categories]
        positions = [c + (index - (len(methods) - 1) / 2) * width for c in range(len(categories))]
        bars = axes.bar(positions, values, width, label=method)
        axes.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    axes.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    axes.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    axes.set_ylabel("speed-up over reference (×)")
    axes.set_title(f"Speed-up per category — {Path(results['metadata']['model']).name}")
    if methods:
        axes.legend(fontsize=8)
    return figure


def plot_position_acceptance(results: dict[str, Any], plt):
    figure, axes = plt.subplots(figsize=(6.5, 4.5))
    plotted = False
    for method in _speculative_methods(results):
        rates = results["summary"][method][OVERALL]["position_acceptance_rates"]
        if rates:
            axes.plot(range(1, len(rates) + 1), rates, marker="o", label=method)
            plotted = True
    axes.set_xlabel("draft position")
    axes.set_ylabel("acceptance rate at position")
    axes.set_ylim(0, 1.05)
    axes.set_title("Acceptance by draft position (all prompts)")
    if plotted:
        axes.legend(fontsize=8)
    else:
        axes.text(0.5, 0.5, "no per-position counters", ha="center", va="center", transform=axes.transAxes)
    return figure


def plot_tokens_per_s(results: dict[str, Any], plt):
    methods = [runner["label"] for runner in results["runners"]]
    per_method = [list(per_prompt_tokens_per_s([r for r in results["records"] if r["method"] == m]).values())
                  for m in methods]
    figure, axes = plt.subplots(figsize=(max(6.0, 1.1 * len(methods) + 2), 4.5))
    axes.boxplot(per_method, showfliers=True)
    axes.set_xticks(range(1, len(methods) + 1), methods, rotation=30, ha="right")
    for index, method in enumerate(methods, start=1):
        median = results["summary"][method][OVERALL]["tokens_per_s"]
        axes.annotate(f"{median:.1f}", (index + 0.27, median), fontsize=8, va="center")
    axes.set_ylabel("tokens / s per prompt")
    axes.set_title(f"Tokens/s per prompt — {Path(results['metadata']['model']).name} (median annotated)")
    return figure
