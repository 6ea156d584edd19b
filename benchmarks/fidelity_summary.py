"""One line per `fidelity.py` results file, side by side, and the cells below the goal: what the README quotes.

Reads the JSON files `benchmarks/fidelity.py` writes (no engine, no model; a second each) and prints, as Markdown,
one row per file: its seed, faults per condition and stitch, rows missed per fault kind summed over the 27
conditions, false quarantines of unique clean rows (and the worst condition's share), flagged judgements of
resampled clean rows (and the worst condition's share) and cells at the goal; then, with ``--below``, every cell
of the first file that is below the goal (≥ 99.9 % recall, ≤ 0.1 % false) with its count.

    python benchmarks/fidelity_summary.py runs/fidelity/results-defaults.json runs/fidelity-seed1/results-defaults.json --below
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fidelity_kit.results_file import read_results  # noqa: E402

KINDS = ("late_onset", "isolated_spikes", "single_spike", "moderate_confidence", "confident_gibberish", "nonfinite",
         "truncated_gibberish", "real_context_swap", "real_late_onset")


def summary(results: dict) -> dict[str, object]:
    """Totals of one results file: rows missed per kind, false quarantines, flagged resampled judgements, cells."""
    missed = dict.fromkeys(KINDS, 0)
    cells = passed = false = flagged = 0
    worst_false = worst_flagged = 0.0
    for condition in results["results"]:
        for kind, figures in condition["figures"].items():
            if kind == "clean":
                false += figures["false"]
                worst_false = max(worst_false, figures["false_rate"])
                resampled = figures.get("resampled") or {}
                flagged += resampled.get("false", 0)
                worst_flagged = max(worst_flagged, resampled.get("false_rate", 0.0))
                continue
            cells += 1
            passed += bool(figures["pass"])
            if kind in missed:
                missed[kind] += figures["rows"] - figures["caught"]
    return {"seed": results["seed"], "faults": results["faults_per_condition"], "stitch": results["stitch"],
            "missed": missed, "false": false, "worst_false": worst_false, "flagged": flagged,
            "worst_flagged": worst_flagged, "cells": passed, "of": cells}


def below_goal(results: dict) -> list[tuple[str, str, int, int]]:
    """(condition, kind, caught, rows) of every cell below the goal."""
    return [(condition["condition"], kind, figures["caught"], figures["rows"])
            for condition in results["results"] for kind, figures in condition["figures"].items()
            if kind != "clean" and not figures["pass"]]


def main(results: list[Path] = typer.Argument(..., help="results JSON files of benchmarks/fidelity.py"),
         below: bool = typer.Option(False, help="also list the first file's cells below the goal")) -> None:
    """Print the files' totals side by side as a Markdown table (and, with --below, the first file's cells below
    the goal)."""
    loaded = [read_results(path) for path in results]
    summaries = [summary(r) for r in loaded]
    shown = [kind for kind in KINDS if any(s["missed"][kind] for s in summaries)]
    print("| file | seed | faults | stitch | " + " | ".join(f"{k} missed" for k in shown)
          + " | false (worst) | flagged resampled (worst) | cells at the goal |")
    print("| --- " * (7 + len(shown)) + "|")
    for path, s in zip(results, summaries, strict=True):
        print(f"| {path.name} | {s['seed']} | {s['faults']:,} | {s['stitch']} | "
              + " | ".join(f"{s['missed'][k]:,}" for k in shown)
              + f" | {s['false']} ({100 * s['worst_false']:.3f} %) | {s['flagged']} ({100 * s['worst_flagged']:.3f} %)"
              f" | {s['cells']} of {s['of']} |")
    if below:
        print(f"\nBelow the goal in {results[0].name}:\n")
        for condition, kind, caught, rows in below_goal(loaded[0]):
            print(f"* {condition} {kind}: {caught:,} of {rows:,} ({100 * caught / rows:.2f} %)")


if __name__ == "__main__":
    typer.run(main)
