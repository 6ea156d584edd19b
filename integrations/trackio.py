"""trackio sink: the guard's per-step scalars into the active trackio run (``report_to="trackio"``).

Transformers' trackio callback starts its run at the first ``on_log``, after the guard's first step; rows are
held until a run exists and then sent with ``train/global_step``, as transformers does for its own logs.
"""

from __future__ import annotations

from rollout_guard.extras import require_extra
from rollout_guard.guard import RolloutGuard, StepReport
from rollout_guard.outputs.records import QuarantineRecord
from rollout_guard.outputs.sinks import Sink, finite_metrics

PREFIX = "rollout_guard/"
INTERNAL_PREFIX = "rollout_guard_internal/"  # how the guard works (rollout_guard.outputs.sinks.INTERNAL_METRICS): own section


class TrackioSink(Sink):
    def __init__(self) -> None:
        require_extra("TrackioSink", ("trackio",), "trackio")
        import trackio

        self.trackio = trackio
        self.pending: list[dict[str, float]] = []

    def _flush(self) -> None:
        if self.trackio.context_vars.current_run.get() is None:
            return
        for row in self.pending:
            self.trackio.log(row)
        self.pending.clear()

    def on_records(self, records: list[QuarantineRecord], guard: RolloutGuard) -> None:
        pass

    def on_step(self, report: StepReport, guard: RolloutGuard) -> None:
        row: dict[str, float] = finite_metrics(report.metrics, PREFIX, INTERNAL_PREFIX)
        row["train/global_step"] = report.step
        self.pending.append(row)
        self._flush()

    def on_end(self, guard: RolloutGuard) -> None:
        self._flush()
