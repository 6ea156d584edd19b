"""How far could any detector get on the fidelity benchmark's cells? A hindsight bound, per fault and condition.

For each noise condition of ``benchmarks/fidelity.py`` (same data, same seed, same faults), every token gets a
*rarity* under that condition's own clean tokens:

.. math:: s = -\\ln \\frac{1 + \\#\\{\\text{clean tokens in the same cell with } |d'| \\ge |d|\\}}{1 + N}

with the cell the token's (engine logprob bin, trainer logprob bin, sign of d) — bins at −6, −3, −1.5, −0.5
nats — and N all clean tokens of the condition. A sample scores ``A = max s`` (its rarest token), ``B = Σ
relu(s − ln 100)`` and ``C = Σ relu(s − ln 1000)`` (many rare tokens). Thresholds are set *with hindsight* on
the condition's clean samples so that at most 0.1 % of them score above (one score alone, or two at 0.05 %
each), and the best recall over those choices is reported.

This is optimistic on purpose: the clean distribution is known in full before the first step, estimated on the
very samples it is then judged on, the thresholds see the labels, and no fault ever feeds it. A guard judges
online, learning the noise from a stream in which missed faults sit. So the bound says where the goal is *not*
out of reach of per-token evidence (bound ≥ 99.9 %): a guard below it there loses to its own online estimate,
not to the data. It is not an upper bound on every detector: rarity ignores direction and the order of tokens,
and in a few cells the guard's direction-aware CUSUM beats it.

    python benchmarks/separability.py --out benchmarks/results-fidelity
"""

from __future__ import annotations

import glob
import json
import math
import sys
import time
from pathlib import Path

import torch
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fidelity import DEFAULT_DATA, REPO, conditions, synthetic_faults  # noqa: E402
from benchmarks.fidelity_kit.rollouts import Rollouts, read_tables  # noqa: E402
from benchmarks.fidelity_kit.score import GOAL_FALSE_RATE, GOAL_RECALL  # noqa: E402

EDGES = torch.tensor([-6.0, -3.0, -1.5, -0.5])  # nats, for both sides' logprob bins
app = typer.Typer(add_completion=False)


def _cells(rollouts: Rollouts, trainer_bins: bool = True
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T) finite-and-compared flags, (B,) rows with a non-finite logprob, (B, T) cell index, (B, T) |d|.
    Without ``trainer_bins`` the cells are the engine's logprob bins and the sign of d only (as the guard buckets)."""
    compared = rollouts.mask & torch.isfinite(rollouts.engine) & torch.isfinite(rollouts.trainer)
    nonfinite = (rollouts.mask & ~compared).any(dim=-1)
    d = torch.where(compared, rollouts.engine - rollouts.trainer, 0.0)
    bins = len(EDGES) + 1
    cell = torch.bucketize(rollouts.engine.clamp(min=-1e9, max=0.0), EDGES) * bins
    if trainer_bins:
        cell = cell + torch.bucketize(rollouts.trainer.clamp(min=-1e9, max=0.0), EDGES)
    cell = cell * 2 + (d > 0).long()
    return compared, nonfinite, cell, d.abs()


class Rarity:
    """The clean tokens' |d| per cell, sorted: the joint tail probability of any token, by binary search."""

    def __init__(self, clean: Rollouts, trainer_bins: bool = True) -> None:
        self.trainer_bins = trainer_bins
        compared, _, cell, size = _cells(clean, trainer_bins)
        self.tokens = int(compared.sum())
        cell, size = cell[compared], size[compared]
        order = torch.argsort(cell.double() * 1e3 + size.double().clamp(max=999.0))  # by cell, then by |d|
        self.cell, self.size = cell[order], size[order]

    def scores(self, rollouts: Rollouts) -> dict[str, torch.Tensor]:
        """(B,) scores A, B, C of each sample (+inf with a non-finite logprob)."""
        compared, nonfinite, cell, size = _cells(rollouts, self.trainer_bins)
        key = self.cell.double() * 1e3 + self.size.double().clamp(max=999.0)
        # clean tokens of the same cell with |d'| ≥ |d|: end of the cell minus the first position at or above |d|
        end = torch.searchsorted(self.cell.contiguous(), cell.contiguous(), right=True)
        query = cell.double() * 1e3 + size.double().clamp(max=999.0)
        start = torch.searchsorted(key.contiguous(), query.contiguous())
        at_least = (end - start).clamp(min=0)
        rarity = torch.where(compared, -torch.log((at_least + 1.0) / (self.tokens + 1.0)), 0.0)
        out = {"A": rarity.amax(dim=-1), "B": (rarity - math.log(100)).clamp(min=0).sum(dim=-1),
               "C": (rarity - math.log(1000)).clamp(min=0).sum(dim=-1)}
        return {name: torch.where(nonfinite, math.inf, value) for name, value in out.items()}


def hindsight_threshold(clean: torch.Tensor, share: float) -> float:
    """The score above which at most ``share`` of the clean samples lie."""
    allowed = int(math.floor(share * clean.numel()))
    ranked = clean.sort(descending=True).values
    return float(ranked[allowed]) if allowed < clean.numel() else -math.inf


def best_recall(clean: dict[str, torch.Tensor], faulty: dict[str, torch.Tensor]) -> float:
    """The best recall at ≤ GOAL_FALSE_RATE false over one score or a pair at half the rate each."""
    best = 0.0
    for name in clean:
        threshold = hindsight_threshold(clean[name], GOAL_FALSE_RATE)
        best = max(best, float((faulty[name] > threshold).float().mean()))
    for first, second in (("A", "B"), ("A", "C")):
        t1 = hindsight_threshold(clean[first], GOAL_FALSE_RATE / 2)
        t2 = hindsight_threshold(clean[second], GOAL_FALSE_RATE / 2)
        if float(((clean[first] > t1) | (clean[second] > t2)).float().mean()) <= GOAL_FALSE_RATE:
            best = max(best, float(((faulty[first] > t1) | (faulty[second] > t2)).float().mean()))
    return best


def false_at_goal(clean: dict[str, torch.Tensor], faulty: dict[str, torch.Tensor]) -> float:
    """The smallest share of clean samples the oracle must flag to catch ``GOAL_RECALL`` of the faulty ones, over
    the scores one at a time: the threshold is the faulty scores' ``1 − GOAL_RECALL`` quantile (samples at or above
    it are flagged), the share that of the clean samples at or above it. The price of the goal in a cell the bound
    puts below it (one point of the trade-off curve)."""
    best = 1.0
    for name, scores in faulty.items():
        ranked = scores.sort().values
        threshold = ranked[int(math.floor((1 - GOAL_RECALL) * ranked.numel()))]
        best = min(best, float((clean[name] >= threshold).float().mean()))
    return best


@app.command()
def main(
    data: str = typer.Option(DEFAULT_DATA, help="glob of parquet files, as benchmarks/fidelity.py"),
    faults_per_condition: int = typer.Option(1000, help="rollouts per synthetic fault kind per condition"),
    step_rows: int = typer.Option(256, help="as benchmarks/fidelity.py (the noise models' tail rate uses it)"),
    seed: int = typer.Option(0),
    guard_results: Path = typer.Option(REPO / "benchmarks" / "results-fidelity" / "results-defaults.json",
                                       help="the guard's results beside which to print the bound (optional)"),
    out: Path = typer.Option(REPO / "benchmarks" / "results-fidelity", help="folder for separability.json/.md"),
    trainer_bins: bool = typer.Option(True, help="cells by both sides' logprob bins and the sign of d; off: by the "
                                      "engine's bins and the sign only, as the guard buckets (separability-engine.*)"),
    same_support: bool = typer.Option(False, help="the trainer on the engine's support, as benchmarks/fidelity.py "
                                      "--same-support (separability-support.*)"),
) -> None:
    paths = sorted(glob.glob(data))
    if not paths:
        raise typer.BadParameter(f"--data {data!r} matches no file: generate the data "
                                 "(benchmarks/fidelity_data/README.md)")
    started = time.perf_counter()
    table = read_tables(paths)
    generator = torch.Generator().manual_seed(seed)  # the same draws, in the same order, as benchmarks/fidelity.py
    guard = {}
    if guard_results.exists():
        guard = {r["condition"]: r["figures"] for r in json.loads(guard_results.read_text())["results"]}
    bound: dict[str, dict[str, float]] = {}
    price: dict[str, dict[str, float]] = {}  # false share the oracle needs for the goal, where the bound is below
    for name, clean, real_faults, apply, _ in conditions(table, seed, step_rows, same_support):
        faulty = {key: apply(rows) for key, rows in
                  {**synthetic_faults(clean, faults_per_condition, generator), **real_faults}.items()}
        clean = apply(clean)  # once, after the faults, as benchmarks/fidelity.py draws it
        rarity = Rarity(clean, trainer_bins)
        clean_scores = rarity.scores(clean)
        scored = {fault: rarity.scores(rows) for fault, rows in sorted(faulty.items())}
        bound[name] = {fault: best_recall(clean_scores, scores) for fault, scores in scored.items()}
        price[name] = {fault: false_at_goal(clean_scores, scores) for fault, scores in scored.items()
                       if bound[name][fault] < GOAL_RECALL}
        print(name, {fault: round(100 * value, 1) for fault, value in bound[name].items()}, flush=True)
    faults = sorted({fault for cells in bound.values() for fault in cells})
    lines = ["| condition | " + " | ".join(faults) + " |", "|" + " --- |" * (1 + len(faults))]
    within, guard_short = 0, 0
    for name, cells in bound.items():
        row = []
        for fault in faults:
            if fault not in cells:
                row.append("–")
                continue
            cell = f"{100 * cells[fault]:.1f}"
            mine = guard.get(name, {}).get(fault, {}).get("recall")
            if mine is not None:
                cell += f" ({100 * mine:.1f})"
                if cells[fault] >= GOAL_RECALL:
                    within += 1
                    guard_short += mine < GOAL_RECALL
            row.append(cell)
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    out.mkdir(parents=True, exist_ok=True)
    stem = ("separability" if trainer_bins else "separability-engine") + ("-support" if same_support else "")
    (out / f"{stem}.json").write_text(json.dumps({"seed": seed, "faults_per_condition": faults_per_condition,
                                                       "goal_false_rate": GOAL_FALSE_RATE, "bound": bound,
                                                       "false_at_goal": price}, indent=1))
    priced = [f"| {name} | {fault} | {100 * bound[name][fault]:.1f} | {100 * share:.2f} % |"
              for name, cells in price.items() for fault, share in sorted(cells.items())]
    summary = (f"Cells whose hindsight bound reaches {100 * GOAL_RECALL:g} %: {within}; the guard "
               f"({guard_results.name}) is below the goal in {guard_short} of them.")
    (out / f"{stem}.md").write_text(
        "# Hindsight separability bound (`benchmarks/separability.py`"
        + ("" if trainer_bins else " --no-trainer-bins: cells by the engine's logprob and the sign of d only")
        + (" --same-support: the trainer's logprobs on the engine's support" if same_support else "")
        + ")\n\nRecall (%) at ≤ 0.1 % false quarantines "
        "of a detector that knows each condition's clean tokens in full and sets its thresholds with the labels "
        f"(see the script's docstring); in brackets the guard's recall from `{guard_results.name}`.\n\n"
        + "\n".join(lines) + f"\n\n{summary}\n\nWhere the bound is below {100 * GOAL_RECALL:g} %, the share of clean "
        f"samples the same oracle must quarantine to reach it (one score; the goal allows {100 * GOAL_FALSE_RATE:g} %):"
        "\n\n| condition | fault | bound (%) | false quarantines for the goal |\n| --- | --- | --- | --- |\n"
        + "\n".join(priced) + "\n")
    print("\n".join(lines))
    print(f"{summary} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    app()
