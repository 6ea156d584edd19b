"""The fortieth session's rule for taking ``changepoint_budget`` 0.0005, checked on the results files.

Given the runs at 0.0005 (``--candidate``, seeds 0–9) and at 0.0002 (``--baseline``, the same seeds) and which of
the candidate runs are the held-out ones (``--new``), it prints each part of the rule written in this folder's
README before seeds 6–9 were run, and whether it holds:

1. pooled over every candidate run, every cell outside the 18 the README documents as beyond every detector shown
   reaches ≥ 99.9 %;
2. in every condition of each held-out candidate run, false quarantines of unique clean rows ≤ 0.1 % and flagged
   judgements of resampled clean rows ≤ 0.1 %;
3. no cell at the goal pooled over the baseline runs falls below it pooled over the candidate runs.

    python benchmarks/results-2026-12-05-fortieth/check_rule.py \\
        --candidate A.json --candidate B.json ... --baseline C.json ... --new A.json ...
"""

import sys
from pathlib import Path

import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.fidelity_kit.results_file import read_results  # noqa: E402
from benchmarks.fidelity_kit.score import GOAL_FALSE_RATE, GOAL_RECALL, wilson  # noqa: E402

TAILS = ("+tail_dense7b", "+tail_hybrid7b")


def documented(condition: str, fault: str) -> bool:
    """The 18 cells the README documents as beyond every detector shown at ≤ 0.1 % of clean rows flagged."""
    stream, _, setting = condition.partition("/")
    return (fault == "real_stale_weights"
            or (fault == "isolated_spikes" and setting in TAILS)
            or (stream == "h200-hybrid" and fault == "real_context_swap" and setting in TAILS)
            or (stream == "h200-hybrid" and fault == "real_late_onset" and setting == "+tail_hybrid7b")
            or (stream == "h200-hybrid-seed1" and fault == "late_onset" and setting == "+tail_hybrid7b"))


def pooled(runs: list[Path]) -> dict[tuple[str, str], list[int]]:
    """(condition, fault) → [caught, rows] summed over the runs."""
    cells: dict[tuple[str, str], list[int]] = {}
    for run in runs:
        for result in read_results(run)["results"]:
            for fault, figures in result["figures"].items():
                if fault != "clean":
                    cell = cells.setdefault((result["condition"], fault), [0, 0])
                    cell[0] += figures["caught"]
                    cell[1] += figures["rows"]
    return cells


def reached(caught: int, rows: int) -> bool:
    """A cell at the goal, as :func:`benchmarks.fidelity_kit.score.figures` passes it."""
    return caught / max(rows, 1) >= GOAL_RECALL


def show(cell: tuple[str, str], caught: int, rows: int) -> str:
    low, high = wilson(caught, rows)
    return (f"{cell[0]} {cell[1]}: {caught:,} of {rows:,} = {100 * caught / rows:.3f} % "
            f"[{100 * low:.3f}, {100 * high:.3f}], {rows - caught} missed")


def main(candidate: list[Path] = typer.Option(..., help="runs at the candidate budget, every seed"),
         baseline: list[Path] = typer.Option(..., help="runs at the default budget, the same seeds"),
         new: list[Path] = typer.Option(..., help="the candidate runs of the held-out seeds")) -> None:
    ours, theirs = pooled(candidate), pooled(baseline)

    below = {cell: v for cell, v in ours.items() if v[1] and not reached(*v)}
    undocumented = {cell: v for cell, v in below.items() if not documented(*cell)}
    print(f"1. pooled over {len(candidate)} candidate runs: {len(below)} cells below the goal, "
          f"{len(undocumented)} of them outside the 18 documented")
    for cell, (caught, rows) in sorted(ours.items()):
        if cell in below or cell[1] == "late_onset" and cell[0].endswith("+tail_hybrid7b"):
            mark = "  (documented)" if documented(*cell) else ""
            print("   ", show(cell, caught, rows) + mark)
    first = not undocumented

    second = True
    print(f"2. false side of the {len(new)} held-out candidate runs (worst condition):")
    for run in new:
        clean = {r["condition"]: r["figures"]["clean"] for r in read_results(run)["results"]}
        worst_false = max(clean.items(), key=lambda item: item[1]["false_rate"])
        worst_resampled = max(clean.items(),
                              key=lambda item: item[1]["resampled"]["false"] / max(item[1]["resampled"]["judged"], 1))
        resampled = worst_resampled[1]["resampled"]
        share = resampled["false"] / max(resampled["judged"], 1)
        print(f"    {run.name}: false {100 * worst_false[1]['false_rate']:.3f} % ({worst_false[0]}), "
              f"flagged resampled {resampled['false']} of {resampled['judged']:,} = {100 * share:.3f} % "
              f"({worst_resampled[0]})")
        second &= worst_false[1]["false_rate"] <= GOAL_FALSE_RATE and share <= GOAL_FALSE_RATE

    lost = [cell for cell, (caught, rows) in theirs.items()
            if rows and reached(caught, rows) and not reached(*ours[cell])]
    print(f"3. cells at the goal at the baseline and below it at the candidate: {len(lost)}")
    for cell in lost:
        print("   ", show(cell, *theirs[cell]), "→", show(cell, *ours[cell]))
    third = not lost

    print(f"\nthe rule {'holds' if first and second and third else 'does not hold'}: "
          f"1 {'yes' if first else 'no'}, 2 {'yes' if second else 'no'}, 3 {'yes' if third else 'no'}")


if __name__ == "__main__":
    typer.run(main)
