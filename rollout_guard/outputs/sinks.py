"""Sinks: where reports go. One hook per event, called on the main process only.

``on_records`` when a step has suspect samples, ``on_step`` after every guarded step (with the step's alerts),
``on_end`` when training ends. :class:`LocalFilesSink` writes everything to a folder, for people without W&B;
``rollout-guard report`` turns that folder into one HTML page.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from rollout_guard.config import GuardConfig
from rollout_guard.extras import MissingExtraError, require_extra
from rollout_guard.guard import RolloutGuard, StepReport
from rollout_guard.outputs.records import QuarantineRecord, json_safe
from rollout_guard.outputs.store import QuarantineStore, drop_records_after

logger = logging.getLogger("rollout_guard")


DETECTOR_STATES_FILE = "detector_states.jsonl"


def read_detector_states(directory: str | Path) -> dict[int, dict]:
    """The detector states a guard folder holds (``LocalFilesSink``), by step (a resumed run's last line of a step
    wins); unreadable lines are skipped. Empty when the folder has none."""
    path = Path(directory) / DETECTOR_STATES_FILE
    states: dict[int, dict] = {}
    if not path.is_file():
        return states
    for line in path.read_bytes().splitlines():
        try:
            row = json.loads(line)
            states[int(row["step"])] = row["detector"]
        except (ValueError, TypeError, KeyError):
            continue
    return states


class Sink:
    """Where the guard's outputs go: one no-op hook per event, a sink overrides those it handles (as Lightning's
    ``Callback``). Hooks run on the main process, on the background writer thread when there is one; one that raises
    is logged and counted (``output_failures``), or stops the run with ``strict=True``."""

    def on_records(self, records: list[QuarantineRecord], guard: RolloutGuard) -> None:
        """Suspect samples of the current step, from all processes (called before ``on_step``)."""

    def on_step(self, report: StepReport, guard: RolloutGuard) -> None:
        """Once per judged step, after ``on_records``; ``report.alerts`` holds the step's alerts (the circuit breaker
        and guard failures included), ``report.skipped`` says the guard could not judge it."""

    def on_resume(self, step: int, guard: RolloutGuard) -> None:
        """Training resumed from a checkpoint saved after ``step``: drop what was written after it."""

    def on_end(self, guard: RolloutGuard) -> None:
        """Training ended; flush and close."""


INTERNAL_METRICS = ("noise/", "score_threshold", "noise_resets", "guard_seconds", "overhead_seconds", "samples",
                    "tokens", "compared_tokens", "engine_max_logprob", "engine_mean_logprob", "trainer_max_logprob",
                    "trainer_mean_logprob", "kl_k3")
"""Metric names (or name prefixes) that show how the guard works rather than what it found: trackers log them under
their own first segment (W&B makes one panel section of each), so that the panels a user scans stand alone."""


def finite_metrics(metrics: dict[str, float], prefix: str = "", internal_prefix: str | None = None) -> dict[str, float]:
    """The finite numbers of a metrics dict, keys prefixed (what trackers can plot); with ``internal_prefix``, the
    :data:`INTERNAL_METRICS` under it instead.

    >>> finite_metrics({"suspect": 1.0, "noise/scale_r0": 0.2, "max_score": float("nan")}, "rollout_guard/",
    ...                "rollout_guard_internal/")
    {'rollout_guard/suspect': 1.0, 'rollout_guard_internal/noise/scale_r0': 0.2}
    """
    return {f"{internal_prefix}{key}" if internal_prefix is not None and _internal(key) else f"{prefix}{key}": value
            for key, value in metrics.items() if isinstance(value, (int, float)) and math.isfinite(value)}


def _internal(key: str) -> bool:
    return any(key == name or (name.endswith("/") and key.startswith(name)) for name in INTERNAL_METRICS)


def _step_after(line: bytes, step: int) -> bool:
    try:
        return int(json.loads(line)["step"]) > step
    except (ValueError, TypeError, KeyError):
        return False


class LocalFilesSink(Sink):
    """Writes ``metrics.jsonl`` (one line per step, with the step's |Δ| histogram), ``alerts.jsonl``, the
    quarantine store, ``detector_states.jsonl`` (per step with suspect rollouts, the detector's state it was judged
    against: ``rollout-guard replay`` judges with it), ``spikes.png`` and ``summary.json``."""

    def __init__(self, directory: str | Path, config: GuardConfig) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.store = QuarantineStore(self.directory / "quarantine")
        self.metrics_path = self.directory / "metrics.jsonl"
        self.alerts_path = self.directory / "alerts.jsonl"
        self.states_path = self.directory / DETECTOR_STATES_FILE
        self.chart_path = self.directory / "spikes.png"
        self._no_charts = False
        (self.directory / "config.json").write_text(json.dumps(config.to_dict(), indent=2))

    def on_step(self, report: StepReport, guard: RolloutGuard) -> None:
        row = {"step": report.step, **json_safe(report.metrics), "delta_histogram": report.delta_histogram.tolist()}
        with self.metrics_path.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        if report.detector_state is not None:
            state = {name: value.cpu().tolist() for name, value in report.detector_state.items()}
            with self.states_path.open("a") as handle:
                handle.write(json.dumps({"step": report.step, "detector": state}) + "\n")
        if report.alerts:
            with self.alerts_path.open("a") as handle:
                for alert in report.alerts:
                    handle.write(json.dumps(json_safe(alert.to_dict())) + "\n")
        if guard.totals.steps % self.config.chart_every_steps == 0:
            self.draw_chart(guard)

    def on_records(self, records: list[QuarantineRecord], guard: RolloutGuard) -> None:
        self.store.append(records)

    def on_resume(self, step: int, guard: RolloutGuard) -> None:
        """Training resumed from the checkpoint of ``step``: drop what this folder holds about later steps (they
        run again), so that every step has one metrics line and one set of records."""
        for path in (self.metrics_path, self.alerts_path, self.states_path):
            if path.is_file():
                lines = path.read_bytes().splitlines(keepends=True)
                kept = [line for line in lines if not _step_after(line, step)]
                if len(kept) != len(lines):
                    path.write_bytes(b"".join(kept))
        drop_records_after(self.store.directory, step)

    def on_end(self, guard: RolloutGuard) -> None:
        self.draw_chart(guard)
        (self.directory / "summary.json").write_text(json.dumps(guard.summary(), indent=2))
        self.store.close()

    def draw_chart(self, guard: RolloutGuard) -> Path | None:
        """Redraw ``spikes.png``; without matplotlib (the ``charts`` extra) say so once and write no chart."""
        if not guard.totals.history or self._no_charts:
            return None
        try:
            from rollout_guard.outputs.charts import spike_chart
        except MissingExtraError as error:
            self._no_charts = True
            logger.warning("rollout_guard: no spikes.png (%s); metrics.jsonl has the same numbers", error)
            return None
        return spike_chart(guard.totals.history, self.config.ceiling_delta, self.chart_path)


class StepTableSink(Sink):
    """Prints one table row per guarded step (rich: the `cli` extra), for watching a run closely (the demo does).
    Alerts and the end-of-training summary are :class:`rollout_guard.outputs.console.ConsoleSink`'s."""

    COLUMNS = (
        ("step", "step", "{:.0f}"), ("samples", "rollouts", "{:.0f}"), ("max_abs_delta", "max|Δ|", "{:.2e}"),
        ("p99_abs_delta", "p99|Δ|", "{:.2e}"), ("kept_max_abs_delta", "kept max|Δ|", "{:.2e}"),
        ("max_score", "max score", "{:.1f}"), ("kept_max_score", "kept score", "{:.1f}"),
        ("injected", "injected", "{:.0f}"), ("suspect", "suspect", "{:.0f}"), ("quarantined", "quarant.", "{:.0f}"),
        ("guard_seconds", "guard ms", "{:.2f}"),
    )

    def __init__(self, console=None) -> None:  # noqa: ANN001
        require_extra("StepTableSink", ("rich",), "cli")
        from rich.console import Console

        self.console = console or Console()
        self._header_printed = False

    def _row(self, values: dict[str, float]) -> str:
        cells = []
        for key, _, fmt in self.COLUMNS:
            value = values.get(key)
            if key == "guard_seconds" and value is not None:
                value = value * 1000
            text = ("-" if value is None or (isinstance(value, float) and not math.isfinite(value))
                else fmt.format(value))
            cells.append(f"{text:>11}")
        return "".join(cells)

    def on_step(self, report: StepReport, guard: RolloutGuard) -> None:
        if not self._header_printed:
            self.console.print("".join(f"{title:>11}" for _, title, _ in self.COLUMNS), style="bold", highlight=False,
                               soft_wrap=True)
            self._header_printed = True
        style = "red" if report.metrics.get("suspect") else None
        self.console.print(self._row({"step": report.step, **report.metrics}), style=style, highlight=False,
                           soft_wrap=True)

    def on_records(self, records: list[QuarantineRecord], guard: RolloutGuard) -> None:
        pass

    def on_end(self, guard: RolloutGuard) -> None:
        pass
