"""ConsoleSink: alerts when they happen and an end-of-training summary, visible in a plain script."""

from __future__ import annotations

import doctest
import logging
import subprocess
import sys

import pytest
import torch

import rollout_guard.outputs.console
import rollout_guard.extras
from rollout_guard.config import GuardConfig
from rollout_guard.outputs.console import ConsoleSink, summary_lines
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.guard import RolloutGuard


def evidence(corrupt_rows: int) -> RolloutEvidence:
    engine = torch.full((8, 5), -0.05)
    trainer = engine.clone()
    trainer[:corrupt_rows] = -10.0
    return RolloutEvidence(mask=torch.ones(8, 5, dtype=torch.long), engine_logprobs=engine, trainer_logprobs=trainer)


@pytest.mark.parametrize("module", [rollout_guard.outputs.console, rollout_guard.extras])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


def test_alerts_are_logged_when_they_happen_and_the_summary_at_the_end(tmp_path, caplog):
    guard = RolloutGuard(GuardConfig(ceiling_delta=8.0))
    sink = ConsoleSink(tmp_path)
    with caplog.at_level(logging.INFO, logger="rollout_guard"):
        sink.on_step(guard.inspect(evidence(0), step=1), guard)
        assert not caplog.records  # a clean step says nothing
        sink.on_step(guard.inspect(evidence(2), step=2), guard)
        alerts = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert alerts and "25.0% of rollouts quarantined at step 2" in alerts[0].getMessage()
        sink.on_step(guard.inspect(evidence(1), step=3), guard)
        sink.on_end(guard)
    summary = caplog.records[-1].getMessage().splitlines()
    assert caplog.records[-1].levelno == logging.INFO
    assert summary[0] == "rollout_guard: 3 steps, 24 rollouts judged; 3 quarantined (kept out of the loss), 12.50%."
    assert summary[1].startswith("  rules fired: ") and "score 3" in summary[1] and "ceiling 3" in summary[1]
    assert summary[2] == "  worst step: 2 (2 suspect, max |Δ| 9.95 nats)"
    assert summary[-3] == f"  evidence: {tmp_path / 'quarantine'} (one record per suspect sample)"
    assert summary[-2] == f"  per-step values: {tmp_path / 'metrics.jsonl'}"
    assert summary[-1] == f"  report: rollout-guard report {tmp_path}"


def test_summary_in_monitor_mode_and_without_steps():
    guard = RolloutGuard(GuardConfig(mode="monitor"))
    assert summary_lines(guard) == ["rollout_guard: no training step was guarded."]
    guard.inspect(evidence(0), step=1)
    lines = summary_lines(guard)
    assert lines == ["rollout_guard: 1 step, 8 rollouts judged; 0 suspect (monitor mode: all kept in the loss), 0.00%.",
                     "  rules fired: none"]  # no worst step when nothing was suspect, no paths without a folder
    guard.totals.output_failures = 2  # a sink failed twice: the steps were still judged, and the summary says so
    assert lines + ["  output failures: 2 (records, sinks or engine context on this process; those steps were judged: "
                    "see the warnings above)"] == summary_lines(guard)
    guard.totals.failures = 1
    assert "guard failures: 1 steps passed through unguarded" in summary_lines(guard)[-2]


PLAIN_SCRIPT = """
import torch
from rollout_guard import GuardConfig, RolloutEvidence, RolloutGuard
from rollout_guard.outputs.console import ConsoleSink

guard, sink = RolloutGuard(GuardConfig(ceiling_delta=8.0)), ConsoleSink("runs/x/rollout_guard")
engine = torch.full((8, 5), -0.05)
trainer = engine.clone()
trainer[:2] = -10.0
sink.on_step(guard.inspect(RolloutEvidence(mask=torch.ones(8, 5, dtype=torch.long), engine_logprobs=engine, trainer_logprobs=trainer), step=1), guard)
sink.on_end(guard)
"""


def test_a_plain_script_without_logging_set_up_shows_the_lines():
    done = subprocess.run([sys.executable, "-c", PLAIN_SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith("rollout_guard: 25.0% of rollouts quarantined at step 1. 2 of 8 rollouts")
    assert "rollout_guard: 1 step, 8 rollouts judged; 2 quarantined" in done.stderr
    assert lines[-1] == "  report: rollout-guard report runs/x/rollout_guard"


def test_an_application_level_setting_is_respected(caplog):
    logging.getLogger("rollout_guard").setLevel(logging.WARNING)
    try:
        guard = RolloutGuard(GuardConfig(ceiling_delta=8.0))
        sink = ConsoleSink()
        sink.on_step(guard.inspect(evidence(2), step=1), guard)
        sink.on_end(guard)
        assert [r.levelno for r in caplog.records if r.name == "rollout_guard"] == [logging.WARNING, logging.WARNING]
    finally:
        logging.getLogger("rollout_guard").setLevel(logging.NOTSET)


def test_the_trl_adapter_adds_the_console_by_default(tmp_path):
    from rollout_guard.integrations.trl import default_sinks

    sinks = default_sinks("none", GuardConfig(), tmp_path)
    assert [type(sink).__name__ for sink in sinks] == ["LocalFilesSink", "ConsoleSink"]
    assert sinks[1].directory == tmp_path


def test_a_step_passed_through_unguarded_is_logged_as_an_error_and_counted_in_the_summary(caplog):
    guard = RolloutGuard(GuardConfig())
    sink = ConsoleSink()
    with caplog.at_level(logging.INFO, logger="rollout_guard"):
        sink.on_step(guard.inspect(evidence(0), step=1), guard)
        sink.on_step(guard.inspect(RuntimeError("no trainer logprobs"), step=2, batch_size=8), guard)
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "could not judge step 2" in errors[0] and "no trainer logprobs" in errors[0]
    assert summary_lines(guard)[0].startswith("rollout_guard: 2 steps (1 UNGUARDED), 8 rollouts judged")


def test_a_stop_by_the_circuit_breaker_is_said_once_and_steps_over_the_ceiling_are_counted(caplog):
    """The stop's reason is the exception's to say (the TRL adapter raises ``CircuitBreakerTripped`` with it): the
    console logs the stop alert's title and the summary points to summary.json, neither repeats the reason."""
    guard = RolloutGuard(GuardConfig(max_quarantine_share=0.5))
    sink = ConsoleSink()
    with caplog.at_level(logging.INFO, logger="rollout_guard"):
        report = guard.inspect(evidence(6), step=1)
        sink.on_step(report, guard)
        sink.on_end(guard)
    assert report.stop_training and "above max_quarantine_share=0.5" in report.stop_training
    said = [r.getMessage() for r in caplog.records]
    assert not any("above max_quarantine_share=0.5" in line for line in said), said
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == ["rollout_guard stopped training at step 1 (circuit breaker; summary.json 'stopped' says why)."]
    assert "  steps over max_quarantine_share: 1 (metric over_ceiling)" in said[-1].splitlines()
    assert "  STOPPED by the circuit breaker: summary.json 'stopped' says why" in said[-1].splitlines()
