"""How far could any detector get on the fidelity benchmark's cells? A hindsight bound, per fault and condition.

For each noise condition of ``benchmarks/fidelity.py`` (same data, same seed, same faults), every token gets a
*rarity* under that condition's own clean tokens:

.. math:: s = -\\ln \\frac{1 + \\#\\{\\text{clean tokens in the same cell with } |d'| \\ge |d|\\}}{1 + N}

with the cell the token's (engine logprob bin, trainer logprob bin, sign of d) — bins at −6, −3, −1.5, −0.5
nats — and N all clean tokens of the condition. A sample is scored against the clean tokens of the *other* rows:
a clean sample's own tokens, and those of the clean row a synthetic fault was made from, are left out of the
count, as a fresh sample's would not be in it. A token past every such clean |d| of its cell scores by how far:

.. math:: s = \\ln(1 + N) + \\frac{|d| - m}{\\beta}

with m the largest clean |d| of the cell below it and β the cell's exponential tail scale (the mean excess of
its 20 largest |d| over the 21st). A sample scores ``A = max s`` (its rarest token), ``B = Σ relu(s − ln 100)``
and ``C = Σ relu(s − ln 1000)`` (many rare tokens). Thresholds are set *with hindsight* on the condition's clean
samples so that at most 0.1 % of them score above (one score alone, or two at 0.05 % each), and the best recall
over those choices is reported. Held out (:func:`cross_fitted`): the choice and its
thresholds made on a random half of a cell's samples and counted on the other half, as a rule fixed in advance
would be (its false share then varies around 0.1 % from half to half).

Why out of sample: scored against its own tokens too, a clean row's rarest token is never
rarer than one in N/2 while a fault's token past a sparse cell's clean maximum, by any margin, is one in N; fresh
rows drawn from the clean rows' own distribution then scored as faults 9 times as often as the 0.1 % allowed
(``benchmarks/tests/test_separability.py``), and on the benchmark that in-sample bound reached 99.9 % in 197 cells where this
one reaches it in 171 (both are in the table, out of sample / in sample). Left out of its own row alone, without the
tail past the maximum, every clean row that holds a cell's largest |d| scores as high as any fault, and nothing
sparse is separable (68 cells).

This is still optimistic: the clean distribution is known in full before the first step, the tail scale is read
on all clean rows, the thresholds see the labels, and no fault ever feeds it. A guard judges
online, learning the noise from a stream in which missed faults sit. So the bound says where the goal is *not*
out of reach of per-token evidence (bound ≥ 99.9 %): a guard below it there loses to its own online estimate,
not to the data. It is not an upper bound on every detector: rarity ignores direction and the order of tokens,
and a tail scale read from a cell's 20 largest |d| is a coarse model, so in many cells the guard beats it (one
spike in the T0.7/top_p1 runs: the bound 34–92 %, the guard 100 %). Where even the in-sample score misses the
goal, the cell is not separable by per-token rarity however the bound is read.

    python benchmarks/separability.py --same-support     # beside runs/fidelity/results-defaults.json
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

from benchmarks.fidelity import DEFAULT_DATA, REPO, checked_noise_shape, conditions, synthetic_faults  # noqa: E402
from benchmarks.fidelity_kit.results_file import read_results, stored  # noqa: E402
from benchmarks.fidelity_kit.rollouts import Rollouts, read_tables  # noqa: E402
from benchmarks.fidelity_kit.score import GOAL_FALSE_RATE, GOAL_RECALL, wilson  # noqa: E402

EDGES = torch.tensor([-6.0, -3.0, -1.5, -0.5])  # nats, for both sides' logprob bins
TAIL_TOKENS = 20  # the largest clean |d| of a cell whose mean excess is its exponential tail's scale
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


def _at_least_in_row(cell: torch.Tensor, size: torch.Tensor, other_compared: torch.Tensor, other_cell: torch.Tensor,
                     other_size: torch.Tensor, chunk: int = 32) -> torch.Tensor:
    """(B, T) int64: for each token of row i, the compared tokens of ``other`` row i in the same cell with
    |d'| ≥ |d| (|d| capped at 999 nats, as :class:`Rarity` keys them). Rows by chunks of ``chunk``: (chunk, T, T')
    comparisons."""
    size, other_size = size.clamp(max=999.0), other_size.clamp(max=999.0)
    out = torch.zeros(cell.shape, dtype=torch.long)
    for low in range(0, cell.shape[0], chunk):
        rows = slice(low, low + chunk)
        same = ((cell[rows, :, None] == other_cell[rows, None, :]) & (other_size[rows, None, :] >= size[rows, :, None])
                & other_compared[rows, None, :])
        out[rows] = same.sum(dim=-1)
    return out


class Rarity:
    """The clean tokens' |d| per cell, sorted: the joint tail probability of any token, by binary search."""

    def __init__(self, clean: Rollouts, trainer_bins: bool = True, extrapolate: bool = True) -> None:
        self.trainer_bins, self.extrapolate = trainer_bins, extrapolate
        compared, _, cell, size = _cells(clean, trainer_bins)
        self.tokens = int(compared.sum())
        cell, size = cell[compared], size[compared]
        order = torch.argsort(cell.double() * 1e3 + size.double().clamp(max=999.0))  # by cell, then by |d|
        self.cell, self.size = cell[order], size[order]
        self.scale = torch.ones(2 * (len(EDGES) + 1) ** 2, dtype=torch.float64)  # β per cell, nats
        for index in self.cell.unique().tolist():
            values = self.size[self.cell == index].double()
            top = min(TAIL_TOKENS, len(values) - 1)
            if top >= 2:  # exponential tail above the (top + 1)-th largest: β = mean excess of the top ones
                self.scale[index] = (values[-top:] - values[-top - 1]).mean().clamp(min=1e-3)

    def scores(self, rollouts: Rollouts, own: Rollouts | None = None) -> dict[str, torch.Tensor]:
        """(B,) scores A, B, C of each sample (+inf with a non-finite logprob). ``own``: the clean row each sample
        is (a clean sample) or was made from (a synthetic fault), row for row; its tokens are left out of the
        sample's rarity, so that every sample is scored against clean tokens that are not its own, as a fresh
        sample would be."""
        compared, nonfinite, cell, size = _cells(rollouts, self.trainer_bins)
        key = self.cell.double() * 1e3 + self.size.double().clamp(max=999.0)
        # clean tokens of the same cell with |d'| ≥ |d|: end of the cell minus the first position at or above |d|
        end = torch.searchsorted(self.cell.contiguous(), cell.contiguous(), right=True)
        query = cell.double() * 1e3 + size.double().clamp(max=999.0)
        start = torch.searchsorted(key.contiguous(), query.contiguous())
        at_least = end - start
        if own is not None:
            own_compared, _, own_cell, own_size = _cells(own, self.trainer_bins)
            at_least = at_least - _at_least_in_row(cell, size, own_compared, own_cell, own_size)
        at_least = at_least.clamp(min=0)
        rarity = -torch.log((at_least + 1.0) / (self.tokens + 1.0))
        if self.extrapolate:  # past every other row's token of its cell: the exponential tail, from the one below
            below = start - 1
            has_below = below >= torch.searchsorted(self.cell.contiguous(), cell.contiguous())
            largest_below = torch.where(has_below, self.size[below.clamp(min=0)], 0.0).double()
            excess = (size.double().clamp(max=999.0) - largest_below).clamp(min=0) / self.scale[cell]
            rarity = torch.where(at_least == 0, rarity + excess, rarity)
        rarity = torch.where(compared, rarity, 0.0)
        out = {"A": rarity.amax(dim=-1), "B": (rarity - math.log(100)).clamp(min=0).sum(dim=-1),
               "C": (rarity - math.log(1000)).clamp(min=0).sum(dim=-1)}
        return {name: torch.where(nonfinite, math.inf, value) for name, value in out.items()}


def hindsight_threshold(clean: torch.Tensor, share: float) -> float:
    """The score above which at most ``share`` of the clean samples lie."""
    allowed = int(math.floor(share * clean.numel()))
    ranked = clean.sort(descending=True).values
    return float(ranked[allowed]) if allowed < clean.numel() else -math.inf


Rule = tuple[tuple[str, float], ...]  # (score name, threshold) pairs: a sample above any one of them is flagged


def flagged(scores: dict[str, torch.Tensor], rule: Rule) -> torch.Tensor:
    """(B,) bool: the samples a rule flags (any of its scores above its threshold)."""
    out = torch.zeros_like(next(iter(scores.values())), dtype=torch.bool)
    for name, threshold in rule:
        out |= scores[name] > threshold
    return out


def candidate_rules(clean: dict[str, torch.Tensor]) -> list[Rule]:
    """The oracle's rules at ≤ GOAL_FALSE_RATE false on ``clean``: each score alone at that rate, and A with B or
    with C at half the rate each where the two together stay within it (thresholds: :func:`hindsight_threshold`)."""
    rules: list[Rule] = [((name, hindsight_threshold(scores, GOAL_FALSE_RATE)),) for name, scores in clean.items()]
    for first, second in (("A", "B"), ("A", "C")):
        if first not in clean or second not in clean:
            continue
        pair = ((first, hindsight_threshold(clean[first], GOAL_FALSE_RATE / 2)),
                (second, hindsight_threshold(clean[second], GOAL_FALSE_RATE / 2)))
        if float(flagged(clean, pair).float().mean()) <= GOAL_FALSE_RATE:
            rules.append(pair)
    return rules


def best_rule(clean: dict[str, torch.Tensor], faulty: dict[str, torch.Tensor]) -> tuple[Rule, float]:
    """The candidate rule (:func:`candidate_rules`) with the best recall on ``faulty``, and that recall (the
    first of equals)."""
    recalls = [(rule, float(flagged(faulty, rule).float().mean())) for rule in candidate_rules(clean)]
    return max(recalls, key=lambda pair: pair[1])


def best_recall(clean: dict[str, torch.Tensor], faulty: dict[str, torch.Tensor]) -> float:
    """The best recall at ≤ GOAL_FALSE_RATE false over one score or a pair at half the rate each."""
    return best_rule(clean, faulty)[1]


def cross_fitted(clean: dict[str, torch.Tensor], faulty: dict[str, torch.Tensor], generator: torch.Generator
                 ) -> dict[str, int]:
    """The bound with its rule chosen on one half of the samples and counted on the other: the clean and the
    faulty samples are each split in two at random; on each half the oracle picks its rule and thresholds with
    hindsight (:func:`best_rule`), and the other half is counted. Returns the faulty samples caught and the clean
    ones flagged, of how many, over both halves. Where the in-half bound reaches the goal by a row or two, this
    says whether a rule fixed before seeing the rows would (a real detector's position).

    >>> clean = {"A": torch.arange(4000.0)}  # clean scores 0 … 3999
    >>> faulty = {"A": torch.full((100,), 5000.0)}
    >>> cross_fitted(clean, faulty, torch.Generator().manual_seed(0))["caught"]
    100
    """
    clean_order = torch.randperm(len(next(iter(clean.values()))), generator=generator)
    faulty_order = torch.randperm(len(next(iter(faulty.values()))), generator=generator)
    halves = [(clean_order[: len(clean_order) // 2], faulty_order[: len(faulty_order) // 2]),
              (clean_order[len(clean_order) // 2:], faulty_order[len(faulty_order) // 2:])]
    out = {"caught": 0, "faulty": 0, "flagged": 0, "clean": 0}
    for (fit_clean, fit_faulty), (held_clean, held_faulty) in (halves, halves[::-1]):
        rule, _ = best_rule({k: v[fit_clean] for k, v in clean.items()}, {k: v[fit_faulty] for k, v in faulty.items()})
        out["caught"] += int(flagged({k: v[held_faulty] for k, v in faulty.items()}, rule).sum())
        out["flagged"] += int(flagged({k: v[held_clean] for k, v in clean.items()}, rule).sum())
        out["faulty"] += len(held_faulty)
        out["clean"] += len(held_clean)
    return out


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


TRADE_OFF_RATES = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3)  # false quarantine shares at which the curve is read


def trade_off(clean: dict[str, torch.Tensor], faulty: dict[str, torch.Tensor],
              rates: tuple[float, ...] = TRADE_OFF_RATES) -> list[float]:
    """The oracle's trade-off curve in one cell: its best recall over the scores one at a time, at each share of
    clean samples it may quarantine (thresholds with hindsight, as :func:`hindsight_threshold`).

    >>> clean = {"A": torch.arange(1000.0)}  # clean scores 0 … 999
    >>> faulty = {"A": torch.tensor([999.5, 995.0, 960.0, 500.0])}
    >>> trade_off(clean, faulty, rates=(0.001, 0.01, 0.1))  # thresholds 998, 989, 899
    [0.25, 0.5, 0.75]
    """
    return [max(float((faulty[name] > hindsight_threshold(clean[name], rate)).float().mean()) for name in clean)
            for rate in rates]


def plot_trade_off(curves: dict[str, list[float]], guard: dict[str, tuple[float, float]], path: Path) -> None:
    """One line per cell (the share of faulty samples the oracle misses against the share of clean samples it
    quarantines, both on log scales floored at 1e-4) and the guard's own point in the same colour (its condition's
    false rate and its missed share)."""
    try:
        import matplotlib
    except ImportError:  # the curves are in the json
        print(f"matplotlib is not installed: {path.name} not drawn")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(13, 6))
    for (cell, recall), colour in zip(curves.items(), plt.cm.tab20.colors * 2):
        axis.plot(TRADE_OFF_RATES, [max(1 - value, 1e-4) for value in recall], marker=".", color=colour, label=cell)
        if cell in guard:
            axis.scatter([max(guard[cell][0], 1e-4)], [max(1 - guard[cell][1], 1e-4)], marker="x", color=colour)
    axis.axvline(GOAL_FALSE_RATE, color="grey", linestyle="--", linewidth=1)
    axis.axhline(1 - GOAL_RECALL, color="grey", linestyle="--", linewidth=1)
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("share of clean samples quarantined (the guard's x: its condition's rate; 1e-4 = none)")
    axis.set_ylabel("share of faulty samples missed (1e-4 = none; the goal: below the dashed line)")
    axis.set_title("Cells below the goal: the hindsight oracle's trade-off (lines) and the guard (x)", fontsize=10)
    axis.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def same_draws(run: dict, path: Path, **bound: object) -> None:
    """Refuse, in one line naming the field, a guard run whose faults were drawn otherwise than this bound's: the
    bound scores the same rows as ``benchmarks/fidelity.py`` only with the same data, seed, faults per condition,
    step size and support (a run written before ``same_support`` existed compared on the full vocabulary).

    >>> same_draws({"seed": 0, "faults_per_condition": 1000}, Path("r.json"), seed=0, faults_per_condition=1000)
    >>> try:
    ...     same_draws({"seed": 1}, Path("r.json"), seed=0)
    ... except typer.BadParameter as error:
    ...     print(error)  # doctest: +ELLIPSIS
    --guard-results r.json was run with seed=1, this bound with seed=0: pass --seed 1, or a guard run made with ...
    """
    recorded = {**run, "same_support": run.get("same_support") or False,
                "noise_shape": run.get("noise_shape", "surprise")}  # a run from before --noise-shape: the tail models
    if "data" in run:
        recorded["data"] = [str(REPO / p) if not Path(p).is_absolute() else p for p in run["data"]]
        bound["data"] = [str(Path(p).resolve()) for p in bound.get("data", [])]
    for field, value in bound.items():
        if field in recorded and recorded[field] != value:
            theirs, ours = recorded[field], value
            if field == "data":
                raise typer.BadParameter(f"--guard-results {path} was run on other data ({len(theirs)} files, this "
                                         f"bound {len(ours)}): pass its --data glob, or a guard run on this data")
            raise typer.BadParameter(f"--guard-results {path} was run with {field}={theirs!r}, this bound with "
                                     f"{field}={ours!r}: pass {_flag(field, theirs)}, or a guard run made with "
                                     f"{_flag(field, ours)}")


def _flag(field: str, value: object) -> str:
    """The option that sets ``field`` to ``value``: ``--seed 1``, ``--same-support``, ``--no-same-support``."""
    option = field.replace("_", "-")
    if isinstance(value, bool):
        return f"--{option}" if value else f"--no-{option}"
    return f"--{option} {value}"


@app.command()
def main(
    data: str = typer.Option(DEFAULT_DATA, help="glob of parquet files, as benchmarks/fidelity.py"),
    faults_per_condition: int = typer.Option(1000, help="rollouts per synthetic fault kind per condition"),
    step_rows: int = typer.Option(256, help="as benchmarks/fidelity.py (the noise models' tail rate uses it)"),
    seed: int = typer.Option(0),
    guard_results: Path = typer.Option(REPO / "runs" / "fidelity" / "results-defaults.json",
                                       help="the guard's results beside which to print the bound (optional; default: "
                                            "what fidelity.py writes by default)"),
    out: Path = typer.Option(REPO / "runs" / "fidelity", help="folder for separability.json/.md (default: "
                                                               "runs/fidelity, ignored by git)"),
    trainer_bins: bool = typer.Option(True, help="cells by both sides' logprob bins and the sign of d; off: by the "
                                      "engine's bins and the sign only, as the guard buckets (separability-engine.*)"),
    same_support: bool = typer.Option(False, help="the trainer on the engine's support, as benchmarks/fidelity.py "
                                      "--same-support (separability-support.*)"),
    noise_shape: str = typer.Option("surprise", help="as benchmarks/fidelity.py --noise-shape (another than "
                                    "'surprise': separability*-<shape>.*)"),
) -> None:
    paths = sorted(glob.glob(data))
    if not paths:
        raise typer.BadParameter(f"--data {data!r} matches no file: generate the data "
                                 "(benchmarks/fidelity_data/README.md)")
    checked_noise_shape(noise_shape)
    guard = {}
    if stored(guard_results) is not None:
        run = read_results(guard_results)
        if run.get("stitch", 1) != 1:
            raise typer.BadParameter(f"--guard-results {guard_results} was run with --stitch {run['stitch']}: the "
                                     "bound scores the data's own rows; pass a guard run made without --stitch")
        same_draws(run, guard_results, faults_per_condition=faults_per_condition, step_rows=step_rows, seed=seed,
                   same_support=same_support, data=paths, noise_shape=noise_shape)
        guard = {r["condition"]: r["figures"] for r in run["results"]}
    started = time.perf_counter()
    table = read_tables(paths)
    generator = torch.Generator().manual_seed(seed)  # the same draws, in the same order, as benchmarks/fidelity.py
    bound: dict[str, dict[str, float]] = {}  # out of sample (the module's docstring)
    optimistic: dict[str, dict[str, float]] = {}  # in sample: each row scored against its own tokens too
    price: dict[str, dict[str, float]] = {}  # false share the oracle needs for the goal, where the bound is below
    curves: dict[str, list[float]] = {}  # the oracle's trade-off, in the cells where the guard is below the goal
    guard_points: dict[str, tuple[float, float]] = {}  # the guard's (false rate, recall) there
    held_out: dict[str, dict[str, dict[str, int]]] = {}  # cross-fitted counts per condition and fault
    halves = torch.Generator().manual_seed(10_000 + seed)  # the split, apart from the faults' draws
    for name, clean, real_faults, apply, _ in conditions(table, seed, step_rows, same_support,
                                                         noise_shape=noise_shape):
        sources: dict[str, torch.Tensor] = {}
        faulty = {key: apply(rows) for key, rows in
                  {**synthetic_faults(clean, faults_per_condition, generator, sources), **real_faults}.items()}
        clean = apply(clean)  # once, after the faults, as benchmarks/fidelity.py draws it
        rarity, in_sample = Rarity(clean, trainer_bins), Rarity(clean, trainer_bins, extrapolate=False)
        clean_scores, clean_in_sample = rarity.scores(clean, own=clean), in_sample.scores(clean)
        scored = {fault: rarity.scores(rows, own=clean.rows(sources[fault]) if fault in sources else None)
                  for fault, rows in sorted(faulty.items())}
        bound[name] = {fault: best_recall(clean_scores, scores) for fault, scores in scored.items()}
        held_out[name] = {fault: cross_fitted(clean_scores, scores, halves) for fault, scores in scored.items()}
        optimistic[name] = {fault: best_recall(clean_in_sample, in_sample.scores(rows))
                            for fault, rows in sorted(faulty.items())}
        price[name] = {fault: false_at_goal(clean_scores, scores) for fault, scores in scored.items()
                       if bound[name][fault] < GOAL_RECALL}
        mine = guard.get(name, {})
        for fault, scores in scored.items():
            if mine.get(fault, {}).get("recall", 1.0) < GOAL_RECALL:
                curves[f"{name} {fault}"] = trade_off(clean_scores, scores)
                guard_points[f"{name} {fault}"] = (mine["clean"]["false_rate"], mine[fault]["recall"])
        print(name, {fault: round(100 * value, 1) for fault, value in bound[name].items()}, flush=True)
    faults = sorted({fault for cells in bound.values() for fault in cells})
    lines = ["| condition | " + " | ".join(faults) + " |", "|" + " --- |" * (1 + len(faults))]
    within = 0
    short: dict[str, list[str]] = {"reachable": [], "in sample only": [], "neither": []}  # guard below the goal
    for name, cells in bound.items():
        row = []
        for fault in faults:
            if fault not in cells:
                row.append("–")
                continue
            cell = f"{100 * cells[fault]:.1f} / {100 * optimistic[name][fault]:.1f}"
            mine = guard.get(name, {}).get(fault, {}).get("recall")
            if mine is not None:
                cell += f" ({100 * mine:.1f})"
                within += cells[fault] >= GOAL_RECALL
                if mine < GOAL_RECALL:
                    kind = ("reachable" if cells[fault] >= GOAL_RECALL else
                            "in sample only" if optimistic[name][fault] >= GOAL_RECALL else "neither")
                    short[kind].append(f"{name} {fault} ({100 * mine:.1f})")
            row.append(cell)
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    out.mkdir(parents=True, exist_ok=True)
    stem = (("separability" if trainer_bins else "separability-engine") + ("-support" if same_support else "")
            + ("" if noise_shape == "surprise" else f"-{noise_shape}"))
    (out / f"{stem}.json").write_text(json.dumps({"seed": seed, "faults_per_condition": faults_per_condition,
                                                  "goal_false_rate": GOAL_FALSE_RATE, "bound": bound,
                                                  "in_sample": optimistic, "false_at_goal": price,
                                                  "trade_off_rates": TRADE_OFF_RATES, "trade_off": curves,
                                                  "guard": guard_points, "held_out": held_out}, indent=1))
    plot_trade_off(curves, guard_points, out / f"{stem}-trade-off.png")
    curve_lines = [f"| {cell} | {100 * guard_points[cell][1]:.1f} at {100 * guard_points[cell][0]:.3f} % | "
                   + " | ".join(f"{100 * value:.1f}" for value in recall) + " |" for cell, recall in curves.items()]
    priced = [f"| {name} | {fault} | {100 * bound[name][fault]:.1f} | {100 * share:.2f} % |"
              for name, cells in price.items() for fault, share in sorted(cells.items())]
    summary = (f"Cells whose bound reaches {100 * GOAL_RECALL:g} % out of sample: {within}. Cells where the guard "
               f"(`{guard_results.name}`) is below the goal: {sum(map(len, short.values()))}; of those, the bound "
               f"reaches the goal out of sample in {len(short['reachable'])}"
               + "".join(f"\n- {cell}" for cell in short["reachable"])
               + f"\n\nonly in sample in {len(short['in sample only'])}"
               + "".join(f"\n- {cell}" for cell in short["in sample only"])
               + f"\n\nneither way in {len(short['neither'])}.")
    held_lines, held_within, held_near = [], 0, 0
    for name, cells in held_out.items():
        for fault, counts in cells.items():
            reached = (counts["caught"] >= GOAL_RECALL * counts["faulty"]
                       and counts["flagged"] <= GOAL_FALSE_RATE * counts["clean"])
            held_within += reached and name in guard
            # the same, where the clean share's 95 % interval reaches the allowed rate (a rule fixed before the
            # rows, set to flag 0.1 % of them, flags more than that on half of them by chance)
            held_near += (name in guard and counts["caught"] >= GOAL_RECALL * counts["faulty"]
                          and wilson(counts["flagged"], counts["clean"])[0] <= GOAL_FALSE_RATE)
            mine = guard.get(name, {}).get(fault, {}).get("recall")
            if mine is not None and mine < GOAL_RECALL:
                low, high = wilson(counts["caught"], counts["faulty"])
                false_low, false_high = wilson(counts["flagged"], counts["clean"])
                held_lines.append(
                    f"| {name} {fault} | {100 * mine:.1f} at {100 * guard_points[f'{name} {fault}'][0]:.3f} % | "
                    f"{100 * bound[name][fault]:.1f} | {counts['caught']} of "
                    f"{counts['faulty']} ({100 * low:.1f}–{100 * high:.1f}) | {counts['flagged']} of {counts['clean']} "
                    f"({100 * false_low:.2f}–{100 * false_high:.2f} %) | {'yes' if reached else 'no'} |")
    held = (f"Held out (`cross_fitted`: the rule and its thresholds chosen on a random half of a cell's clean and "
            f"faulty samples, counted on the other half, and the other way round): the goal ({100 * GOAL_RECALL:g} % "
            f"caught, ≤ {100 * GOAL_FALSE_RATE:g} % of the clean samples flagged) is reached in {held_within} "
            f"cells; {held_near} catch {100 * GOAL_RECALL:g} % with the clean share's 95 % interval reaching "
            f"{100 * GOAL_FALSE_RATE:g} % (thresholds set to flag {100 * GOAL_FALSE_RATE:g} % of one half flag more "
            f"than that of the other about half the time). In the cells where the guard is below the goal (95 % "
            f"Wilson intervals):\n\n| cell | guard: recall (%) at false | bound "
            f"(%) | caught held out | clean flagged held out | goal |\n| --- | --- | --- | --- | --- | --- |\n"
            + "\n".join(held_lines))
    (out / f"{stem}.md").write_text(
        "# Hindsight separability bound (`benchmarks/separability.py`"
        + ("" if trainer_bins else " --no-trainer-bins: cells by the engine's logprob and the sign of d only")
        + (" --same-support: the trainer's logprobs on the engine's support" if same_support else "")
        + ")\n\nRecall (%) at ≤ 0.1 % false quarantines "
        "of a detector that knows each condition's clean tokens in full and sets its thresholds with the labels "
        "(see the script's docstring), each sample scored out of sample / in sample (against its own row's tokens "
        f"too: optimistic); in brackets the guard's recall from `{guard_results.name}`.\n\n"
        + "\n".join(lines) + f"\n\n{summary}\n\n{held}\n\nWhere the bound is below {100 * GOAL_RECALL:g} % out of sample, "
        "the share of clean samples the same oracle must quarantine to reach it (one score; the goal allows "
        f"{100 * GOAL_FALSE_RATE:g} %):"
        "\n\n| condition | fault | bound (%) | false quarantines for the goal |\n| --- | --- | --- | --- |\n"
        + "\n".join(priced) + "\n\nThe trade-off in the cells where the guard is below the goal: the oracle's recall (%) "
        "(out of sample, best single score) at each share of clean samples it may quarantine, beside the guard's "
        f"recall and its condition's false rate (`{stem}-trade-off.png` draws them):\n\n"
        "| cell | guard | " + " | ".join(f"{100 * rate:g} %" for rate in TRADE_OFF_RATES) + " |\n"
        + "|" + " --- |" * (2 + len(TRADE_OFF_RATES)) + "\n" + "\n".join(curve_lines) + "\n")
    print("\n".join(lines))
    print(f"{summary}\n\n{held}\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    app()
