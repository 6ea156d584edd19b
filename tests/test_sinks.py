import json

import matplotlib.image
import torch

from rollout_guard.config import GuardConfig
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.guard import RolloutGuard
from rollout_guard.outputs.sinks import LocalFilesSink, StepTableSink


def evidence(corrupt: bool) -> RolloutEvidence:
    engine = torch.full((4, 5), -0.05)
    trainer = engine.clone()
    if corrupt:
        trainer[1] = -10.0
    return RolloutEvidence(mask=torch.ones(4, 5, dtype=torch.long), engine_logprobs=engine, trainer_logprobs=trainer)


def test_local_files_sink_writes_metrics_chart_and_summary(tmp_path):
    config = GuardConfig(chart_every_steps=2)
    guard = RolloutGuard(config)
    sink = LocalFilesSink(tmp_path, config)
    for step in range(4):
        sink.on_step(guard.inspect(evidence(step == 2), step=step), guard)
    assert (tmp_path / "spikes.png").exists()  # drawn at step 2 of 4 already
    sink.on_end(guard)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    assert [line["quarantined"] for line in lines] == [0, 0, 1, 0]
    assert lines[0]["max_abs_delta"] == 0.0 and lines[0]["p99_abs_delta"] == 0.0
    image = matplotlib.image.imread(tmp_path / "spikes.png")
    assert image.shape[0] > 300 and image.shape[1] > 800
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["quarantined"] == 1 and summary["rollouts"] == 16
    assert json.loads((tmp_path / "config.json").read_text())["mode"] == "quarantine"


def test_step_table_sink_prints_one_row_per_step():
    from rich.console import Console

    console = Console(record=True, width=200)
    guard = RolloutGuard(GuardConfig())
    sink = StepTableSink(console)
    sink.on_step(guard.inspect(evidence(False), step=0), guard)
    sink.on_step(guard.inspect(evidence(True), step=1), guard)
    lines = console.export_text().splitlines()
    assert "max|Δ|" in lines[0] and len(lines) == 3  # header and one row per step; alerts are the ConsoleSink's
    assert lines[2].split()[0] == "1" and lines[2].split()[1] == "4"
