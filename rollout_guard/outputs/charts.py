"""Charts drawn with matplotlib (Agg, no display needed). Needs the ``charts`` extra (also in ``trl``, ``wandb``,
``cli``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from rollout_guard.extras import require_extra

require_extra("rollout_guard.outputs.charts", ("matplotlib",), "charts")
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402


def _save(figure: plt.Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


def _finite(values: Sequence[float]) -> list[float]:
    return [value if value is not None and math.isfinite(value) and value > 0 else math.nan for value in values]


SCORE_FLOOR = -10.0  # ln Λ: scores below are drawn at the floor (a row healthy noise explains better)


def spike_chart(history: Sequence[dict], ceiling_delta: float | None, path: str | Path, title: str = "") -> Path:
    """Two panels over the training step. Top: the detector's score (ln Λ) per step, the highest of all rollouts
    and of those kept in the loss, against the threshold it was judged with; steps with suspect rollouts circled
    in red with their count. Bottom: max and p99 token |engine − trainer| logprob per step (log scale), the max of
    the kept rollouts, and the absolute ceiling."""
    steps = [row["step"] for row in history]
    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(12, 6.4), dpi=110, layout="constrained",
                                         height_ratios=(3, 2))

    def floored(key: str) -> list[float]:
        values = [row.get(key, math.nan) for row in history]
        return [max(v, SCORE_FLOOR) if v is not None and math.isfinite(v) else math.nan for v in values]

    top.plot(steps, floored("max_score"), color="#1f77b4", marker=".", lw=1.2, label="max score per step")
    top.plot(steps, floored("kept_max_score"), color="#2ca02c", marker=".", ms=3, lw=1.0,
             label="max score of rollouts kept in the loss")
    top.plot(steps, [row.get("score_threshold", math.nan) for row in history], color="#d62728", lw=1.2, ls=":",
             label="threshold (ln 1/false_alarm_budget)")
    flagged = [row for row in history if row.get("quarantined", 0) or row.get("suspect", 0)]
    if flagged:
        ys = [row["max_score"] if math.isfinite(row.get("max_score", math.nan)) else 0.0 for row in flagged]
        top.scatter([row["step"] for row in flagged], ys, s=70, facecolors="none", edgecolors="#d62728",
                    linewidths=1.6, zorder=5, label="step with suspect rollouts (count)")
        for row, y in zip(flagged, ys, strict=True):
            count = int(row.get("suspect", 0) or row.get("quarantined", 0))
            top.annotate(str(count), (row["step"], y), textcoords="offset points", xytext=(0, 8), ha="center",
                         fontsize=8, color="#d62728")
    top.set_yscale("symlog", linthresh=10.0)  # linear about the threshold, logarithmic for scores in the hundreds
    top.set_ylabel("score ln Λ (engine off vs healthy noise)")
    top.set_title(title or "rollout_guard: score per step against its threshold")
    top.grid(True, alpha=0.3)
    top.margins(y=0.15)
    bottom.plot(steps, _finite([row["max_abs_delta"] for row in history]), color="#1f77b4", marker=".", lw=1.2,
                label="max |Δ| per step")
    bottom.plot(steps, _finite([row["p99_abs_delta"] for row in history]), color="#7f7f7f", lw=0.9, ls="--",
                label="p99 |Δ| per step")
    bottom.plot(steps, _finite([row.get("kept_max_abs_delta", math.nan) for row in history]), color="#2ca02c",
                lw=1.0, marker=".", ms=3, label="max |Δ| of rollouts kept in the loss")
    if ceiling_delta is not None:
        bottom.axhline(ceiling_delta, color="#d62728", lw=1, ls=":", label=f"absolute ceiling ({ceiling_delta:g} nats)")
    bottom.set_yscale("log")
    bottom.set_xlabel("training step")
    bottom.set_ylabel("|logprob engine − trainer| (nats)")
    bottom.grid(True, which="major", alpha=0.3)
    figure.legend(loc="outside right upper", fontsize=8, frameon=False)
    return _save(figure, path)


def token_chart(record, path: str | Path, window: int = 64) -> Path:  # noqa: ANN001 - a QuarantineRecord
    """One suspect rollout token by token: engine and trainer logprob of each completion token, the decoded
    tokens on the x axis, the token where the disagreement starts marked. Long completions show ``window`` tokens
    starting a little before it (drawing hundreds of tick labels costs seconds)."""
    tokens = record.completion_tokens or [str(token) for token in record.completion_ids]
    first = record.stats.get("onset_token")
    first = int(first) if first is not None else -1
    start = min(max(first - 8, 0), max(len(tokens) - window, 0))
    stop = min(start + window, len(tokens))
    positions = list(range(start, stop))
    engine = [math.nan if v is None else v for v in (record.engine_logprobs or [None] * len(tokens))][start:stop]
    trainer = [math.nan if v is None else v for v in (record.trainer_logprobs or [None] * len(tokens))][start:stop]
    tokens = tokens[start:stop]
    width = min(max(8.0, 0.35 * len(tokens) + 3), 26.0)
    figure, axis = plt.subplots(figsize=(width, 4.2), dpi=110, layout="constrained")
    axis.plot(positions, engine, color="#1f77b4", marker="o", ms=4, lw=1.2, label="engine logprob (the sampler)")
    axis.plot(positions, trainer, color="#d62728", marker="s", ms=4, lw=1.2, label="trainer logprob, same prompt")
    axis.fill_between(positions, engine, trainer, color="#d62728", alpha=0.08)
    if start <= first < stop:
        axis.axvline(first, color="#ff7f0e", ls="--", lw=1.2, label=f"where the disagreement starts (#{first})")
    axis.set_xticks(positions)
    axis.set_xticklabels([repr(token)[1:-1] for token in tokens], rotation=90 if len(tokens) > 20 else 0, fontsize=8)
    axis.set_ylabel("logprob of the sampled token (nats)")
    shown = (f"tokens {start}–{stop - 1} of {len(record.completion_ids)}"
        if (start, stop) != (0, len(record.completion_ids)) else "all tokens")
    axis.set_xlabel(f"completion token ({shown})")
    prompt = record.prompt_text if len(record.prompt_text) <= 80 else "…" + record.prompt_text[-79:]
    max_delta = record.stats.get("max_abs_delta")
    axis.set_title(
        f"step {record.step}, rollout {record.global_row}: max |Δ| {max_delta:.3g} nats, "
        f"rules: {', '.join(record.rules)}\n"
        + (f"{record.explanation}\n" if record.explanation else "")
        + f"prompt: {prompt!r}",
        fontsize=9,
    )
    axis.grid(True, alpha=0.3)
    figure.legend(loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    return _save(figure, path)


def delta_heatmap(steps: Sequence[int], histograms: Sequence[Sequence[float]], bin_edges: Sequence[float],
                  path: str | Path) -> Path:
    """Per-step histogram of token |Δ| with fixed bin edges, as a heatmap: x = step, y = |Δ| (log), colour = tokens."""
    import numpy as np

    counts = np.asarray(histograms, dtype=float).T  # (bins, steps)
    edges = np.log10(np.clip(np.asarray(bin_edges, dtype=float), 1e-7, None))
    edges = np.append(edges, edges[-1] + (edges[-1] - edges[-2]))  # close the overflow bin for drawing
    x = np.append(np.asarray(steps, dtype=float), (steps[-1] + 1) if len(steps) else 1) - 0.5
    figure, axis = plt.subplots(figsize=(12, 4.2), dpi=110, layout="constrained")
    mesh = axis.pcolormesh(x, edges, np.log10(counts + 1), cmap="viridis", shading="flat")
    figure.colorbar(mesh, ax=axis, label="log10(tokens + 1)")
    axis.set_xlabel("training step")
    axis.set_ylabel("log10 |logprob engine − trainer|")
    axis.set_title("Token |Δ| histogram per step (fixed bins; the bottom row is |Δ| < 1e-6)")
    return _save(figure, path)


def _column(rows: Sequence[dict], key: str) -> list[float]:
    return [math.nan if row.get(key) is None else float(row[key]) for row in rows]


DELTA_FLOOR = 1e-8  # nats: where a |Δ| of exactly 0 is drawn on the log scale of the engine charts


def _floored(values: Sequence[float]) -> list[float]:
    """|Δ| values for a log axis: NaN stays NaN (no tokens), values below :data:`DELTA_FLOOR` (0 included) sit on it."""
    return [value if math.isnan(value) else max(value, DELTA_FLOOR) for value in values]


def _edges(steps: Sequence[float]) -> list[float]:
    """Bin edges around ascending steps: halfway between neighbours, half a gap (or 0.5) beyond the first and last.

    >>> _edges([1, 2, 4])
    [0.5, 1.5, 3.0, 5.0]
    """
    if not steps:
        return [0.0]
    inner = [(a + b) / 2 for a, b in zip(steps, steps[1:])]
    first = steps[0] - ((inner[0] - steps[0]) if inner else 0.5)
    last = steps[-1] + ((steps[-1] - inner[-1]) if inner else 0.5)
    return [first, *inner, last]


def engine_chart(history: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """The mismatch next to the engine's state, per step (rows of :func:`rollout_guard.outputs.engine_view.engine_history`),
    drawn by :func:`engine_figure`."""
    return _save(engine_figure(history, title), path)


def engine_figure(history: Sequence[dict], title: str = "") -> plt.Figure:
    """Top: max |Δ| (log, left) and quarantined share (right). Middle: KV-cache usage (max and mean over the step's
    engine iterations, %, left) and running requests (max, right). Bottom: weight version (syncs since start) and
    preemptions. A value missing at a step (an engine mode that does not give it) leaves a gap; a panel with no
    value at all says which fields the engine did not give."""
    steps = [row["step"] for row in history]
    figure, (top, middle, bottom) = plt.subplots(3, 1, figsize=(12, 8), dpi=110, sharex=True, layout="constrained")
    deltas = _floored(_column(history, "max_abs_delta"))
    top.plot(steps, deltas, color="#1f77b4", marker=".", lw=1.2, label="max |Δ| (nats)")
    if not all(math.isnan(v) for v in deltas):
        top.set_yscale("log")
        # plain numbers (a narrow range's minor labels otherwise read 1.4×10¹), thinned as matplotlib's own
        top.yaxis.set_major_formatter(ticker.LogFormatter())
        top.yaxis.set_minor_formatter(ticker.LogFormatter(labelOnlyBase=False))
    top.set_ylabel("max |Δ| per step (nats)")
    share = top.twinx()
    # one filled outline for the whole series, not one bar per step: each row's area reaches halfway to its neighbours
    share.stairs([100 * v for v in _column(history, "quarantined_share")], _edges(steps), fill=True, color="#d62728",
                 alpha=0.3, label="quarantined share (%)")
    share.set_ylabel("quarantined (%)")
    share.set_ylim(0, 100)
    top.set_title(title or "Mismatch against the engine's state per step")
    usage_max = _column(history, "engine/kv_cache_usage_max")
    if all(math.isnan(v) for v in usage_max):  # server mode: the gauge at scrape time
        usage_max = _column(history, "engine/kv_cache_usage")
    usage_mean = _column(history, "engine/kv_cache_usage_mean")
    middle.plot(steps, [100 * v for v in usage_max], color="#9467bd", marker="o", ms=3, lw=1.2,
                label="KV-cache usage, max (%)")
    middle.plot(steps, [100 * v for v in usage_mean], color="#9467bd", ls="--", lw=1, label="KV-cache usage, mean (%)")
    middle.set_ylabel("KV-cache usage (%)")
    running = middle.twinx()
    running_max = _column(history, "engine/running_requests_max")
    if all(math.isnan(v) for v in running_max):
        running_max = _column(history, "engine/running_requests")
    running.plot(steps, running_max, color="#2ca02c", marker="s", ms=3, lw=1.2, label="running requests, max")
    running.set_ylabel("running requests")
    versions = _column(history, "engine/weight_version")
    bottom.step(steps, versions, where="mid", color="#ff7f0e", lw=1.5, label="weight version (syncs)")
    bottom.set_ylabel("weight version")
    preempted = bottom.twinx()
    preemptions = _column(history, "engine/preemptions")
    preempted.plot(steps, preemptions, color="#8c564b", marker="x", lw=0.8, label="preemptions")
    preempted.set_ylabel("preemptions")
    bottom.set_xlabel("training step")
    for axis in (top, middle, bottom):
        axis.grid(True, alpha=0.3)
    for axis, values in ((running, running_max), (bottom, versions), (preempted, preemptions)):  # counts: from 0
        axis.yaxis.set_major_locator(ticker.MaxNLocator(integer=True))
        upper = max([v for v in values if not math.isnan(v)], default=0) + 1
        axis.set_ylim(-0.05 * upper, upper)  # a marker at 0 drawn whole
    bottom.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))  # training steps
    for axis, twin, missing in ((middle, running, "KV-cache usage, running requests: not given by this engine mode "
                                 "(engine stats off?)"),
                                (bottom, preempted, "weight version, preemptions: not given (no vLLM engine?)")):
        if all(math.isnan(v) for line in axis.get_lines() + twin.get_lines() for v in line.get_ydata()):
            axis.text(0.5, 0.5, missing, ha="center", va="center", transform=axis.transAxes, fontsize=9,
                      color="#7f7f7f")
            axis.set_yticks([])
            twin.set_yticks([])
    handles = [h for axis in (top, share, middle, running, bottom, preempted)
               for h in axis.get_legend_handles_labels()[0]]
    figure.legend(handles=handles, loc="outside right upper", fontsize=8, frameon=False)
    return figure


def engine_samples_chart(samples: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """Each rollout's max |Δ| (log) against its own engine context (rows of
    :func:`rollout_guard.outputs.engine_view.sample_rows`): weight version, KV-cache usage during its life (max) and running
    requests during its life (max); suspect rollouts circled in red. A panel whose field the engine did not give
    says so."""
    panels = (("weight_version", "weight version (syncs since start)"),
              ("kv_cache_usage_max", "KV-cache usage during the rollout, max (%)"),
              ("running_requests_max", "running requests during the rollout, max"))
    figure, axes = plt.subplots(1, len(panels), figsize=(15, 4.6), dpi=110, sharey=True, layout="constrained")
    delta = _floored(_column(samples, "max_abs_delta"))
    suspect = [bool(row.get("suspect")) for row in samples]
    for axis, (key, label) in zip(axes, panels, strict=True):
        xs = _column(samples, key)
        if key == "kv_cache_usage_max":
            xs = [100 * v for v in xs]
        if all(math.isnan(v) for v in xs):
            axis.text(0.5, 0.5, f"{key}: not given by this engine mode\n(engine stats off?)", ha="center", va="center",
                      transform=axis.transAxes, fontsize=9, color="#7f7f7f")
        else:
            axis.scatter(xs, delta, s=12, color="#1f77b4", alpha=0.6, label="rollout")
            flagged = [(x, y) for x, y, s in zip(xs, delta, suspect, strict=True) if s]
            if flagged:
                axis.scatter(*zip(*flagged), s=60, facecolors="none", edgecolors="#d62728", linewidths=1.4,
                             label="suspect")
        axis.set_xlabel(label)
        axis.grid(True, alpha=0.3)
        if key != "kv_cache_usage_max":  # counts
            axis.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    if not all(math.isnan(v) for v in delta):
        axes[0].set_yscale("log")
    axes[0].set_ylabel(f"max |logprob engine − trainer| of the rollout (nats; 0 at {DELTA_FLOOR:g})")
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        figure.legend(handles, labels, loc="outside right upper", fontsize=8, frameon=False)
    figure.suptitle(title or f"Each rollout's mismatch against its engine context ({len(samples)} rollouts)",
                    fontsize=10)
    return _save(figure, path)
