"""The hybrid-7B-tail late-onset cells over several seeds' fidelity runs, pooled, beside each run's false side.

For each results JSON (``benchmarks/fidelity.py --out``): the late-onset rows caught in the three hybrid-7B-tail
conditions, the false quarantines of unique clean rows (all conditions; the worst condition's share) and the flagged
judgements of resampled healthy rows (worst condition's share); then, per stream, the rows caught over all the
files given, with a 95 % Wilson interval. Meant for runs of one budget over several seeds.

    python benchmarks/results-2026-12-04-thirtyfifth/pool_seeds.py RUN.json [RUN.json ...]
"""

import sys
from pathlib import Path

import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.fidelity_kit.results_file import read_results  # noqa: E402
from benchmarks.fidelity_kit.score import wilson  # noqa: E402

STREAMS = ("h200-hybrid", "h200-hybrid-seed1", "h200-llama")
TAIL = "+tail_hybrid7b"


def main(runs: list[Path]) -> None:
    pooled = {stream: [0, 0] for stream in STREAMS}
    print("| run | late onset caught, hybrid / hybrid-seed1 / llama | false of clean rows (worst) "
          "| flagged resampled judgements (worst) |")
    print("| --- | --- | --- | --- |")
    for run in runs:
        figures = {r["condition"]: r["figures"] for r in read_results(run)["results"]}
        caught = []
        for stream in STREAMS:
            cell = figures[f"{stream}/{TAIL}"]["late_onset"]
            caught.append(f"{cell['caught']:,}")
            pooled[stream][0] += cell["caught"]
            pooled[stream][1] += cell["rows"]
        clean = [f["clean"] for f in figures.values()]
        false, rows = sum(c["false"] for c in clean), sum(c["rows"] for c in clean)
        flagged = sum(c["resampled"]["false"] for c in clean)
        judged = sum(c["resampled"]["judged"] for c in clean)
        worst = max(c["false_rate"] for c in clean)
        worst_resampled = max(c["resampled"]["false"] / max(c["resampled"]["judged"], 1) for c in clean)
        print(f"| {run.name} | {' / '.join(caught)} | {false} of {rows:,} ({100 * worst:.3f} %) "
              f"| {flagged} of {judged:,} ({100 * worst_resampled:.3f} %) |")
    print()
    for stream, (caught, rows) in pooled.items():
        low, high = wilson(caught, rows)
        print(f"{stream} pooled: {caught:,} of {rows:,} = {100 * caught / rows:.3f} % "
              f"[{100 * low:.3f}, {100 * high:.3f}], {rows - caught} missed")


if __name__ == "__main__":
    typer.run(main)
