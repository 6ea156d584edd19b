"""A change-point likelihood-ratio test told neither the noise model nor the fault's lag, in every noise condition.

``benchmarks/likelihood_bound.py --noise learned --lag generic`` scores only the hybrid-7B conditions (where the
guard misses late onset) and reads its threshold from clean rows. A guard rule built on the same statistic would
face every condition, and a threshold it could hold from its first step is the one the statistic's own form gives:
``Λ`` is a likelihood ratio, so under the clean process E0[Λ] = 1 and P0(Λ ≥ 1/α) ≤ α (Markov's inequality), i.e.
ln Λ > ln 1000 flags at most 0.1 % of clean rows — *if* the clean process is the one the test assumes: Gaussian
per 0.25-nat engine bin, with each bin's mean and sd read from clean rows (``likelihood_bound.learned_noise``).
This script asks how far that holds on the benchmark's noise (measured bf16 noise, the three tail models, top-k
renormalisation), and what the test catches there.

Per condition (``fidelity.conditions``, ``--same-support``), cross-fitted as ``likelihood_bound.bound``: the clean
rows split in two at random; the noise read on one half's noisy rows, the other half counted (its clean rows and
half the faults, made from its rows), then swapped. Faults: ``zoo.late_onset`` and ``zoo.moderate_confidence``
(500 each per half) and the condition's real late-onset rows. Lag (``--lag generic``): from an onset to the row's
end every token lags by a gap uniform on [0.1, D], the onset's own by D, D ~ U(1, 10) (12 midpoints); in closed
form, f_D(x) = [Φ((x − c − 0.1)/σ) − Φ((x − c − D)/σ)] / (D − 0.1). Tokens the engine put below −3 nats, and
tokens whose trainer logprob is at its clamp, are not read. Two thresholds: ln 1000 (the bound above) and the
other half's 0.1 % point (``_goal_point``: the test with its threshold read from the clean rows, as in
``likelihood_bound.py``). ``--odds``: the fixed threshold ln(odds) instead of ln 1000. ``--sd-floor``: each
bin's sd at least that many nats. ``--per-setting``: in a pooled stream the noise of each sampling setting learned
apart, each row scored against its own setting's (a told guard re-learns its centres at each change of setting).

    python benchmarks/results-2026-12-03-twentyeighth/changepoint_every_condition.py [--per-setting] [--seed 1]
"""

from __future__ import annotations

import glob
import math
import sys
from pathlib import Path

import torch
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.fidelity import DEFAULT_DATA, checked_noise_shape, conditions  # noqa: E402
from benchmarks.fidelity_kit import zoo  # noqa: E402
from benchmarks.fidelity_kit.noise import UNLIKELY  # noqa: E402
from benchmarks.fidelity_kit.rollouts import Rollouts, read_tables  # noqa: E402
from benchmarks.fidelity_kit.score import _settings  # noqa: E402
from benchmarks.likelihood_bound import CLAMP, LEARNED_EDGES, _goal_point, learned_noise  # noqa: E402

WORST = torch.linspace(1.0, 10.0, 13, dtype=torch.float64)[:-1] + 0.375  # nats: D ~ U(1, 10), 12 midpoints
FAULTS = {"late_onset": zoo.late_onset, "moderate_confidence": zoo.moderate_confidence}

app = typer.Typer(add_completion=False)


def _log_ndtr_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """ln(Φ(a) − Φ(b)) for a > b, from the side of the smaller tail (no cancellation far out)."""
    ln = torch.special.log_ndtr
    lower = ln(a) + torch.log1p(-torch.exp(ln(b) - ln(a)).clamp(max=1 - 1e-16))
    upper = ln(-b) + torch.log1p(-torch.exp(ln(-a) - ln(-b)).clamp(max=1 - 1e-16))
    return torch.where(b > 0, upper, lower)


def log_lr(engine: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor, mean: torch.Tensor, sd: torch.Tensor,
           readable: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) ln Λ of (B, T) rows against each :data:`LEARNED_EDGES` bin's noise ``mean`` and ``sd``: the onset
    equally likely at each read token, D at each of :data:`WORST`; ``readable``: the bins that may be read (all)."""
    engine, trainer = engine.double(), trainer.double()
    read = mask & torch.isfinite(engine) & torch.isfinite(trainer) & (engine >= UNLIKELY) & (trainer < CLAMP)
    engine = torch.where(read, engine, torch.full_like(engine, -1.0))
    trainer = torch.where(read, trainer, torch.full_like(trainer, -1.0))
    index = torch.bucketize(engine, LEARNED_EDGES)
    if readable is not None:
        read &= readable[index]
    s = sd[index][..., None]
    z = ((engine - trainer - mean[index]) / sd[index])[..., None]
    clean = -0.5 * z * z  # both densities share 1/(σ√2π): it cancels
    later = (_log_ndtr_difference(z - 0.1 / s, z - WORST / s) - torch.log(WORST - 0.1)
             + 0.5 * math.log(2 * math.pi) + torch.log(s) - clean)
    first = -0.5 * (z - WORST / s) ** 2 - clean
    later = torch.where(read[..., None], later, torch.zeros_like(later))
    after = later.flip(1).cumsum(1).flip(1) - later
    total = torch.where(read[..., None], first + after, torch.full_like(first, -math.inf))
    count = read.sum(-1).double() * len(WORST)
    score = torch.logsumexp(total.flatten(1), dim=-1) - torch.log(count.clamp(min=1))
    return torch.where(count > 0, score, torch.full_like(score, -math.inf))


def row_log_lr(rows: Rollouts, noise: tuple[torch.Tensor, torch.Tensor], sd_floor: float,
               chunk: int = 256) -> torch.Tensor:
    """(B,) :func:`log_lr` of ``rows`` against ``noise`` (:func:`likelihood_bound.learned_noise`), each bin's sd at
    least ``sd_floor``, ``chunk`` rows at a time."""
    mean, spread = noise
    parts = (rows.rows(slice(start, start + chunk)) for start in range(0, len(rows), chunk))
    return torch.cat([log_lr(part.engine, part.trainer, part.mask, mean, spread.clamp(min=sd_floor))
                      for part in parts])


def learned_by_setting(rows: Rollouts, per_setting: bool) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The learned noise of each sampling setting of a pooled stream (``per_setting``), or of all rows (key −1)."""
    if not per_setting:
        return {-1: learned_noise(rows)}
    settings = _settings(rows)
    return {int(k): learned_noise(rows.rows(torch.nonzero(settings == k).flatten())) for k in settings.unique()}


def scored(rows: Rollouts, noises: dict[int, tuple[torch.Tensor, torch.Tensor]], sd_floor: float) -> torch.Tensor:
    """(B,) ln Λ, each row against its setting's learned noise (or the one table of key −1)."""
    if -1 in noises:
        return row_log_lr(rows, noises[-1], sd_floor)
    settings, out = _settings(rows), torch.full((len(rows),), -math.inf, dtype=torch.float64)
    for key, noise in noises.items():
        index = torch.nonzero(settings == key).flatten()
        if len(index):
            out[index] = row_log_lr(rows.rows(index), noise, sd_floor)
    return out


@app.command()
def main(data: str = typer.Option(DEFAULT_DATA, help="as benchmarks/fidelity.py"),
         seed: int = typer.Option(0), faults: int = typer.Option(1000, help="rows per fault and condition"),
         sd_floor: float = typer.Option(0.0, help="nats: each bin's sd at least this"),
         noise_shape: str = typer.Option("surprise", help="as benchmarks/fidelity.py --noise-shape"),
         per_setting: bool = typer.Option(False, help="in a pooled stream, learn the noise of each sampling setting "
                                                      "apart and score each row against its own setting's"),
         odds: float = typer.Option(1000.0, help="the fixed threshold is ln of this: at most 1/odds of clean rows "
                                                 "pass it if the assumed noise holds (Markov)")) -> None:
    checked_noise_shape(noise_shape)
    if not odds > 1:
        raise typer.BadParameter(f"--odds {odds:g}: use a number above 1 (the threshold is ln odds)")
    markov = math.log(odds)
    paths = sorted(glob.glob(data))
    if not paths:
        raise typer.BadParameter(f"--data {data!r} matches no file")
    generator = torch.Generator().manual_seed(seed + 2027)
    print(f"seed {seed}, sd floor {sd_floor}, shape {noise_shape}, noise learned per setting: {per_setting}; missed "
          f"of {faults} per fault; real late onset missed at ln {odds:g}")
    print(f"| condition | clean rows | flagged at ln {odds:g} | at the other half's 0.1 % point | late onset missed "
          f"(ln {odds:g} / 0.1 % point) | moderate missed | real late onset missed |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    totals = [0] * 9
    for name, clean, real, apply, _ in conditions(read_tables(paths), seed, 256, True, noise_shape=noise_shape):
        order = torch.randperm(len(clean), generator=generator)
        halves = (order[: len(clean) // 2], order[len(clean) // 2:])
        real_rows = real.get("real_late_onset")
        counts = [0] * 9  # clean, flagged ×2, late missed ×2, moderate missed ×2, real missed, real rows
        for side, (fit_index, held_index) in enumerate((halves, halves[::-1])):
            fit = apply(clean.rows(fit_index))
            noise = learned_by_setting(fit, per_setting)
            point = _goal_point(scored(fit, noise, sd_floor))
            held = clean.rows(held_index)
            scores = scored(apply(held), noise, sd_floor)
            counts[0] += len(scores)
            counts[1] += int((scores > markov).sum())
            counts[2] += int((scores > point).sum())
            for offset, make in zip((3, 5), FAULTS.values(), strict=True):
                index = torch.randint(0, len(held), (faults // 2,), generator=generator)
                faulty = scored(apply(make(held.rows(index), generator)), noise, sd_floor)
                counts[offset] += int((faulty <= markov).sum())
                counts[offset + 1] += int((faulty <= point).sum())
            if real_rows is not None:
                part = real_rows.rows(torch.arange(side, len(real_rows), 2))
                counts[7] += int((scored(apply(part), noise, sd_floor) <= markov).sum())
                counts[8] += len(part)
        totals = [t + c for t, c in zip(totals, counts, strict=True)]
        real_cell = f"{counts[7]} of {counts[8]}" if real_rows is not None else "–"
        print(f"| {name} | {counts[0]} | {counts[1]} ({100 * counts[1] / counts[0]:.3f} %) | {counts[2]} | "
              f"{counts[3]} / {counts[4]} | {counts[5]} / {counts[6]} | {real_cell} |", flush=True)
    print(f"| all | {totals[0]} | {totals[1]} | {totals[2]} | {totals[3]} / {totals[4]} | {totals[5]} / {totals[6]} "
          f"| {totals[7]} of {totals[8]} |")


if __name__ == "__main__":
    app()
