"""Where does real engine-vs-trainer noise live? Its spread per engine-logprob bin, against the benchmark's shapes.

The fidelity benchmark's tail models put a Gaussian broad part on every token with a scale σ0 · shape(s), s the
token's surprise (−engine logprob): ``surprise`` 1 + s (the default), ``flat`` 1, ``softmax`` 1 − p
(``benchmarks/fidelity_kit/noise.py`` ``SHAPES``). The published 7B figures fix σ0, not the shape. This script reads
the shape off the only real mismatch the repository holds: the H200 rollouts of three small models (a bf16 KV-cache
engine against a full-forward trainer in bf16, fp32 under bf16 autocast, or fp32), clean rows at temperature 1, the
engine's raw logprobs (``engine_raw``: before top-p/top-k, so no renormalisation offset). Per bin of engine logprob,
the spread of d = engine − trainer (its standard deviation, and 1.4826 × its median absolute deviation); then each
shape's best scale, fitted in log space over the bins (each bin one point):

.. math:: \\ln c = \\overline{\\ln \\mathrm{sd}_b - \\ln \\mathrm{shape}(\\bar s_b)}, \\qquad
          r = \\sqrt{\\overline{(\\ln \\mathrm{sd}_b - \\ln c\\,\\mathrm{shape}(\\bar s_b))^2}}

``r`` (the rms log residual) says how far the shape is from the measured one: 0.25 means the fitted spread is off by
a factor of about e^0.25 ≈ 1.3 in a typical bin. With independent logit errors a log-softmax moves by about
σ0 · (1 − p) (``noise.py``'s docstring), which is what the fit tests. The small models' mismatch is tiny (sd ≤ 0.03
nats); its shape, not its size, is what carries over, and only as far as a 7B run's numerics work the same way.

    python benchmarks/noise_shape.py --out runs/noise_shape   # noise-shape.{md,json}
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fidelity_kit.noise import SHAPES  # noqa: E402

DATA = Path(__file__).resolve().parent / "fidelity_data"
# nats: bin edges of the engine's raw logprob (finer near 0, where the softmax shape changes fastest)
EDGES = (-12.0, -8.0, -6.0, -5.0, -4.0, -3.0, -2.5, -2.0, -1.5, -1.0, -0.75, -0.5, -0.25, -0.1, -0.02, 0.0)
MIN_TOKENS = 500  # a bin with fewer tokens is left out of the fit


def binned_spread(engine: np.ndarray, trainer: np.ndarray) -> list[dict]:
    """Per bin of :data:`EDGES` holding ≥ :data:`MIN_TOKENS` tokens: its mean surprise, the sd of d and its
    1.4826·MAD, mean |d| and the 99.9th percentile of |d|. ``engine``, ``trainer``: flat arrays of one condition's
    tokens (nats); non-finite pairs are dropped.

    >>> rng = np.random.default_rng(0); e = rng.uniform(-6, 0, 200_000); d = 0.1 * rng.standard_normal(e.size)
    >>> [round(b["sd"], 2) for b in binned_spread(e, e - d)][:3]  # flat noise: 0.1 in every bin
    [0.1, 0.1, 0.1]
    """
    d = engine - trainer
    keep = np.isfinite(d) & np.isfinite(engine)
    engine, d = engine[keep], d[keep]
    index = np.digitize(engine, EDGES[1:-1])  # 0 … len(EDGES) − 2; logprob 0 falls in the last bin
    bins = []
    for k in range(len(EDGES) - 1):
        x = d[index == k]
        if x.size < MIN_TOKENS:
            continue
        centre = np.median(x)
        bins.append({"low": EDGES[k], "high": EDGES[k + 1], "tokens": int(x.size),
                     "surprise": float(-engine[index == k].mean()), "sd": float(x.std()),
                     "mad_sd": float(1.4826 * np.median(np.abs(x - centre))), "mean_abs": float(np.abs(x).mean()),
                     "p999_abs": float(np.percentile(np.abs(x), 99.9))})
    return bins


def fit_shapes(bins: list[dict], spread: str = "sd") -> dict[str, dict[str, float]]:
    """Each shape of ``SHAPES``: its best scale ``c`` and rms log residual ``r`` over the bins (the formula above).

    >>> s = np.linspace(0.05, 8, 12); bins = [{"surprise": v, "sd": 0.02 * (1 - np.exp(-v))} for v in s]
    >>> fits = fit_shapes(bins)
    >>> min(fits, key=lambda k: fits[k]["rms_log_residual"]), round(fits["softmax"]["scale"], 3)
    ('softmax', 0.02)
    """
    surprise = torch.tensor([b["surprise"] for b in bins], dtype=torch.float64)
    log_sd = np.log(np.array([b[spread] for b in bins]))
    fits = {}
    for name, shape in SHAPES.items():
        log_shape = np.log(shape(surprise).numpy())
        log_scale = float(np.mean(log_sd - log_shape))
        residual = log_sd - log_shape - log_scale
        fits[name] = {"scale": float(np.exp(log_scale)), "rms_log_residual": float(np.sqrt(np.mean(residual ** 2)))}
    return fits


def measure(data: Path = DATA) -> list[dict]:
    """One entry per (source, trainer) of the H200 clean rows at temperature 1: its bins and both fits."""
    import pyarrow.compute as pc

    sys.path.insert(0, str(data))
    from load import load_rollouts, to_padded

    table = load_rollouts(str(data))
    table = table.filter(pc.and_(pc.and_(pc.starts_with(table["source"], "h200"), pc.equal(table["fault"], "none")),
                                 pc.equal(table["temperature"], 1.0)))
    results = []
    for source in sorted(set(table["source"].to_pylist())):
        for trainer in sorted(set(table["trainer"].to_pylist())):
            part = table.filter(pc.and_(pc.equal(table["source"], source), pc.equal(table["trainer"], trainer)))
            if part.num_rows == 0:
                continue
            batch = to_padded(part)
            mask = np.asarray(batch["mask"], dtype=bool)
            bins = binned_spread(np.asarray(batch["engine_raw"])[mask], np.asarray(batch["trainer"])[mask])
            results.append({"source": source, "trainer": trainer, "rows": part.num_rows,
                            "tokens": sum(b["tokens"] for b in bins), "bins": bins,
                            "fit_sd": fit_shapes(bins, "sd"), "fit_mad_sd": fit_shapes(bins, "mad_sd")})
    return results


def markdown(results: list[dict]) -> str:
    shapes = list(SHAPES)
    lines = ["| source | trainer | tokens | " + " | ".join(f"r {s} (sd / MAD)" for s in shapes) + " | best |",
             "| --- " * (4 + len(shapes)) + "|"]
    for r in results:
        cells = [f"{r['fit_sd'][s]['rms_log_residual']:.2f} / {r['fit_mad_sd'][s]['rms_log_residual']:.2f}"
                 for s in shapes]
        best = min(shapes, key=lambda s: r["fit_sd"][s]["rms_log_residual"])
        lines.append(f"| {r['source']} | {r['trainer']} | {r['tokens']:,} | " + " | ".join(cells) + f" | {best} |")
    lines += ["", "Spread per bin (sd of d, nats), by mean surprise of the bin:", ""]
    for r in results:
        row = ", ".join(f"{b['surprise']:.2f}: {b['sd']:.4f}" for b in r["bins"])
        lines.append(f"* {r['source']} {r['trainer']}: {row}")
    return "\n".join(lines) + "\n"


def main(out: Path = typer.Option(Path("runs/noise-shape"), help="folder for noise-shape.md and noise-shape.json"),
         data: Path = typer.Option(DATA, help="folder of the fidelity benchmark's parquet files")) -> None:
    """Print and save the measured spread per engine-logprob bin and each shape's fit."""
    results = measure(data)
    text = markdown(results)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "noise-shape.md").write_text(text)
    (out / "noise-shape.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    typer.run(main)
