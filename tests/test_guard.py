import math
import threading

import pytest
import torch

from rollout_guard.config import GuardConfig
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.guard import RolloutGuard


class ThreadGroup:
    """A gather across threads standing in for processes: concatenates in rank order, counts calls."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots: list[torch.Tensor | None] = [None] * world
        self.calls = [0] * world

    def gather_for(self, rank: int):
        def gather(tensor: torch.Tensor) -> torch.Tensor:
            self.calls[rank] += 1
            self.slots[rank] = tensor
            self.barrier.wait()
            out = torch.cat(list(self.slots))
            self.barrier.wait()
            return out

        return gather


def batch(seed: int, corrupt_rows: list[int], batch_size: int = 4, length: int = 6) -> RolloutEvidence:
    generator = torch.Generator().manual_seed(seed)
    engine = -torch.rand(batch_size, length, generator=generator)
    trainer = engine + 1e-4 * torch.randn(batch_size, length, generator=generator)
    for row in corrupt_rows:
        engine[row] = -0.01
        trainer[row] = -9.0
    mask = torch.ones(batch_size, length, dtype=torch.long)
    mask[:, -1] = 0
    injected = torch.zeros(batch_size, dtype=torch.bool)
    injected[corrupt_rows] = True
    return RolloutEvidence(mask=mask, engine_logprobs=engine, trainer_logprobs=trainer, injected=injected)


def test_single_process_report_and_totals():
    guard = RolloutGuard(GuardConfig())
    report = guard.inspect(batch(0, [2]), step=7)
    assert report.step == 7
    assert report.suspect.tolist() == [False, False, True, False]
    assert report.quarantined.tolist() == report.suspect.tolist()
    assert report.local_quarantined.tolist() == [False, False, True, False]
    metrics = report.metrics
    assert metrics["quarantined"] == 1 and metrics["quarantined_share"] == 0.25
    assert metrics["caught"] == 1 and metrics["missed"] == 0 and metrics["false_alarms"] == 0
    assert metrics["max_abs_delta"] == pytest.approx(8.99, abs=1e-4)
    assert metrics["kept_max_abs_delta"] < 1e-3
    assert metrics["rule/mean_drift"] == 1 and metrics["guard_seconds"] > 0
    guard.inspect(batch(1, []), step=8)
    summary = guard.summary()
    assert summary["rollouts"] == 8 and summary["quarantined"] == 1 and summary["caught"] == 1
    assert [row["step"] for row in guard.totals.history] == [7, 8]


def test_monitor_mode_judges_but_quarantines_nothing():
    report = RolloutGuard(GuardConfig(mode="monitor")).inspect(batch(0, [1, 3]), step=0)
    assert report.suspect.sum() == 2
    assert not report.quarantined.any() and not report.local_quarantined.any()
    assert report.metrics["suspect"] == 2 and report.metrics["quarantined"] == 0


def test_two_processes_call_gather_once_and_agree_on_everything():
    group = ThreadGroup(2)
    guards = [RolloutGuard(GuardConfig(), gather=group.gather_for(rank), process_index=rank) for rank in range(2)]
    evidence = [batch(10, [0]), batch(11, [1, 3])]
    reports = [None, None]

    def run(rank: int) -> None:
        reports[rank] = guards[rank].inspect(evidence[rank], step=3)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert group.calls == [1, 1]
    first, second = reports
    assert torch.equal(first.suspect, second.suspect)
    assert first.suspect.tolist() == [True, False, False, False, False, True, False, True]
    assert first.local_quarantined.tolist() == [True, False, False, False]
    assert second.local_quarantined.tolist() == [False, True, False, True]
    assert (first.local_rows, second.local_rows) == (slice(0, 4), slice(4, 8))
    same = {k: v for k, v in first.metrics.items() if k != "guard_seconds"}
    other = {k: v for k, v in second.metrics.items() if k != "guard_seconds"}
    assert same.keys() == other.keys()
    assert all((math.isnan(v) and math.isnan(other[k])) or v == other[k] for k, v in same.items())
    single = RolloutGuard(GuardConfig())
    both = RolloutEvidence(
        mask=torch.cat([e.mask for e in evidence]),
        engine_logprobs=torch.cat([e.engine_logprobs for e in evidence]),
        trainer_logprobs=torch.cat([e.trainer_logprobs for e in evidence]),
        injected=torch.cat([e.injected for e in evidence]),
    )
    alone = single.inspect(both, step=3)
    assert torch.equal(alone.suspect, first.suspect)
    assert alone.metrics["max_abs_delta"] == first.metrics["max_abs_delta"]


def test_state_round_trip():
    guard = RolloutGuard(GuardConfig())
    guard.inspect(batch(0, [2]), step=1)
    restored = RolloutGuard(GuardConfig())
    restored.load_state_dict(guard.state_dict())
    assert restored.summary() == guard.summary()
    assert restored.totals.history == guard.totals.history


def test_circuit_breaker_stops_or_alerts_as_configured():
    stopping = RolloutGuard(GuardConfig(max_quarantine_share=0.5, ceiling_steps=2))
    assert stopping.inspect(batch(0, [0, 1, 2]), step=1).stop_training is None  # 75 %, but only one step so far
    report = stopping.inspect(batch(1, [0, 1, 2]), step=2)
    assert report.stop_training and "max_quarantine_share=0.5 for 2 step(s)" in report.stop_training
    assert [a.kind for a in report.alerts if a.level == "ERROR"] == ["circuit_breaker"]
    assert stopping.summary()["stopped"] == report.stop_training
    alerting = RolloutGuard(GuardConfig(max_quarantine_share=0.5, on_ceiling="alert", alert_cooldown_steps=10))
    kinds = [[a.kind for a in alerting.inspect(batch(s, [0, 1, 2]), step=s).alerts] for s in range(1, 13)]
    assert alerting.inspect(batch(20, [0, 1, 2]), step=20).stop_training is None
    breaker_steps = [step for step, k in enumerate(kinds, start=1) if "circuit_breaker" in k]
    assert breaker_steps == [1, 11], "error alerts, throttled by the cooldown, and training goes on"
    calm = RolloutGuard(GuardConfig(max_quarantine_share=0.5))
    assert calm.inspect(batch(0, [0]), step=1).stop_training is None  # 25 % is under the ceiling
