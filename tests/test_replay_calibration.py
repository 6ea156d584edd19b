"""``rollout-guard replay`` judges a record against the detector state its step was judged against in training."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rollout_guard.cli import calibration_lines, replay_config
from rollout_guard.config import GuardConfig
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.guard import RolloutGuard
from rollout_guard.integrations.vllm_tools import judge_one
from rollout_guard.outputs.sinks import LocalFilesSink, read_detector_states


def healthy(generator: torch.Generator, rows: int = 16, tokens: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Engine logprobs in [−2, 0] and a trainer that agrees to 1e-3 nats."""
    engine = -2 * torch.rand(rows, tokens, generator=generator)
    return engine, engine + 1e-3 * torch.randn(rows, tokens, generator=generator)


def run(directory, steps: int = 40):
    """A run of healthy steps whose last step has one row the engine favours by 1 nat on 4 tokens: suspect against
    the run's tight noise, not against the detector's prior."""
    config = GuardConfig(max_quarantine_share=None)
    guard, sink = RolloutGuard(config), LocalFilesSink(directory, config)
    generator = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        engine, trainer = healthy(generator)
        if step == steps:
            trainer[3, 5:9] = engine[3, 5:9] - 1.0
        report = guard.inspect(RolloutEvidence(mask=torch.ones_like(engine, dtype=torch.long), engine_logprobs=engine,
                                               trainer_logprobs=trainer), step=step)
        sink.on_step(report, guard)
    sink.on_end(guard)
    return report, engine[3].tolist(), trainer[3].tolist()


def test_replay_judges_a_record_against_the_runs_detector_state_at_its_step(tmp_path):
    report, engine, trainer = run(tmp_path)
    assert report.suspect.tolist() == [row == 3 for row in range(16)], "training flagged the row"
    states = read_detector_states(tmp_path)
    assert list(states) == [40], "a state is kept for the steps with suspect rollouts only"
    config = replay_config(tmp_path)
    assert bool(judge_one(engine, trainer, 40, config, states[40]).suspect[0]), "the verdict training made"
    assert not bool(judge_one(engine, trainer, 40, config).suspect[0]), "the prior alone does not flag it"


def test_replay_says_when_it_has_no_state_for_a_records_step(tmp_path):
    calibrated = SimpleNamespace(record=SimpleNamespace(step=40), calibrated=True)
    other = SimpleNamespace(record=SimpleNamespace(step=7), calibrated=False)
    lines = calibration_lines([calibrated, other], tmp_path)
    assert lines[0].startswith("verdicts judged against the run's detector state at each record's step")
    assert lines[1].startswith(f"NOT CALIBRATED: {tmp_path} holds no detector state for step(s) [7]")
    assert calibration_lines([calibrated], tmp_path) == lines[:1]


def test_a_resumed_run_drops_the_detector_states_of_the_steps_it_runs_again(tmp_path):
    run(tmp_path, steps=40)
    sink = LocalFilesSink(tmp_path, GuardConfig())
    sink.on_resume(39, RolloutGuard())
    assert read_detector_states(tmp_path) == {}
