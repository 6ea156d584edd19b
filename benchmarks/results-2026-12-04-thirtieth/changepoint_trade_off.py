"""What the goal costs the change-point test in the cells where the guard misses late onset: its trade-off curve.

The two late-onset cells below the goal (the hybrid-7B tail model in the llama and hybrid-seed1 streams) are the
only ones of the guard's 19 where a detector was shown to do better than per-token rarity: the change-point
likelihood-ratio test of ``../results-2026-12-03-twentyeighth/changepoint_every_condition.py`` (noise learned per
0.25-nat engine bin, generic lag). The README gives every other cell's trade-off curve (the hindsight oracle's,
``separability.py``); for these two the oracle is below the guard, so it is this test's curve that says what
reaching 99.9 % would cost.

Per condition (default: the three hybrid-7B tail conditions), cross-fitted as ``changepoint_every_condition.py``:
the clean rows split in two at random, the noise learned on one half (per sampling setting), the threshold read at
that half's q point for each budget q (the ``int(q · n)``-th highest score, 0-based), and the other half counted
(its clean rows and ``--faults`` / 2 late-onset rows made from its rows, and half the condition's real late-onset
rows); then the halves swapped. Counts summed over both halves; 95 % Wilson intervals.

    python benchmarks/results-2026-12-04-thirtieth/changepoint_trade_off.py [--seed 1] [--faults 4000]
"""

from __future__ import annotations

import glob
import sys
from pathlib import Path

import torch
import typer

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent / "results-2026-12-03-twentyeighth"))

import changepoint_every_condition as cp  # noqa: E402

from benchmarks.fidelity import DEFAULT_DATA, conditions  # noqa: E402
from benchmarks.fidelity_kit import zoo  # noqa: E402
from benchmarks.fidelity_kit.rollouts import read_tables  # noqa: E402
from benchmarks.fidelity_kit.score import wilson  # noqa: E402

BUDGETS = (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03)  # shares of clean rows the threshold lets through

app = typer.Typer(add_completion=False)


def thresholds(scores: torch.Tensor, budgets: tuple[float, ...]) -> torch.Tensor:
    """(len(budgets),) the score above which each budget's share of ``scores`` lies: the ``int(q · n)``-th highest.

    >>> thresholds(torch.arange(1000.0), (0.001, 0.01)).tolist()
    [998.0, 989.0]
    """
    ranked = scores.sort(descending=True).values
    return ranked[[min(int(q * len(scores)), len(scores) - 1) for q in budgets]]


@app.command()
def main(data: str = typer.Option(DEFAULT_DATA, help="as benchmarks/fidelity.py"), seed: int = typer.Option(0),
         faults: int = typer.Option(4000, help="late-onset rows per condition"),
         only: str = typer.Option("tail_hybrid7b", help="score the conditions whose name contains this")) -> None:
    paths = sorted(glob.glob(data))
    if not paths:
        raise typer.BadParameter(f"--data {data!r} matches no file")
    generator = torch.Generator().manual_seed(seed + 2027)
    print(f"seed {seed}; {faults} late-onset rows per condition; noise learned per setting; cross-fitted\n")
    print("| condition | budget | clean flagged | late onset caught | real late onset caught |")
    print("| --- | --- | --- | --- | --- |")
    scored_any = False
    for name, clean, real, apply, _ in conditions(read_tables(paths), seed, 256, True):
        if only not in name:
            continue
        scored_any = True
        order = torch.randperm(len(clean), generator=generator)
        halves = (order[: len(clean) // 2], order[len(clean) // 2:])
        real_rows = real.get("real_late_onset")
        flagged = torch.zeros(len(BUDGETS), dtype=torch.long)
        caught, real_caught = torch.zeros_like(flagged), torch.zeros_like(flagged)
        counted = [0, 0, 0]  # clean, late onset, real late onset rows
        for side, (fit_index, held_index) in enumerate((halves, halves[::-1])):
            fit = apply(clean.rows(fit_index))
            noise = cp.learned_by_setting(fit, True)
            point = thresholds(cp.scored(fit, noise, 0.0), BUDGETS)
            held = clean.rows(held_index)
            scores = cp.scored(apply(held), noise, 0.0)
            flagged += (scores[:, None] > point).sum(0)
            index = torch.randint(0, len(held), (faults // 2,), generator=generator)
            late = cp.scored(apply(zoo.late_onset(held.rows(index), generator)), noise, 0.0)
            caught += (late[:, None] > point).sum(0)
            counted[0], counted[1] = counted[0] + len(scores), counted[1] + len(late)
            if real_rows is not None:
                part = real_rows.rows(torch.arange(side, len(real_rows), 2))
                real_caught += (cp.scored(apply(part), noise, 0.0)[:, None] > point).sum(0)
                counted[2] += len(part)
        for q, false, hit, real_hit in zip(BUDGETS, flagged.tolist(), caught.tolist(), real_caught.tolist(),
                                           strict=True):
            low, high = wilson(false, counted[0])
            rlow, rhigh = wilson(hit, counted[1])
            real_cell = f"{real_hit} of {counted[2]}" if counted[2] else "–"
            print(f"| {name} | {100 * q:g} % | {false} of {counted[0]} ({100 * false / counted[0]:.3f} % "
                  f"[{100 * low:.3f}, {100 * high:.3f}]) | {hit} of {counted[1]} ({100 * hit / counted[1]:.2f} % "
                  f"[{100 * rlow:.2f}, {100 * rhigh:.2f}]) | {real_cell} |", flush=True)
    if not scored_any:
        raise typer.BadParameter(f"--only {only!r} matches no condition")


if __name__ == "__main__":
    app()
