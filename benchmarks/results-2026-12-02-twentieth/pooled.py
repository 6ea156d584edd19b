"""Pooled figures of fidelity.py result files side by side: per fault, missed of judged with the recall's Wilson 95 %
interval and the cells at >= 99.9 %; false quarantines and flagged resampled judgements with the worst condition.

    python pooled.py A.json B.json ...
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.fidelity_kit.results_file import read_results  # noqa: E402
from benchmarks.fidelity_kit.score import wilson  # noqa: E402


def pooled(path):
    run = read_results(path)
    faults, clean = {}, dict(false=0, rows=0, worst=0.0, resampled=0, judged=0, worst_resampled=0.0)
    for result in run["results"]:
        for kind, f in result["figures"].items():
            if kind == "clean":
                clean["false"] += f["false"]
                clean["rows"] += f["rows"]
                clean["worst"] = max(clean["worst"], f["false_rate"])
                again = f["resampled"]
                clean["resampled"] += again["false"]
                clean["judged"] += again["judged"]
                clean["worst_resampled"] = max(clean["worst_resampled"], again["false"] / max(again["judged"], 1))
                continue
            total = faults.setdefault(kind, dict(caught=0, rows=0, cells=0, at_goal=0))
            total["caught"] += f["caught"]
            total["rows"] += f["rows"]
            total["cells"] += 1
            total["at_goal"] += f["recall"] >= run["goal"]["recall"]
    return run, faults, clean


def main(paths):
    runs = [pooled(p) for p in paths]
    print("| fault | " + " | ".join(Path(p).stem for p in paths) + " |")
    print("| --- |" + " --- |" * len(paths))
    for kind in sorted(runs[0][1]):
        cells = []
        for _, faults, _ in runs:
            t = faults[kind]
            low, high = wilson(t["caught"], t["rows"])
            cells.append(f"{t['rows'] - t['caught']:,} of {t['rows']:,} ({100 * t['caught'] / t['rows']:.3f} % "
                         f"[{100 * low:.2f}, {100 * high:.2f}]; {t['at_goal']} of {t['cells']} cells)")
        print(f"| {kind} | " + " | ".join(cells) + " |")
    print("| false quarantines | " + " | ".join(
        f"{c['false']} of {c['rows']:,} (worst {100 * c['worst']:.3f} %)" for _, _, c in runs) + " |")
    print("| flagged resampled judgements | " + " | ".join(
        f"{c['resampled']} of {c['judged']:,} (worst {100 * c['worst_resampled']:.3f} %)" for _, _, c in runs) + " |")
    print("| cells at the goal | " + " | ".join(
        str(sum(t["at_goal"] for t in f.values())) + f" of {sum(t['cells'] for t in f.values())}"
        for _, f, _ in runs) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
