"""Can late onset be told from the hybrid-7B noise model? A likelihood-ratio test that knows both processes.

``benchmarks/separability.py`` bounds what the *rarity* of each token's mismatch tells; it ignores direction and
the order of tokens, and the guard beats it where late onset meets the hybrid-7B tail model (the guard 99.3–99.9 %,
that bound 98.2–99.0 %). So there it cannot say whether the cells are out of reach. This script asks the question
with a likelihood-ratio test, by Neyman–Pearson the most powerful one for the fault as the test states it (below):
the ratio of a row's likelihood under the fault to its likelihood under the clean process, both known in closed
form in these conditions.

Clean, per token of engine logprob e (``benchmarks/fidelity_kit/noise.py``, the hybrid-7B model): the measured
mismatch (mean m and sd b per engine bin, read from clean rows) plus the model's Gaussian broad part of sd
σ(e) = σ0 (1 + |e|); a trainer logprob at its clamp (−1e−6) counts as censored. The model's rare tail lives on
tokens the engine put below −3 nats, where a late-onset fault never puts a token; the test leaves them out.

Fault (``zoo.late_onset``, then the same noise): from an onset to the row's end every token lags by a gap
g = 0.1 + (D − 0.1) U², U ~ U(0, 1), the first by D, the row's worst, D ~ U(2, 8) nats; the noise's broad part
on top. The test is told that much, and *not* where the onset falls (every judged token equally likely: the
fault's own 10–20 % from the end is not used) nor the fault's engine logprobs (U(−2.5, −0.5)); D is integrated
over 24 midpoints, U by 32-point Gauss–Legendre quadrature:

.. math:: \\Lambda = \\frac{1}{|\\mathcal D|\\,n} \\sum_{D} \\sum_{o=1}^{n}
          \\frac{f_D^{\\text{first}}(x_o)}{f_0(x_o)} \\prod_{i > o} \\frac{f_D(x_i)}{f_0(x_i)}

over a row's n judged tokens (e ≥ −3 nats). Cross-fitted: the threshold is the 0.1 % point of Λ on a random
half of the clean rows (the model's m and b read there too) and is counted on the other half, with half the
faults made from that half's rows, then the halves swap; the figures are summed, so every clean row is counted
once by a threshold set without it (and, for comparison, the faults caught at each held half's own 0.1 % point:
the test with its threshold known).

What it shows is separability *under the benchmark's noise model*: the broad part there is Gaussian, and the test
trusts that shape (the clean rows it ranks highest hold tokens 2.5–4.3 σ out: its threshold rests on the
Gaussian's shape there). The guard assumes no shape (a bucket's spike threshold is extrapolated from the body of
its own kept tokens, its drift threshold from the kept rows' own CUSUMs); a real 7B run's broad mismatch has no
promised shape. The dense-7B model's broad part is ~0 (σ0 1e−5: the measured noise already exceeds its
published share), so there the noise is the measured one, whose shape has no closed form: those conditions are
not scored.

Two options take knowledge away from the test. ``--noise learned``: instead of σ0 and the
model's shape, each 0.25-nat engine bin's mean and sd, read from the fit half's *noisy* clean rows
(:func:`learned_noise`, |x| read at most 4 nats) — what a guard could read from its own kept tokens; the test
still assumes the Gaussian. With it ``--noise-shape flat|softmax`` (``fidelity.py``'s) can be scored too.
``--lag generic``: a lag profile not the fault's — gaps uniform on [0.1, D] instead of U², D ~ U(1, 10) instead
of U(2, 8).

    python benchmarks/likelihood_bound.py --same-support     # runs/fidelity/likelihood-bound.{json,md}
    python benchmarks/likelihood_bound.py --same-support --noise learned --lag generic   # …-learned-generic.*
"""

from __future__ import annotations

import glob
import json
import math
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fidelity import DEFAULT_DATA, REPO, checked_noise_shape, conditions  # noqa: E402
from benchmarks.fidelity_kit import zoo  # noqa: E402
from benchmarks.fidelity_kit.noise import HYBRID_7B, UNLIKELY, shaped  # noqa: E402
from benchmarks.fidelity_kit.rollouts import Rollouts, read_tables  # noqa: E402
from benchmarks.fidelity_kit.score import GOAL_FALSE_RATE, GOAL_RECALL, wilson  # noqa: E402

WORST = torch.linspace(2.0, 8.0, 25, dtype=torch.float64)[:-1] + 0.125  # nats: D ~ U(2, 8), 24 bin midpoints
_NODES, _WEIGHTS = np.polynomial.legendre.leggauss(32)
U_NODES = torch.tensor((_NODES + 1) / 2, dtype=torch.float64)  # Gauss–Legendre on [0, 1]
U_LOG_WEIGHTS = torch.log(torch.tensor(_WEIGHTS / 2, dtype=torch.float64))
CLAMP = -1e-5  # a trainer logprob above this was clamped by the noise model (at −1e−6)
BIN_EDGES = torch.linspace(-12.0, 0.0, 49, dtype=torch.float64)  # engine-logprob bins of the measured mismatch
LEARNED_EDGES = torch.linspace(UNLIKELY, 0.0, 13, dtype=torch.float64)  # 0.25-nat bins over the judged tokens
LEARNED_CLIP = 4.0  # nats: |x| read by learned_noise at most (a rare large token does not set a bin's sd)

app = typer.Typer(add_completion=False)


def _log_normal(x: torch.Tensor, sd: torch.Tensor) -> torch.Tensor:
    return -0.5 * (x / sd) ** 2 - torch.log(sd) - 0.5 * math.log(2 * math.pi)


def token_log_density(x: torch.Tensor, engine: torch.Tensor, sd: torch.Tensor, censored: torch.Tensor,
                      gap: torch.Tensor) -> torch.Tensor:
    """Log density of a token's mismatch ``x = engine − trainer`` that lags by ``gap`` under Gaussian noise.

    .. math:: \\ln f(x) = \\ln \\varphi_{sd}(x - g), \\qquad \\text{censored (trainer clamped at 0):}\\;
              \\ln P(\\text{trainer} \\ge 0) = \\ln \\Phi\\big((e - g)/sd\\big)

    Shapes broadcast: ``x``, ``engine``, ``sd``, ``censored`` (..., T) against ``gap`` (..., T, K) or a scalar.

    >>> x = torch.tensor([0.0]); e = torch.tensor([-1.0]); sd = torch.tensor([1.0])
    >>> round(float(token_log_density(x, e, sd, torch.tensor([False]), torch.tensor(0.0))), 4)  # ln φ(0)
    -0.9189
    >>> round(float(token_log_density(x, e, sd, torch.tensor([True]), torch.tensor(0.0))), 4)  # ln Φ(−1)
    -1.841
    """
    return torch.where(censored, torch.special.log_ndtr((engine - gap) / sd), _log_normal(x - gap, sd))


class Lag(NamedTuple):
    """The fault's lag as the test states it: a token after the onset lags by g = 0.1 + (D − 0.1) U^power,
    U ~ U(0, 1), the onset's own token by D, the row's worst; D equally likely at each value of ``worst`` (nats)."""
    power: float
    worst: torch.Tensor


LAGS = {
    "fault": Lag(2.0, WORST),  # zoo.late_onset's own: U², D ~ U(2, 8)
    "generic": Lag(1.0, torch.linspace(1.0, 10.0, 25, dtype=torch.float64)[:-1] + 0.1875),  # U, D ~ U(1, 10)
}


def fault_log_density(x: torch.Tensor, engine: torch.Tensor, sigma: torch.Tensor, censored: torch.Tensor,
                      lag: Lag = LAGS["fault"],
                      centre: torch.Tensor | float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and worst gap D, the log density of ``x`` under the lag plus the noise (sd ``sigma`` around
    ``centre``): a token after the onset (gap g = 0.1 + (D − 0.1)U^p, U ~ U(0, 1), integrated by quadrature) and
    the onset's own token (g = D). ``zoo.late_onset``'s lag is p = 2 (``LAGS["fault"]``).

    .. math:: f_D(x) = \\int_0^1 \\varphi_\\sigma\\big(x - c - 0.1 - (D - 0.1)u^p\\big)\\,du, \\qquad
              f_D^{\\text{first}}(x) = \\varphi_\\sigma(x - c - D)

    Args: ``x``, ``engine``, ``sigma``, ``censored``, ``centre``: (B, T) (``centre`` or a number); ``lag.worst``:
    (K,). Returns two (B, T, K).

    >>> later, first = fault_log_density(torch.tensor([[3.0]]), torch.tensor([[-1.0]]), torch.tensor([[0.3]]),
    ...                                  torch.tensor([[False]]), Lag(2.0, torch.tensor([3.0])))
    >>> round(float(first), 3) == round(math.log(1 / (0.3 * math.sqrt(2 * math.pi))), 3)  # x = D: the mode
    True
    >>> bool(later < first)  # a later token's gap is mostly far below D
    True
    >>> shifted, _ = fault_log_density(torch.tensor([[3.5]]), torch.tensor([[-1.0]]), torch.tensor([[0.3]]),
    ...                                torch.tensor([[False]]), Lag(2.0, torch.tensor([3.0])), centre=0.5)
    >>> bool(torch.isclose(shifted, later))  # the same lag around a centre of 0.5 nats
    True
    """
    centre = torch.as_tensor(centre, dtype=x.dtype)
    gap = 0.1 + (lag.worst[:, None] - 0.1) * U_NODES[None, :] ** lag.power  # (K, Q)
    later = token_log_density(x[..., None, None], engine[..., None, None], sigma[..., None, None],
                              censored[..., None, None], gap + centre[..., None, None])
    later = torch.logsumexp(later + U_LOG_WEIGHTS, dim=-1)
    first = token_log_density(x[..., None], engine[..., None], sigma[..., None], censored[..., None],
                              lag.worst + centre[..., None])
    return later, first


def suffix_log_lr(later: torch.Tensor, first: torch.Tensor, judged: torch.Tensor) -> torch.Tensor:
    """Log likelihood ratio of "from some judged token to the end, the row lags" against "clean", the onset
    equally likely at each judged token and the worst gap at each of K values.

    .. math:: \\ln \\Lambda = \\ln \\frac{1}{K n} \\sum_{k} \\sum_{o \\in J}
              \\exp\\Big(\\ell^{\\text{first}}_{o,k} + \\sum_{i > o,\\, i \\in J} \\ell_{i,k}\\Big)

    Args:
        later, first: (B, T, K) per-token log ratios ``ln f_D − ln f_0`` after the onset and at it.
        judged: (B, T) bool, the tokens the test reads. Returns (B,) float64 (−inf for a row with none).

    >>> later = torch.zeros(1, 3, 1); first = torch.tensor([[[0.0], [math.log(4.0)], [0.0]]])
    >>> round(float(suffix_log_lr(later, first, torch.ones(1, 3, dtype=torch.bool)).exp()), 4)  # (1 + 4 + 1) / 3
    2.0
    """
    later = torch.where(judged[..., None], later, torch.zeros_like(later))
    after = later.flip(1).cumsum(1).flip(1) - later  # Σ over judged i > o
    total = torch.where(judged[..., None], first + after, torch.full_like(first, -math.inf))
    count = judged.sum(-1).double() * later.shape[-1]
    score = torch.logsumexp(total.flatten(1), dim=-1) - torch.log(count.clamp(min=1))
    return torch.where(count > 0, score, torch.full_like(score, -math.inf))


def binned_sums(engine: torch.Tensor, trainer: torch.Tensor, valid: torch.Tensor, edges: torch.Tensor,
                clip: float = math.inf) -> torch.Tensor:
    """(len(edges) + 1, 3) float64: count, Σx and Σx² of ``x = clip(engine − trainer, ±clip)`` per engine-logprob
    bin of ``edges`` (``torch.bucketize``), over the ``valid`` tokens whose two logprobs are finite."""
    ok = valid & torch.isfinite(engine) & torch.isfinite(trainer)
    index = torch.bucketize(engine[ok].double(), edges)
    x = (engine - trainer)[ok].double().clamp(-clip, clip)
    return torch.stack([torch.bincount(index, minlength=len(edges) + 1).double(),
                        torch.bincount(index, weights=x, minlength=len(edges) + 1),
                        torch.bincount(index, weights=x * x, minlength=len(edges) + 1)], dim=1)


def binned_moments(sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and sd (nats) per bin from :func:`binned_sums` (an empty bin: 0 and 1e-4)."""
    count = sums[:, 0].clamp(min=1)
    mean = sums[:, 1] / count
    return mean, (sums[:, 2] / count - mean * mean).clamp(min=1e-8).sqrt()


def measured_mismatch(rows: Rollouts) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and sd (nats) of clean ``engine − trainer`` per engine-logprob bin of :data:`BIN_EDGES`."""
    return binned_moments(binned_sums(rows.engine, rows.trainer, rows.mask, BIN_EDGES))


def learned_noise(rows: Rollouts) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and sd (nats) of noisy clean ``clip(engine − trainer, ±LEARNED_CLIP)`` per 0.25-nat engine-logprob bin
    of the judged range (:data:`LEARNED_EDGES`): the whole noise as a guard could read it from its own kept
    tokens, with no σ0 and no shape of the model but the Gaussian the test assumes.

    >>> e = torch.tensor([[-0.1, -0.1, -2.9, -2.9]]); t = e - torch.tensor([[0.1, 0.3, -1.0, 9.0]])
    >>> rows = Rollouts(mask=torch.ones(1, 4, dtype=torch.bool), engine=e, trainer=t,
    ...                 truncated=torch.zeros(1, dtype=torch.bool), step=torch.zeros(1, dtype=torch.long))
    >>> mean, sd = learned_noise(rows)
    >>> [round(float(v), 3) for v in (mean[12], sd[12], mean[1], sd[1])]  # bins (−0.25, 0] and (−3, −2.75]: 9 read as 4
    [0.2, 0.1, 1.5, 2.5]
    """
    return binned_moments(binned_sums(rows.engine, rows.trainer, rows.mask, LEARNED_EDGES, LEARNED_CLIP))


def row_log_lr(rows: Rollouts, base: tuple[torch.Tensor, torch.Tensor], sigma0: float | None,
               lag: Lag = LAGS["fault"], chunk: int = 128) -> torch.Tensor:
    """(B,) ``ln Λ`` of noisy rows (the module's formula) for the fault's ``lag``: clean f0 = measured mismatch
    (``base``, from clean rows before the model's noise) plus the Gaussian broad part σ0(1 + |e|); with ``sigma0``
    None, ``base`` is the whole noise (:func:`learned_noise`, read from noisy clean rows) around which the fault
    lags too. Tokens the engine put below −3 nats are not judged."""
    mean, spread = base
    out = []
    for start in range(0, len(rows), chunk):
        part = rows.rows(slice(start, start + chunk))
        engine, trainer = part.engine.double(), part.trainer.double()
        ok = part.mask & torch.isfinite(engine) & torch.isfinite(trainer)
        engine = torch.where(ok, engine, torch.full_like(engine, -1.0))
        trainer = torch.where(ok, trainer, torch.full_like(trainer, -1.0))
        x, censored = engine - trainer, trainer > CLAMP
        if sigma0 is None:
            index = torch.bucketize(engine, LEARNED_EDGES)
            sigma, centre = spread[index], mean[index]
            clean = token_log_density(x, engine, sigma, censored, centre)
        else:
            sigma, centre = sigma0 * (1 + (-engine).clamp(min=0)), 0.0
            index = torch.bucketize(engine, BIN_EDGES)
            clean = token_log_density(x, engine, (sigma ** 2 + spread[index] ** 2).sqrt(), censored, mean[index])
        later, first = fault_log_density(x, engine, sigma, censored, lag, centre)
        judged = ok & (engine >= UNLIKELY)
        out.append(suffix_log_lr(later - clean[..., None], first - clean[..., None], judged))
    return torch.cat(out)


def _goal_point(scores: torch.Tensor) -> float:
    """The score above which ``GOAL_FALSE_RATE`` of ``scores`` lie (the ``int(0.001 · n)``-th highest, 0-based):
    the threshold a set of clean rows' scores puts at the goal's false rate."""
    return float(scores.sort(descending=True).values[int(GOAL_FALSE_RATE * len(scores))])


def bound(clean: Rollouts, real: dict[str, Rollouts], apply, sigma0: float, count: int,
          generator: torch.Generator, lag: Lag = LAGS["fault"], learned: bool = False) -> dict:
    """Cross-fitted figures: the clean rows are split in two at random; on each half the test reads the measured
    mismatch and its threshold (the 0.1 % point of that half's scores), and the *other* half is counted — its
    clean rows, half of the ``count`` late-onset faults (made from its rows) and half of the condition's real
    late-onset rows. Summed over both halves, so every clean row is counted once, by a threshold set without it
    (as ``separability.cross_fitted``). ``learned``: the noise read from that half's noisy rows
    (:func:`learned_noise`) instead of the model's σ0 on the measured mismatch. Also, for comparison, the faults
    caught at each held half's own 0.1 % point (the test with its threshold known)."""
    order = torch.randperm(len(clean), generator=generator)
    halves = (order[: len(clean) // 2], order[len(clean) // 2:])
    real_rows = real.get("real_late_onset")
    real_order = torch.randperm(len(real_rows), generator=generator) if real_rows is not None else None
    out = {"thresholds_log_lr": [], "clean_rows": 0, "false": 0, "own_false": 0}
    for side, (fit_index, held_index) in enumerate((halves, halves[::-1])):
        fit, held = clean.rows(fit_index), clean.rows(held_index)
        noisy_fit = apply(fit)
        base = learned_noise(noisy_fit) if learned else measured_mismatch(fit)
        scale = None if learned else sigma0
        fit_scores = row_log_lr(noisy_fit, base, scale, lag)
        threshold = _goal_point(fit_scores)
        held_scores = row_log_lr(apply(held), base, scale, lag)
        own = _goal_point(held_scores)
        share = count // 2 if side == 0 else count - count // 2
        index = torch.randint(0, len(held), (share,), generator=generator)
        faults = {"late_onset": apply(zoo.late_onset(held.rows(index), generator))}
        if real_rows is not None:
            faults["real_late_onset"] = apply(real_rows.rows(real_order[side::2]))
        out["thresholds_log_lr"].append(threshold)
        out["clean_rows"] += len(held)
        out["false"] += int((held_scores > threshold).sum())
        out["own_false"] += int((held_scores > own).sum())
        for name, rows in faults.items():
            scores = row_log_lr(rows, base, scale, lag)
            figures = out.setdefault(name, {"rows": 0, "caught": 0, "caught_at_own_threshold": 0})
            figures["rows"] += len(rows)
            figures["caught"] += int((scores > threshold).sum())
            figures["caught_at_own_threshold"] += int((scores > own).sum())
    out["false_rate"] = out["false"] / out["clean_rows"]
    out["false_ci"] = wilson(out["false"], out["clean_rows"])
    for figures in out.values():
        if isinstance(figures, dict):
            figures.update(recall=figures["caught"] / figures["rows"], ci=wilson(figures["caught"], figures["rows"]),
                           goal=figures["caught"] / figures["rows"] >= GOAL_RECALL)
    return out


@app.command()
def main(
    data: str = typer.Option(DEFAULT_DATA, help="glob of parquet files, as benchmarks/fidelity.py"),
    faults_per_condition: int = typer.Option(4000, help="late-onset rows per condition"),
    step_rows: int = typer.Option(256, help="as benchmarks/fidelity.py (the noise models' tail rate uses it)"),
    seed: int = typer.Option(0),
    same_support: bool = typer.Option(False, help="as benchmarks/fidelity.py --same-support"),
    noise_read: str = typer.Option("model", "--noise", help="model: the hybrid-7B model's σ0 (1 + |e|) on the "
                                   "measured mismatch; learned: each 0.25-nat engine bin's mean and sd read from the "
                                   "fit half's noisy clean rows (learned_noise)"),
    lag: str = typer.Option("fault", help="the lag the test is told: fault (zoo.late_onset's, gaps U², D ~ U(2, 8)) or "
                            "generic (gaps uniform, D ~ U(1, 10))"),
    noise_shape: str = typer.Option("surprise", help="as benchmarks/fidelity.py --noise-shape (with --noise learned)"),
    out: Path = typer.Option(REPO / "runs" / "fidelity", help="folder for likelihood-bound[-<noise>-<lag>-<shape>]"
                                                               ".json/.md (default: runs/fidelity, ignored by git)"),
) -> None:
    checked_noise_shape(noise_shape)
    if noise_read not in ("model", "learned"):
        raise typer.BadParameter(f"--noise {noise_read!r}: use model or learned")
    if lag not in LAGS:
        raise typer.BadParameter(f"--lag {lag!r}: use one of {', '.join(LAGS)}")
    if noise_read == "model" and noise_shape != "surprise":
        raise typer.BadParameter(f"--noise-shape {noise_shape!r} needs --noise learned: the model's σ0 (1 + |e|) is "
                                 "the surprise shape")
    paths = sorted(glob.glob(data))
    if not paths:
        raise typer.BadParameter(f"--data {data!r} matches no file: generate the data "
                                 "(benchmarks/fidelity_data/README.md)")
    started = time.perf_counter()
    table = read_tables(paths)
    generator = torch.Generator().manual_seed(seed + 2027)
    results = []
    for name, clean, real, apply, params in conditions(table, seed, step_rows, same_support, noise_shape=noise_shape):
        if params.get("noise") != shaped(HYBRID_7B, noise_shape).name:
            continue
        figures = bound(clean, real, apply, params["sigma0"], faults_per_condition, generator, LAGS[lag],
                        learned=noise_read == "learned")
        results.append({"condition": name, "sigma0": params["sigma0"], **figures})
        line = ", ".join(f"{k} {v['caught']} of {v['rows']} ({100 * v['recall']:.2f} %)"
                         for k, v in figures.items() if isinstance(v, dict))
        print(f"{name}: false {figures['false']} of {figures['clean_rows']}; {line}", flush=True)
    if not results:
        raise RuntimeError(f"no condition with the hybrid-7B noise model in {data!r}: nothing was scored")
    out.mkdir(parents=True, exist_ok=True)
    summary = {"seed": seed, "same_support": same_support, "faults_per_condition": faults_per_condition,
               "noise": noise_read, "lag": lag, "noise_shape": noise_shape,
               "seconds": round(time.perf_counter() - started, 1), "results": results}
    chosen = [v for v, default in ((noise_read, "model"), (lag, "fault"), (noise_shape, "surprise")) if v != default]
    stem = "-".join(["likelihood-bound", *chosen])
    (out / f"{stem}.json").write_text(json.dumps(summary, indent=1))
    lines = ["| condition | clean rows flagged (cross-fitted; 95 % interval) | late onset caught | "
             "real late onset caught |", "| --- | --- | --- | --- |"]
    for r in results:
        cells = [f"{r[k]['caught']} of {r[k]['rows']} ({100 * r[k]['recall']:.2f} %; at the held halves' own 0.1 % "
                 f"points {r[k]['caught_at_own_threshold']})" if k in r else "–"
                 for k in ("late_onset", "real_late_onset")]
        low, high = (100 * v for v in r["false_ci"])
        lines.append(f"| {r['condition']} | {r['false']} of {r['clean_rows']} ({100 * r['false_rate']:.3f} %; "
                     f"[{low:.3f}, {high:.3f}]) | "
                     + " | ".join(cells) + " |")
    (out / f"{stem}.md").write_text(
        "# Likelihood-ratio test for late onset under the hybrid-7B noise model (`benchmarks/likelihood_bound.py`"
        f" --noise {noise_read} --lag {lag} --noise-shape {noise_shape})\n\n"
        + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    app()
