"""Recall per fault kind and false quarantines per noise condition, pooled over several fidelity runs (seeds).

Each cell: caught / rows summed over the runs, in %, ✗ where below the goal (``GOAL_RECALL``); the false column:
unique clean rows quarantined of those judged, in %, with the 95 % Wilson interval. Run on this folder's ten runs at
0.1 % faults it prints ``per-condition-share0.001.md``.

    python benchmarks/results-2026-12-05-fortyfirst/per_condition.py RUN.json[.gz] ...
"""

import sys
from pathlib import Path

import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.fidelity_kit.results_file import read_results  # noqa: E402
from benchmarks.fidelity_kit.score import GOAL_RECALL, wilson  # noqa: E402

SHORT = {"confident_gibberish": "gibberish", "isolated_spikes": "1–3 spikes", "late_onset": "late onset",
         "moderate_confidence": "moderate", "nonfinite": "NaN/±inf", "real_context_swap": "real swaps",
         "real_late_onset": "real late onset", "real_stale_weights": "real stale weights",
         "single_spike": "one spike", "truncated_gibberish": "truncated"}


def main(runs: list[Path]) -> None:
    cells: dict[str, dict[str, list[int]]] = {}
    for run in runs:
        for result in read_results(run)["results"]:
            row = cells.setdefault(result["condition"], {})
            for fault, figures in result["figures"].items():
                pair = row.setdefault(fault, [0, 0])
                if fault == "clean":
                    pair[0] += figures["false"]
                    pair[1] += figures["rows"]
                else:
                    pair[0] += figures["caught"]
                    pair[1] += figures["rows"]
    faults = sorted({fault for row in cells.values() for fault in row if fault != "clean"})
    print(f"Pooled over {len(runs)} runs. Recall in % (✗ below the goal); false quarantines of unique clean rows.\n")
    print("| condition | false (95 % CI) | " + " | ".join(SHORT.get(f, f) for f in faults) + " |")
    print("|" + " --- |" * (2 + len(faults)))
    for condition, row in cells.items():
        false, clean = row["clean"]
        low, high = wilson(false, clean)
        out = [f"{false} of {clean:,} = {100 * false / clean:.3f} % [{100 * low:.3f}, {100 * high:.3f}]"]
        for fault in faults:
            if fault not in row or not row[fault][1]:
                out.append("–")
                continue
            caught, rows = row[fault]
            mark = "" if caught / rows >= GOAL_RECALL else " ✗"
            out.append(f"{100 * caught / rows:.3f}{mark}")
        print(f"| {condition} | " + " | ".join(out) + " |")


if __name__ == "__main__":
    typer.run(main)
