"""Charts drawn with matplotlib (Agg, no display needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _finite(values: Sequence[float]) -> list[float]:
    return [value if value is not None and math.isfinite(value) and value > 0 else math.nan for value in values]


def spike_chart(history: Sequence[dict], spike_delta: float | None, mean_delta: float | None, path: str | Path, title: str = "") -> Path:
    """x: training step; y: max and p99 token |engine − trainer| logprob per step (log scale); threshold line;
    steps with quarantined (or, in monitor mode, suspect) samples marked in red with their count."""
    steps = [row["step"] for row in history]
    figure, axis = plt.subplots(figsize=(12, 4.6), dpi=110, layout="constrained")
    axis.plot(steps, _finite([row["max_abs_delta"] for row in history]), color="#1f77b4", marker=".", lw=1.2, label="max |Δ| per step")
    axis.plot(steps, _finite([row["p99_abs_delta"] for row in history]), color="#7f7f7f", lw=0.9, ls="--", label="p99 |Δ| per step")
    axis.plot(steps, _finite([row.get("kept_max_abs_delta", math.nan) for row in history]), color="#2ca02c", lw=1.0,
              marker=".", ms=3, label="max |Δ| of samples kept in the loss")
    if spike_delta is not None:
        axis.axhline(spike_delta, color="#d62728", lw=1, ls=":", label=f"token_spike threshold ({spike_delta:g} nats)")
    if mean_delta is not None:
        axis.axhline(mean_delta, color="#ff7f0e", lw=1, ls=":", label=f"mean_drift threshold ({mean_delta:g} nats/token)")
    flagged = [row for row in history if row.get("quarantined", 0) or row.get("suspect", 0)]
    if flagged:
        ys = [row["max_abs_delta"] if row["max_abs_delta"] and math.isfinite(row["max_abs_delta"]) else 1.0 for row in flagged]
        axis.scatter([row["step"] for row in flagged], ys, s=70, facecolors="none", edgecolors="#d62728", linewidths=1.6,
                     zorder=5, label="step with quarantined samples")
        for row, y in zip(flagged, ys, strict=True):
            count = int(row.get("quarantined", 0) or row.get("suspect", 0))
            axis.annotate(str(count), (row["step"], y), textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8, color="#d62728")
    axis.set_yscale("log")
    axis.set_xlabel("training step")
    axis.set_ylabel("|logprob engine − trainer| (nats)")
    axis.set_title(title or "Engine vs trainer logprob difference per step")
    axis.grid(True, which="major", alpha=0.3)
    axis.margins(y=0.15)
    figure.legend(loc="outside right upper", fontsize=8, frameon=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path
