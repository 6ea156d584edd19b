"""What a person running a plain training script sees from the guard: alerts as they happen, a summary at the end.

:class:`ConsoleSink` logs each alert when the guard raises it (``WARNING``; error-level ones at ``ERROR``, a stop by
the circuit breaker by its title only: the ``CircuitBreakerTripped`` that ends training says why) and,
when training ends, a short summary: rollouts judged, how many were quarantined, the rules that fired, the worst
step, and where the evidence and the report are. It writes through the ``rollout_guard`` logger: when the
application has configured logging, the lines go where it sends them (at ``INFO`` and above, unless the
application set the ``rollout_guard`` logger's level itself); when nothing is configured, as in a plain script,
the sink adds one handler on stderr (rich's when rich is installed and stderr is a terminal), so they show.
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path
from typing import TextIO

from rollout_guard.guard import RolloutGuard, StepReport
from rollout_guard.outcomes import outcome_lines
from rollout_guard.outputs.records import QuarantineRecord
from rollout_guard.verdict import fired_rules
from rollout_guard.outputs.sinks import Sink

logger = logging.getLogger("rollout_guard")


def worst_step(history: list[dict[str, float]]) -> dict[str, float] | None:
    """The step row with the most suspect samples (ties: the larger max |Δ|); None without steps.

    >>> worst_step([{"step": 1, "suspect": 2, "max_abs_delta": 9.0}, {"step": 2, "suspect": 2, "max_abs_delta": 12.0},
    ...             {"step": 3, "suspect": 0, "max_abs_delta": 30.0}])["step"]
    2
    >>> worst_step([]) is None
    True
    """
    def key(row: dict[str, float]) -> tuple[float, float]:
        delta = row.get("max_abs_delta", math.nan)
        return row.get("suspect", 0), delta if delta is not None and math.isfinite(delta) else -math.inf

    return max(history, key=key) if history else None


def summary_lines(guard: RolloutGuard, directory: str | Path | None = None) -> list[str]:
    """The end-of-training summary, one string per line (``directory``: where the guard's local files are)."""
    totals = guard.totals
    checks = [f"  checks: {guard.checks}"] if guard.checks is not None else []
    if not totals.steps and not totals.failures:
        return ["rollout_guard: no training step was guarded.", *checks]
    quarantines = guard.config.quarantines
    count = totals.quarantined if quarantines else totals.suspect
    verb = "quarantined (kept out of the loss)" if quarantines else "suspect (monitor mode: all kept in the loss)"
    every = totals.steps + totals.failures
    steps = f"{every} step" + ("s" if every != 1 else "")
    if totals.failures:
        steps += f" ({totals.failures} UNGUARDED)"
    lines = [f"rollout_guard: {steps}, {totals.rollouts} rollouts judged; {count} {verb}, "
             f"{count / max(totals.rollouts, 1):.2%}."]
    lines.extend(checks)
    lines.append(f"  rules fired: {fired_rules(totals.rule_counts)}")
    worst = worst_step(totals.history)
    if worst is not None and worst.get("suspect", 0):
        lines.append(f"  worst step: {int(worst['step'])} ({int(worst['suspect'])} suspect, "
                     f"max |Δ| {worst['max_abs_delta']:.3g} nats)")
    lines.extend(outcome_lines(totals.outcomes))
    if totals.labelled_steps:
        lines.append(f"  injected {totals.injected}: caught {totals.caught}, missed {totals.injected - totals.caught}, "
                     f"false alarms {totals.false_alarms}")
    if totals.failures:
        lines.append(f"  guard failures: {totals.failures} steps passed through unguarded (see the warnings above)")
    if totals.output_failures:
        lines.append(f"  output failures: {totals.output_failures} (records, sinks or engine context on this process; "
                     "those steps were judged: see the warnings above)")
    if totals.steps_over_ceiling:
        lines.append(f"  steps over max_quarantine_share: {totals.steps_over_ceiling} (metric over_ceiling)")
    if totals.skipped_optimizer_steps:
        lines.append(f"  optimizer steps skipped: {totals.skipped_optimizer_steps} (every row behind them quarantined)")
    if totals.stopped:
        lines.append("  STOPPED by the circuit breaker: summary.json 'stopped' says why")
    if totals.would_have_stopped:
        lines.append(f"  monitor mode: {totals.would_have_stopped}")
    if directory is not None:
        directory = Path(directory)
        lines.append(f"  evidence: {directory / 'quarantine'} (one record per suspect sample)")
        lines.append(f"  per-step values: {directory / 'metrics.jsonl'}")
        lines.append(f"  report: rollout-guard report {directory}")
    return lines


def _show_when_unconfigured(stream: TextIO) -> None:
    """Make INFO lines of the ``rollout_guard`` logger visible if nothing else would show them."""
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if logger.hasHandlers():  # the application (or an earlier ConsoleSink) configured where log lines go
        return
    handler: logging.Handler
    try:
        from rich.logging import RichHandler

        if not stream.isatty():
            raise ImportError("not a terminal")
        from rich.console import Console

        handler = RichHandler(console=Console(file=stream), show_time=False, show_path=False, markup=False)
    except ImportError:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.propagate = False  # a root handler added later would print every line twice


class ConsoleSink(Sink):
    """Alerts as they happen and a summary at the end, through the ``rollout_guard`` logger.

    Args:
        directory: the guard's local files (``LocalFilesSink``'s folder), named in the summary; None to omit.
        stream: where the lines go when logging is not configured (default stderr).
    """

    def __init__(self, directory: str | Path | None = None, stream: TextIO | None = None) -> None:
        self.directory = directory
        _show_when_unconfigured(stream or sys.stderr)

    def on_records(self, records: list[QuarantineRecord], guard: RolloutGuard) -> None:
        pass

    def on_step(self, report: StepReport, guard: RolloutGuard) -> None:
        for alert in report.alerts:
            level = logging.ERROR if alert.level == "ERROR" else logging.WARNING
            if alert.kind == "circuit_breaker" and report.stop_training:  # the stop's reason is the caller's to say
                logger.log(level, "%s (circuit breaker; summary.json 'stopped' says why).", alert.title)
                continue
            logger.log(level, "%s. %s", alert.title, alert.text)

    def on_end(self, guard: RolloutGuard) -> None:
        logger.info("\n".join(summary_lines(guard, self.directory)))
