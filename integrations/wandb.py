"""Weights & Biases sink: true per-step values, spike charts, the quarantine table and alerts.

Logs into the active run (``wandb.run``, e.g. the one TRL's ``report_to="wandb"`` starts), from the main
process only, with ``train/global_step`` in the payload and never ``step=`` (an explicit step drops data once
TRL or others have logged at a later internal step). Per step it sends only scalars and one fixed-bin
histogram; chart images go out on steps with suspect samples (at most every ``spike_image_min_gap_steps``)
and at least every ``image_every_steps``. The quarantine table is an incremental W&B table: each step uploads
only its new rows.
"""

from __future__ import annotations

import logging
import math
from datetime import timedelta
from pathlib import Path
from typing import Any

from rollout_guard.extras import require_extra

require_extra("rollout_guard.integrations.wandb", ("wandb", "numpy", "matplotlib"), "wandb")
import numpy as np

from rollout_guard.outputs.charts import spike_chart, token_chart
from rollout_guard.config import GuardConfig
from rollout_guard.guard import RolloutGuard, StepReport
from rollout_guard.outputs.records import QuarantineRecord
from rollout_guard.outputs.sinks import Sink, finite_metrics
from rollout_guard.statistics import DELTA_BIN_EDGES

logger = logging.getLogger("rollout_guard")

PREFIX = "rollout_guard/"
INTERNAL_PREFIX = "rollout_guard_internal/"  # how the guard works (rollout_guard.outputs.sinks.INTERNAL_METRICS): own section
TABLE_COLUMNS = [
    "step", "rollout", "action", "why", "rules", "score", "prompt", "completion", "reward", "max_abs_delta",
    "mean_abs_delta", "onset_token", "onset_text", "engine_mean_logprob", "trainer_mean_logprob", "injected",
]


def log10_bin_edges() -> np.ndarray:
    """Edges of the |Δ| histogram in log10 units; the [0, 1e-6) bin is drawn as [-7, -6), overflow as [2, 2.125)."""
    edges = np.log10(np.clip(DELTA_BIN_EDGES.numpy(), 1e-7, None))
    return np.append(edges, edges[-1] + 0.125)


def table_row(record: QuarantineRecord) -> list[Any]:
    first = record.stats.get("onset_token")
    first = int(first) if first is not None and first >= 0 else None
    return [
        record.step, record.global_row, record.action, record.explanation, ", ".join(record.rules),
        record.stats.get("score"), record.prompt_text,
        record.completion_text if record.full_evidence else "(statistics only: beyond evidence_samples_per_step)",
        record.reward, record.stats.get("max_abs_delta"), record.stats.get("mean_abs_delta"), first,
        record.completion_tokens[first] if first is not None and first < len(record.completion_tokens) else None,
        record.stats.get("engine_mean_logprob"), record.stats.get("trainer_mean_logprob"), record.injected,
    ]


class WandbSink(Sink):
    """Sends the guard's view of each step to the active W&B run. ``image_dir``: where chart PNGs are written."""

    def __init__(self, config: GuardConfig, image_dir: str | Path, run: Any = None) -> None:
        import wandb

        self.wandb = wandb
        self.config = config
        self.image_dir = Path(image_dir)
        self._run = run
        self._defined_for: Any = None
        self._table = None
        self._step_records: list[QuarantineRecord] = []
        self._last_image_step: int | None = None
        self._warned = False
        self.edges = log10_bin_edges()

    @property
    def run(self) -> Any:
        return self._run if self._run is not None else self.wandb.run

    def on_records(self, records: list[QuarantineRecord], guard: RolloutGuard) -> None:
        self._step_records.extend(records)

    def on_step(self, report: StepReport, guard: RolloutGuard) -> None:
        records, self._step_records = self._step_records, []
        run = self.run
        if run is None:
            if not self._warned:
                self._warned = True
                logger.warning("rollout_guard: no active W&B run (wandb.init or report_to='wandb'); W&B sink idle")
            return
        if self._defined_for is not run:
            run.define_metric("train/global_step")
            run.define_metric(f"{PREFIX}*", step_metric="train/global_step", step_sync=True)
            run.define_metric(f"{INTERNAL_PREFIX}*", step_metric="train/global_step", step_sync=True)
            run.config.update({"rollout_guard": self.config.to_dict()}, allow_val_change=True)  # the run's settings
            self._defined_for = run
        payload: dict[str, Any] = finite_metrics(report.metrics, PREFIX, INTERNAL_PREFIX)
        counts = report.delta_histogram.numpy()
        if counts.sum() > 0:
            payload[f"{PREFIX}log10_abs_delta"] = self.wandb.Histogram(np_histogram=(counts, self.edges))
        if records:
            if self._table is None:
                self._table = self.wandb.Table(columns=TABLE_COLUMNS, log_mode="INCREMENTAL")
            for record in records:
                self._table.add_data(*table_row(record))
            payload[f"{PREFIX}quarantine_table"] = self._table
        if self._images_due(report):
            payload.update(self._images(report, guard, records))
        payload["train/global_step"] = report.step
        run.log(payload)
        for alert in report.alerts:
            run.alert(title=alert.title, text=alert.text, level=getattr(self.wandb.AlertLevel, alert.level),
                      wait_duration=timedelta(minutes=1))

    def _images_due(self, report: StepReport) -> bool:
        since = math.inf if self._last_image_step is None else report.step - self._last_image_step
        spiking = report.metrics.get("suspect", 0) > 0
        return (spiking and since >= self.config.spike_image_min_gap_steps) or since >= self.config.image_every_steps

    def _images(self, report: StepReport, guard: RolloutGuard, records: list[QuarantineRecord]) -> dict[str, Any]:
        self._last_image_step = report.step
        images = {}
        chart = spike_chart(guard.totals.history, self.config.ceiling_delta,
                            self.image_dir / f"spikes_step{report.step:07d}.png",
                            title=f"rollout_guard up to step {report.step}")
        images[f"{PREFIX}spike_chart"] = self.wandb.Image(str(chart), caption=f"up to step {report.step}")
        full = [record for record in records if record.full_evidence]
        if full:
            worst = max(full, key=lambda record: record.stats.get("score") or -math.inf)
            path = token_chart(worst, self.image_dir / f"worst_step{report.step:07d}_row{worst.global_row}.png")
            images[f"{PREFIX}worst_sample"] = self.wandb.Image(
                str(path), caption=f"step {worst.step}, rollout {worst.global_row}: {worst.completion_text[:80]!r}"
            )
        return images

    def on_end(self, guard: RolloutGuard) -> None:
        run = self.run
        if run is None or not guard.totals.history:
            return
        chart = spike_chart(guard.totals.history, self.config.ceiling_delta, self.image_dir / "spikes_final.png",
                            title="rollout_guard, whole run")
        run.log({f"{PREFIX}spike_chart": self.wandb.Image(str(chart), caption="whole run"),
                 "train/global_step": guard.totals.history[-1]["step"]})
        for key, value in guard.summary().items():
            run.summary[f"{PREFIX}total/{key}"] = value
