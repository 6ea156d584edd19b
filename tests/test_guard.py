import math
import threading

import pytest
import torch

from rollout_guard.config import GuardConfig
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.errors import GuardError
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

    def run(self, target) -> None:
        """Call ``target(rank)`` on one thread per rank and wait for all of them."""
        threads = [threading.Thread(target=target, args=(rank,)) for rank in range(self.world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)


def batch(seed: int, corrupt_rows: list[int], batch_size: int = 8, length: int = 6) -> RolloutEvidence:
    """Rows whose trainer agrees with the engine to 1e-4 nats, and corrupted rows on which the engine is sure
    (−0.01) of tokens the trainer gives −5 … −13 nats; the last column is padding."""
    generator = torch.Generator().manual_seed(seed)
    engine = -torch.rand(batch_size, length, generator=generator)
    trainer = engine + 1e-4 * torch.randn(batch_size, length, generator=generator)
    for row in corrupt_rows:  # the engine sure of tokens the trainer finds 5–13 nats less likely
        engine[row] = -0.01
        trainer[row] = -5.0 - 8.0 * torch.rand(length, generator=generator)
    mask = torch.ones(batch_size, length, dtype=torch.long)
    mask[:, -1] = 0
    injected = torch.zeros(batch_size, dtype=torch.bool)
    injected[corrupt_rows] = True
    return RolloutEvidence(mask=mask, engine_logprobs=engine, trainer_logprobs=trainer, injected=injected)


def test_single_process_report_and_totals():
    guard = RolloutGuard(GuardConfig())
    report = guard.inspect(batch(0, [2]), step=7)
    assert report.step == 7
    assert report.suspect.tolist() == [False, False, True] + [False] * 5
    assert report.quarantined.tolist() == report.suspect.tolist()
    assert report.local_quarantined.tolist() == report.suspect.tolist()
    metrics = report.metrics
    assert metrics["quarantined"] == 1 and metrics["quarantined_share"] == 0.125
    assert metrics["caught"] == 1 and metrics["missed"] == 0 and metrics["false_alarms"] == 0
    assert 4.99 < metrics["max_abs_delta"] < 12.99
    assert metrics["kept_max_abs_delta"] < 1e-3
    assert metrics["rule/score"] == 1 and metrics["guard_seconds"] > 0
    assert metrics["max_score"] > metrics["score_threshold"] > metrics["kept_max_score"]
    guard.inspect(batch(1, []), step=8)
    summary = guard.summary()
    assert summary["rollouts"] == 16 and summary["quarantined"] == 1 and summary["caught"] == 1
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

    group.run(run)
    assert group.calls == [1, 1]
    first, second = reports
    assert torch.equal(first.suspect, second.suspect)
    expected = [row in (0, 9, 11) for row in range(16)]
    assert first.suspect.tolist() == expected
    assert first.local_quarantined.tolist() == expected[:8]
    assert second.local_quarantined.tolist() == expected[8:]
    assert (first.local_rows, second.local_rows) == (slice(0, 8), slice(8, 16))
    # the detector learned the same kept rows on both ranks
    assert all(torch.equal(a, b) for a, b in zip(guards[0].detector.state_dict().values(),
                                                 guards[1].detector.state_dict().values(), strict=True))
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
    heavy = [0, 1, 2, 3, 4, 5]  # 75 % of the rows
    assert stopping.inspect(batch(0, heavy), step=1).stop_training is None  # but only one step so far
    report = stopping.inspect(batch(1, heavy), step=2)
    assert report.stop_training and "max_quarantine_share=0.5 for 2 step(s)" in report.stop_training
    # the rules that fired at that step, most first, each with its count of rows: where a person starts looking
    assert "rules fired: score " in report.stop_training
    assert [a.kind for a in report.alerts if a.level == "ERROR"] == ["circuit_breaker"]
    assert stopping.summary()["stopped"] == report.stop_training
    alerting = RolloutGuard(GuardConfig(max_quarantine_share=0.5, on_ceiling="alert", alert_cooldown_steps=10))
    kinds = [[a.kind for a in alerting.inspect(batch(s, heavy), step=s).alerts] for s in range(1, 13)]
    assert alerting.inspect(batch(20, heavy), step=20).stop_training is None
    breaker_steps = [step for step, k in enumerate(kinds, start=1) if "circuit_breaker" in k]
    assert breaker_steps == [1, 11], "error alerts, throttled by the cooldown, and training goes on"
    calm = RolloutGuard(GuardConfig(max_quarantine_share=0.5))
    assert calm.inspect(batch(0, [0, 1]), step=1).stop_training is None  # 25 % is under the ceiling


def test_monitor_mode_breaker_alerts_and_training_goes_on():
    """The circuit breaker's defaults (max_quarantine_share=0.5, on_ceiling="stop") do not stop a monitor-mode run;
    it sends its error alert (throttled) instead."""
    for on_ceiling in ("stop", "raise", "alert"):
        guard = RolloutGuard(GuardConfig(mode="monitor", on_ceiling=on_ceiling, alert_cooldown_steps=10))
        reports = [guard.inspect(batch(s, [0, 1, 2, 3, 4, 5]), step=s) for s in range(1, 13)]
        assert all(r.stop_training is None for r in reports) and "stopped" not in guard.summary()
        breaker_steps = [r.step for r in reports if any(a.kind == "circuit_breaker" for a in r.alerts)]
        assert breaker_steps == [1, 11], on_ceiling
        assert "monitor mode: training goes on" in next(a for a in reports[0].alerts if a.kind == "circuit_breaker").text
    quarantining = RolloutGuard(GuardConfig(on_ceiling="raise"))  # the same batch in quarantine mode does stop
    assert quarantining.inspect(batch(1, [0, 1, 2, 3, 4, 5]), step=1).stop_training


def test_a_check_flag_from_one_rank_reaches_every_rank():
    """A caller's per-step check (the TRL adapter's advantage replica) travels in the one gather."""
    for flags, expected in (((False, True), [1]), ((False, False), []), ((True, True), [0, 1])):
        group = ThreadGroup(2)
        guards = [RolloutGuard(GuardConfig(), gather=group.gather_for(rank), process_index=rank) for rank in range(2)]
        reports = [None, None]

        def run(rank: int, flags=flags, guards=guards, reports=reports) -> None:
            flag = torch.tensor(flags[rank]) if rank == 0 else flags[rank]  # a device tensor or a bool
            reports[rank] = guards[rank].inspect(batch(rank, [1]), step=1, batch_size=8, check_failed=flag)

        group.run(run)
        assert group.calls == [1, 1]
        assert [r.check_failed_on for r in reports] == [expected, expected]
        assert not any(r.skipped for r in reports)


def test_check_flags_reach_every_rank_also_in_a_step_it_could_not_judge():
    """Bits of the caller's own (the TRL adapter: replica 1, support hook 2) travel in the one gather whether or not
    the step is judged: here rank 1 could not collect its evidence and says why in a flag, so that every rank can
    act on it together (and skips the step together)."""
    group = ThreadGroup(2)
    guards = [RolloutGuard(GuardConfig(), gather=group.gather_for(rank), process_index=rank) for rank in range(2)]
    reports = [None, None]

    def run(rank: int) -> None:
        evidence = batch(rank, []) if rank == 0 else RuntimeError("the support hook failed here")
        flags = torch.tensor(True) if rank == 0 else 2
        reports[rank] = guards[rank].inspect(evidence, step=3, batch_size=8, check_failed=flags)

    group.run(run)
    assert group.calls == [1, 1]
    for report in reports:
        assert report.skipped and report.check_flags == [1, 2]
        assert report.flagged_on(2) == [1] and report.flagged_on(1) == [0] and report.check_failed_on == [0, 1]
    assert [guard.totals.failures for guard in guards] == [1, 1]


def test_a_step_one_rank_could_not_judge_teaches_no_rank_s_detector():
    """The learning is launched before the step's host copy shows whether every rank judged its rows: a step that
    turns out not judged (rank 1 failed) or whose report fails leaves every rank's noise as it was."""
    group = ThreadGroup(2)
    guards = [RolloutGuard(GuardConfig(), gather=group.gather_for(rank), process_index=rank) for rank in range(2)]

    def run(rank: int) -> None:
        guards[rank].inspect(batch(rank, []), step=1, batch_size=8)
        evidence = batch(rank + 2, []) if rank == 0 else RuntimeError("rank 1 cannot build its packet")
        assert guards[rank].inspect(evidence, step=2, batch_size=8).skipped

    group.run(run)
    learned = [guard.detector.counts.sum().item() for guard in guards]
    assert learned[0] == learned[1] == 2 * batch(0, []).mask.sum().item()

    guard = RolloutGuard(GuardConfig())
    guard.inspect(batch(0, []), step=1)
    before = guard.detector.counts.clone()

    def failing(step, metrics):
        raise RuntimeError("the alerts failed")

    guard.alerts.check = failing
    report = guard.inspect(batch(1, []), step=2)
    assert report.skipped and torch.equal(guard.detector.counts, before)


def test_a_judged_step_s_parts_add_up_to_its_time():
    """``last_step_parts``: host seconds until the one host copy, in it, after it; together the step's time."""
    guard = RolloutGuard(GuardConfig())
    report = guard.inspect(batch(0, [1]), step=1)
    until_copy, copy, after_copy = guard.last_step_parts
    assert min(guard.last_step_parts) >= 0 and until_copy > 0 and after_copy > 0
    assert until_copy + copy + after_copy == pytest.approx(report.metrics["guard_seconds"], rel=1e-9)


def test_counts_stay_exact_above_float32_precision():
    """3 ranks × 5,592,407 compared tokens = 16,777,221 tokens in one histogram bin and in the
    token count, one more than float32 can hold exactly (2^24 + 5 rounds to 2^24 + 4)."""
    tokens = 5_592_407
    evidence = RolloutEvidence(mask=torch.ones(1, tokens, dtype=torch.bool), engine_logprobs=torch.zeros(1, tokens),
                               trainer_logprobs=torch.zeros(1, tokens))
    report = RolloutGuard(GuardConfig(), gather=lambda packet: torch.cat([packet, packet, packet])).inspect(evidence, step=1, batch_size=1)
    assert float(torch.tensor(3 * tokens, dtype=torch.float32)) != 3 * tokens  # the premise
    assert report.delta_histogram.dtype == torch.int64 and int(report.delta_histogram[0]) == 3 * tokens
    assert report.metrics["tokens"] == report.metrics["compared_tokens"] == 3 * tokens
    from rollout_guard.action import loss_token_count

    assert int(loss_token_count(report.column("tokens"), report.quarantined)) == 3 * tokens


class OnDevice(torch.Tensor):
    """A CPU tensor that plays an accelerator tensor: whatever is computed from it stays "on the device", and every
    way of bringing its values to the host (``.cpu()``, ``.item()``, ``.tolist()``, ``bool()``, ``float()``…) counts
    as one host sync. Stands in for ``torch.cuda.set_sync_debug_mode`` on a machine without a GPU."""

    syncs: list[str] = []
    _TO_HOST = {"cpu", "item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__", "__array__"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in cls._TO_HOST:  # (``.to(device)`` stays on the device: the guard moves to the host with .cpu())
            cls.syncs.append(name)
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **(kwargs or {}))
                return out.as_subclass(torch.Tensor).clone() if isinstance(out, torch.Tensor) else out  # a host copy
        return super().__torch_function__(func, types, args, kwargs)


def test_one_host_sync_per_step():
    """A guarded step brings values to the host once (the design), not once to check the statuses and once more
    for the statistics."""
    evidence = batch(3, [1])
    on_device = RolloutEvidence(mask=evidence.mask.as_subclass(OnDevice), engine_logprobs=evidence.engine_logprobs.as_subclass(OnDevice),
                                trainer_logprobs=evidence.trainer_logprobs.as_subclass(OnDevice))
    for mode in ("quarantine", "monitor"):
        guard = RolloutGuard(GuardConfig(mode=mode))
        OnDevice.syncs = []
        report = guard.inspect(on_device, step=1, batch_size=8, check_failed=torch.tensor(False).as_subclass(OnDevice))
        assert OnDevice.syncs == ["cpu"], OnDevice.syncs
        assert report.suspect.tolist() == [row == 1 for row in range(8)] and type(report.samples) is torch.Tensor


def test_a_noise_that_grows_over_the_run_raises_a_growth_alert():
    """Healthy noise of 0.05 nats learned as the early level, then a two-sided fault five times as wide: the
    per-step growth metric passes 2x and the guard warns, while a run that stays at its early level does not."""

    def step(seed: int, sigma: float) -> RolloutEvidence:
        generator = torch.Generator().manual_seed(seed)
        engine = -0.2 * torch.rand(256, 64, generator=generator)  # one confidence region
        noise = torch.distributions.Laplace(0.0, sigma).sample((256, 64))
        return RolloutEvidence(torch.ones(256, 64, dtype=torch.bool), engine, engine - noise)

    torch.manual_seed(0)
    steady, growing = RolloutGuard(GuardConfig()), RolloutGuard(GuardConfig())
    for seed in range(2):
        steady.inspect(step(seed, 0.05), step=seed)
        growing.inspect(step(seed, 0.05), step=seed)
    kinds = {"steady": [], "growing": []}
    for seed in range(2, 12):
        kinds["steady"] += [a.kind for a in steady.inspect(step(seed, 0.05), step=seed).alerts]
        report = growing.inspect(step(seed, 0.25), step=seed)
        kinds["growing"] += [a.kind for a in report.alerts]
    assert "noise_growth" not in kinds["steady"]
    assert "noise_growth" in kinds["growing"] and report.metrics["noise/growth_r3"] > 2.0


def test_a_step_the_guard_cannot_judge_is_an_error_alert_a_guarded_zero_and_a_counted_step():
    guard = RolloutGuard(GuardConfig(alert_cooldown_steps=1))
    assert guard.inspect(batch(0, []), step=1).metrics["guarded"] == 1.0
    report = guard.inspect(RuntimeError("the evidence could not be built"), step=2, batch_size=8)
    assert report.skipped and report.metrics["guarded"] == 0.0
    [alert] = report.alerts
    assert (alert.kind, alert.level, alert.step) == ("guard_failure", "ERROR", 2)
    assert "the evidence could not be built" in alert.text and "passed through unguarded" in alert.text
    summary = guard.summary()
    assert summary["steps"] == 2 and summary["guarded_steps"] == 1 and summary["guard_failures"] == 1


def test_consecutive_failures_up_to_the_limit_raise_and_a_judged_step_resets_the_count():
    guard = RolloutGuard(GuardConfig(max_consecutive_failures=3))
    failing = RuntimeError("the trainer logprobs were missing")
    for step, evidence in enumerate([failing, failing, batch(0, []), failing, failing], start=1):
        guard.inspect(evidence, step=step, batch_size=8)
    with pytest.raises(GuardError, match="could not judge 3 steps in a row .*the trainer logprobs were missing"):
        guard.inspect(failing, step=6, batch_size=8)
    endless = RolloutGuard(GuardConfig(max_consecutive_failures=None))
    for step in range(1, 30):
        assert endless.inspect(failing, step=step, batch_size=8).skipped
    assert endless.summary()["guard_failures"] == 29


def test_consecutive_failures_on_one_rank_raise_on_every_rank_at_the_same_step():
    group = ThreadGroup(2)
    guards = [RolloutGuard(GuardConfig(max_consecutive_failures=2), gather=group.gather_for(rank), process_index=rank)
              for rank in range(2)]
    raised: list[object] = [None, None]

    def run(rank: int) -> None:
        for step in (1, 2):
            evidence = batch(step, []) if rank == 0 else RuntimeError("rank 1 cannot build its packet")
            try:
                guards[rank].inspect(evidence, step=step, batch_size=8)
            except GuardError as error:
                raised[rank] = (step, str(error))
                return

    group.run(run)
    assert group.calls == [2, 2]
    assert [entry[0] for entry in raised] == [2, 2]


def test_every_step_over_the_ceiling_is_a_metric_whatever_the_alert_cooldown():
    for mode in ("monitor", "quarantine"):
        guard = RolloutGuard(GuardConfig(mode=mode, on_ceiling="alert", alert_cooldown_steps=100))
        heavy, light = [0, 1, 2, 3, 4, 5], [0]
        reports = [guard.inspect(batch(s, heavy if s % 2 else light), step=s) for s in range(1, 9)]
        assert [r.metrics["over_ceiling"] for r in reports] == [1.0, 0.0] * 4, mode
        assert sum(any(a.kind == "circuit_breaker" for a in r.alerts) for r in reports) == 1, "the alert is throttled"
        assert guard.summary()["steps_over_ceiling"] == 4


def test_monitor_mode_says_that_quarantine_mode_would_have_stopped_the_run():
    guard = RolloutGuard(GuardConfig(mode="monitor"))
    guard.inspect(batch(1, [0]), step=1)
    for step in (2, 3):
        assert guard.inspect(batch(step, [0, 1, 2, 3, 4, 5]), step=step).stop_training is None
    summary = guard.summary()
    assert "stopped" not in summary
    assert summary["would_have_stopped"].startswith("quarantine mode (on_ceiling='stop') would have stopped training "
                                                    "at step 2: 75% of the rollouts at step 2 were suspect")
    restored = RolloutGuard(GuardConfig(mode="monitor"))
    restored.load_state_dict(guard.state_dict())
    assert restored.summary()["would_have_stopped"] == summary["would_have_stopped"]
    assert "would_have_stopped" not in RolloutGuard(GuardConfig(mode="monitor", on_ceiling="alert")).summary()


def test_the_history_stays_bounded_over_a_long_run_and_keeps_its_worst_steps():
    from rollout_guard.guard import HISTORY_ROWS, GuardTotals

    totals = GuardTotals()
    steps = 40 * HISTORY_ROWS
    spikes = {777: 3.0, steps // 2: 2.0, steps - 5: 1.0}  # suspect rollouts at three steps, none elsewhere
    lengths = []
    for step in range(1, steps + 1):
        totals.add_history({"step": step, "suspect": spikes.get(step, 0.0), "max_abs_delta": 1e-3})
        lengths.append(len(totals.history))
    assert max(lengths) < HISTORY_ROWS and min(lengths[HISTORY_ROWS:]) >= HISTORY_ROWS // 2
    assert sum(row["span"] for row in totals.history) == steps, "every step is in exactly one row"
    assert {row["step"]: row["suspect"] for row in totals.history if row["suspect"]} == spikes
    steps_in_order = [row["step"] for row in totals.history]
    assert steps_in_order == sorted(steps_in_order)
    restored = GuardTotals.from_dict(totals.to_dict())
    restored.add_history({"step": steps + 1, "suspect": 0.0, "max_abs_delta": 1e-3})
    totals.add_history({"step": steps + 1, "suspect": 0.0, "max_abs_delta": 1e-3})
    assert restored.history == totals.history and restored.history_stride == totals.history_stride > 1


def test_a_snapshot_of_the_history_is_not_changed_by_later_steps():
    from rollout_guard.guard import HISTORY_ROWS
    from rollout_guard.outputs.writer import guard_snapshot

    guard = RolloutGuard(GuardConfig())
    guard.totals.history_stride = 4  # rows merge: the last row is replaced, never edited in place
    guard.inspect(batch(0, []), step=1)
    view = guard_snapshot(guard)
    before = [dict(row) for row in view.totals.history]
    guard.inspect(batch(1, [2]), step=2)
    assert view.totals.history == before and guard.totals.history[-1]["span"] == 2
    assert len(guard.totals.history) < HISTORY_ROWS


def test_row_extras_travel_in_the_step_gather_and_come_back_for_every_row():
    """A caller's per-row values ride in the packet: no collective of the caller's own; a wrong shape becomes NaN
    rows (the gather needs one size on every rank)."""
    engine = torch.full((3, 5), -0.5)
    evidence = RolloutEvidence(mask=torch.ones(3, 5, dtype=torch.long), engine_logprobs=engine, trainer_logprobs=engine - 0.01)
    guard = RolloutGuard(GuardConfig())
    extras = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    report = guard.inspect(evidence, step=1, row_extras=extras)
    assert report.row_extras.tolist() == extras.tolist() and report.metrics["samples"] == 3
    assert guard.inspect(evidence, step=2).row_extras is None
    wrong = guard.inspect(evidence, step=3, batch_size=3, row_extras=torch.ones(2, 2))
    assert wrong.row_extras.shape == (3, 2) and bool(wrong.row_extras.isnan().all())
