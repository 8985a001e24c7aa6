"""Draws the plots the docs link, from the figures committed beside them.

    .venv/bin/python scripts/plot_docs.py [--check]

Every docs/plots/data/NAME.json describes one figure and becomes docs/plots/NAME.png. A description holds the
figures of a table the docs keep (under "Current results" in docs/benchmarks.md), where they come from ("source":
date, CPU, command, commit), the doc section that shows them ("doc"), and one or more panels:

    {"kind": "bars" | "lines",
     "x": [...],                      categories (bars) or x values (lines)
     "series": {"label": [...]},      one value per x; null leaves a gap
     "ylabel": "...", "xlabel": "...",
     "reference": 1.0,                optional dashed horizontal line (a speed-up of 1)
     "log2x": true,                   optional (lines): x on a log2 axis, ticks at the given x
     "wide": true}                    optional (bars): a wide figure for many categories

--check also fails when a PNG in docs/plots has no description (a plot left over from removed figures) or a
description's PNG is linked by no doc.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLOTS = ROOT / "docs" / "plots"
DATA = PLOTS / "data"


def load_descriptions() -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(DATA.glob("*.json"))}


def draw_bars(ax, panel: dict) -> None:
    x = panel["x"]
    series = panel["series"]
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        positions = [j + (i - (len(series) - 1) / 2) * width for j in range(len(x))]
        shown = [(p, v) for p, v in zip(positions, values) if v is not None]
        bars = ax.bar([p for p, _ in shown], [v for _, v in shown], width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
    ax.set_xticks(range(len(x)))
    ax.set_xticklabels(x, rotation=30 if panel.get("wide") else 0, ha="right" if panel.get("wide") else "center")


def draw_lines(ax, panel: dict) -> None:
    x = panel["x"]
    for label, values in panel["series"].items():
        ax.plot(x, [float("nan") if v is None else v for v in values], marker="o", label=label)
    if panel.get("log2x"):
        ax.set_xscale("log", base=2)
        ax.set_xticks(x)
        ax.set_xticklabels([str(v) for v in x])


def draw(name: str, description: dict, plt) -> Path:
    panels = description["panels"]
    wide = any(panel.get("wide") for panel in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(14 if wide else max(8, 6 * len(panels)), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        {"bars": draw_bars, "lines": draw_lines}[panel["kind"]](ax, panel)
        if panel.get("reference") is not None:
            ax.axhline(panel["reference"], color="black", linestyle="--", linewidth=0.8)
        ax.set_ylabel(panel.get("ylabel", ""))
        ax.set_xlabel(panel.get("xlabel", ""))
        top = max(v for values in panel["series"].values() for v in values if v is not None)
        ax.set_ylim(0, top * 1.2)  # room for the legend above the bars
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", ncol=len(panel["series"]))
    fig.suptitle(description["title"], fontsize=11)
    fig.tight_layout()
    out = PLOTS / f"{name}.png"
    fig.savefig(out, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return out


def linked_plots() -> set[str]:
    """Names of the PNGs under docs/plots/ that some doc (docs/*.md, README.md) links."""
    texts = [path.read_text() for path in sorted((ROOT / "docs").glob("*.md"))]
    readme = ROOT / "README.md"
    if readme.exists():
        texts.append(readme.read_text())
    return {path.stem for path in PLOTS.glob("*.png") if any(f"plots/{path.name}" in text for text in texts)}


def check(descriptions: dict[str, dict]) -> list[str]:
    problems = [f"docs/plots/{path.name}: no description in docs/plots/data/ (remove it, or describe its figures)"
                for path in sorted(PLOTS.glob("*.png")) if path.stem not in descriptions]
    linked = linked_plots()
    problems += [f"docs/plots/{name}.png: linked by no doc" for name in descriptions if name not in linked]
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="also fail on unlinked or undescribed plots")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    descriptions = load_descriptions()
    for name, description in descriptions.items():
        print(draw(name, description, plt).relative_to(ROOT))
    if args.check:
        problems = check(descriptions)
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
