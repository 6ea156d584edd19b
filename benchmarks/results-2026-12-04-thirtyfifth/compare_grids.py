"""Late onset caught by the change-point test at the same share of held-out clean rows flagged, 0.25-nat bins
against the guard's four buckets, summed over seeds: reads ``trade_off_fine_grid.py``'s tables
(``grid-13-bins-seed*.md``, ``grid-guard-buckets-seed*.md`` beside this file). For each share F, a curve's figure is
the most late-onset rows caught at a grid point that flags at most F of the held-out clean rows.

    python benchmarks/results-2026-12-04-thirtyfifth/compare_grids.py
"""

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from benchmarks.fidelity_kit.score import wilson  # noqa: E402

SHARES = (0.00025, 0.0005, 0.001)
ROW = re.compile(r"\| (\S+) \| [\d.]+ % \| (\d+) of (\d+) .*?\| (\d+) of (\d+) \(")


def curves(path: Path) -> dict[str, list[tuple[int, int, int, int]]]:
    """condition → [(clean flagged, clean rows, late onset caught, late onset rows)] per grid point."""
    found: dict[str, list[tuple[int, int, int, int]]] = {}
    for line in path.read_text().splitlines():
        match = ROW.match(line)
        if match:
            found.setdefault(match[1], []).append(tuple(int(match[k]) for k in range(2, 6)))
    return found


def main() -> None:
    seeds = sorted(int(p.stem.rsplit("seed", 1)[1]) for p in HERE.glob("grid-13-bins-seed*.md")
                   if (HERE / f"grid-guard-buckets-seed{p.stem.rsplit('seed', 1)[1]}.md").exists())
    totals: dict[tuple[str, float], list[int]] = {}  # caught with bins, with buckets, late-onset rows, seeds
    for seed in seeds:
        fine, guard = (curves(HERE / f"grid-{kind}-seed{seed}.md") for kind in ("13-bins", "guard-buckets"))
        for condition in fine:
            for share in SHARES:
                best = [max((caught for flagged, clean, caught, _ in points if flagged <= share * clean), default=None)
                        for points in (fine[condition], guard[condition])]
                if None in best:  # a curve with no grid point that flags this few: the seed is left out here
                    continue
                cell = totals.setdefault((condition, share), [0, 0, 0, 0])
                cell[0] += best[0]
                cell[1] += best[1]
                cell[2] += fine[condition][0][3]
                cell[3] += 1
    print(f"seeds {seeds}; late onset caught at ≤ the share of held-out clean rows flagged (95 % Wilson), summed "
          "over the seeds where both curves have a grid point that flags that few\n")
    print("| condition | clean flagged at most | seeds | 0.25-nat bins | the guard's four buckets |")
    print("| --- | --- | --- | --- | --- |")
    for (condition, share), (fine_caught, guard_caught, rows, used) in sorted(totals.items()):
        cells = []
        for caught in (fine_caught, guard_caught):
            low, high = wilson(caught, rows)
            cells.append(f"{caught:,} of {rows:,} ({100 * caught / rows:.3f} % [{100 * low:.2f}, {100 * high:.2f}])")
        print(f"| {condition} | {100 * share:g} % | {used} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
