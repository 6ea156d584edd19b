"""The ``changepoint`` rule: its score against an independent float64 form of the statistic, its threshold read
from the kept rows, what it catches that the other rules miss, and what it leaves alone."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from rollout_guard import GuardConfig, GuardConfigError, RolloutEvidence, RolloutGuard
from rollout_guard.calibration import CHANGEPOINT_CEILING, NUM_CHANGEPOINT_BINS, changepoint_threshold
from rollout_guard.changepoint import changepoint_score
from rollout_guard.statistics import COLUMN, ENGINE_BUCKET_EDGES
from rollout_guard.verdict import RULE_BIT

REPO = Path(__file__).resolve().parents[1]


def test_score_matches_the_benchmark_statistic(monkeypatch):
    """The prototype's float64 ln Λ (``changepoint_every_condition.log_lr``) over the guard's engine buckets, the
    per-token cap lifted (the prototype has none; the cap: the next test)."""
    import rollout_guard.changepoint as changepoint

    sys.path.insert(0, str(REPO / "benchmarks" / "results-2026-12-03-twentyeighth"))
    import changepoint_every_condition as prototype

    monkeypatch.setattr(changepoint, "TOKEN_CAP", math.inf)

    generator = torch.Generator().manual_seed(0)
    engine = -torch.rand(64, 120, generator=generator) * 5
    trainer = engine - 0.05 - 0.3 * torch.randn(64, 120, generator=generator)
    trainer[:32, 60:] -= torch.rand(32, 1, generator=generator) * 2  # lags of 0–2 nats from token 60
    trainer = trainer.clamp(max=-1e-4)  # the prototype skips trainer logprobs at its noise model's clamp
    valid = torch.rand(64, 120, generator=generator) > 0.1
    centre, spread = torch.tensor([0.0, 0.05, 0.02, 0.01]), torch.tensor([0.0, 0.4, 0.3, 0.25])
    edges = torch.tensor(ENGINE_BUCKET_EDGES, dtype=torch.float64)
    saved = prototype.LEARNED_EDGES
    prototype.LEARNED_EDGES = edges
    try:
        expected = prototype.log_lr(engine.double(), trainer.double(), valid, centre.double(),
                                    spread.double().clamp(min=1e-9), readable=spread > 0)
    finally:
        prototype.LEARNED_EDGES = saved
    got = changepoint_score(engine, trainer, valid, centre, spread).double()
    assert torch.isfinite(expected).all() and expected[:32].min() > expected[32:].max() - 50
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-3)


def test_one_token_far_out_in_its_bucket_is_not_a_lag(monkeypatch):
    """A bucket's Gaussian describes its body. The measured mismatch of the engine-surest bucket (−0.5 … 0 nats)
    spreads 35-fold from sure tokens to those near −0.5 (``benchmarks/noise_shape.py``), so a healthy token there can
    sit 8–10 of the bucket's σ out: alone, as a row's last token, it scored ln Λ 43 here, far above ln 1000 (the
    rule's threshold until the kept rows are read). Each token's log ratio is held to TOKEN_CAP: that row stays under
    ln 1000, while ten tokens lagging by 1 nat (≈ 3 σ) each from some onset still score far above."""
    import rollout_guard.changepoint as changepoint

    generator = torch.Generator().manual_seed(4)
    centre, spread = torch.zeros(4), torch.tensor([0.0, 0.3, 0.3, 0.3])
    engine = -0.5 * torch.rand(2, 60, generator=generator)  # all in the surest bucket
    trainer = engine - 0.3 * torch.randn(2, 60, generator=generator)
    valid = torch.ones(2, 60, dtype=torch.bool)
    trainer[0, 59] = engine[0, 59] - 3.0  # the last token 10 σ out
    trainer[1, 50:] -= 1.0  # a lag on the last ten tokens
    scores = changepoint_score(engine, trainer, valid, centre, spread)
    assert scores[0] < CHANGEPOINT_CEILING and scores[1] > CHANGEPOINT_CEILING + 40, scores
    monkeypatch.setattr(changepoint, "TOKEN_CAP", math.inf)
    assert changepoint_score(engine, trainer, valid, centre, spread)[0] > CHANGEPOINT_CEILING + 30, "uncapped"


def test_rows_scored_in_chunks_score_as_one_batch(monkeypatch):
    import rollout_guard.changepoint as changepoint

    generator = torch.Generator().manual_seed(3)
    engine = -torch.rand(50, 300, generator=generator) * 4
    trainer = engine - 0.3 * torch.randn(50, 300, generator=generator)
    trainer[::5, 150:] -= 1.0
    valid = torch.rand(50, 300, generator=generator) > 0.05
    centre, spread = torch.tensor([0.0, 0.02, 0.01, 0.0]), torch.tensor([0.0, 0.4, 0.3, 0.3])
    whole = changepoint_score(engine, trainer, valid, centre, spread)
    monkeypatch.setattr(changepoint, "CHUNK_ELEMENTS", 300 * len(changepoint.LAGS) * 7)  # 7 rows a chunk
    assert torch.equal(changepoint_score(engine, trainer, valid, centre, spread), whole)


def test_threshold_is_a_quantile_of_the_kept_scores():
    histogram = [0.0] * NUM_CHANGEPOINT_BINS
    histogram[30] = 2999.0  # [−0.5, −0.25)
    histogram[36] = 1.0  # [1, 1.25)
    assert changepoint_threshold(histogram, 3000.0, 0.0002) == 1.25  # 0.6 allowed above: the top row is not
    assert changepoint_threshold(histogram, 3000.0, 0.001) == -0.25  # 3 allowed above: it is
    assert changepoint_threshold(histogram, 1999.0, 0.001) == CHANGEPOINT_CEILING  # too few rows


def test_a_bad_budget_is_refused_naming_the_field():
    for bad in (0, 1.0, -0.1, True, "0.001"):
        with pytest.raises(GuardConfigError, match="changepoint_budget"):
            GuardConfig(changepoint_budget=bad)


def healthy(generator: torch.Generator, rows: int = 256, length: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Engine logprobs over the three judged buckets, the trainer's within Gaussian noise of 0.3 nats."""
    engine = -torch.rand(rows, length, generator=generator) * 2.9
    trainer = engine - 0.02 - 0.3 * torch.randn(rows, length, generator=generator)
    return engine, trainer


def evidence(engine: torch.Tensor, trainer: torch.Tensor) -> RolloutEvidence:
    return RolloutEvidence(mask=torch.ones_like(engine, dtype=torch.long), engine_logprobs=engine,
                           trainer_logprobs=trainer)


def warmed_guard(budget: float | None, steps: int = 14, told: bool = True) -> RolloutGuard:
    guard = RolloutGuard(GuardConfig(changepoint_budget=budget))
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        report = guard.inspect(evidence(*healthy(generator)), step=step, sampling=(1.0,) if told else None)
        assert not report.suspect.any(), f"a healthy row flagged at step {step}"
    return guard


def late_batch(lag: float) -> tuple[RolloutEvidence, torch.Tensor]:
    """256 healthy rows of which 8 lag by ``lag`` nats per token from token 40 (of 64) on."""
    engine, trainer = healthy(torch.Generator().manual_seed(2))
    late = torch.zeros(256, dtype=torch.bool)
    late[::32] = True
    trainer[late, 40:] -= lag
    return evidence(engine, trainer), late


def test_catches_late_onset_the_other_rules_miss_and_no_healthy_row():
    with_rule, without = warmed_guard(0.0002), warmed_guard(None)
    threshold = with_rule.calibration.changepoint_threshold_value()
    assert threshold is not None and threshold < CHANGEPOINT_CEILING, "read from the kept rows by now"
    batch, late = late_batch(0.5)  # 1.7 σ per token for 24 tokens: at the drift CUSUM's 0.5-nat allowance
    report = with_rule.inspect(batch, step=14, sampling=(1.0,))
    assert report.changepoint_threshold == threshold
    assert torch.equal(report.suspect, late), report.samples[late | report.suspect, COLUMN["changepoint_score"]]
    assert ((report.reasons[late] & RULE_BIT["changepoint"]) != 0).all()
    assert not without.inspect(batch, step=14, sampling=(1.0,)).suspect.any()  # the other rules miss them
    assert torch.isnan(without.inspect(batch, step=15, sampling=(1.0,)).samples[:, COLUMN["changepoint_score"]]).all()


def test_a_small_lag_and_an_isolated_tail_token_are_left_alone():
    """Borderline negatives: a lag of 0.15 nats (half a σ) over half a row, and one 1.2-nat token in a healthy
    row, score below the threshold read from the kept rows."""
    guard = warmed_guard(0.0002)
    batch, late = late_batch(0.15)
    batch.trainer_logprobs[1, 40] -= 1.2
    report = guard.inspect(batch, step=14, sampling=(1.0,))
    assert not report.suspect.any(), report.samples[report.suspect, COLUMN["changepoint_score"]]


def test_a_settings_first_step_is_judged_around_the_batchs_own_noise():
    """In the first step of a new setting no bucket's centre is known yet: the rule reads the batch's own centre
    and spread per bucket (``batch_thresholds``, as the spike and drift rules do) against the ceiling, ln 1000.
    Late rows the other rules miss there are caught where they score above it (before: not judged); no healthy
    row is."""
    guard = warmed_guard(0.0002)
    batch, late = late_batch(0.5)  # scores 0.7 … 27 around the batch's noise
    report = guard.inspect(batch, step=14, sampling=(0.7,))  # a new setting: the calibration restarts
    assert guard.calibration_resets == 1
    scores = report.samples[:, COLUMN["changepoint_score"]]
    fired = (report.reasons & RULE_BIT["changepoint"]) != 0
    assert report.changepoint_threshold == CHANGEPOINT_CEILING and torch.isfinite(scores).all()
    assert torch.equal(fired, late & (scores > CHANGEPOINT_CEILING)) and fired.sum() >= 4, scores[late]
    assert not (report.reasons & ~RULE_BIT["changepoint"]).any()  # the other rules miss them
    assert scores[~late].max() < 0


def test_a_first_step_with_an_offset_on_every_token_is_left_alone():
    """Clean negative: the run's very first step, a renormalisation offset of 1.5 nats on every token (top-k = 5
    on an early, high-entropy policy) under 0.3 nats of noise: judged around the batch's median, no row fires."""
    guard = RolloutGuard(GuardConfig())
    engine, trainer = healthy(torch.Generator().manual_seed(4))
    report = guard.inspect(evidence(engine, trainer - 1.5), step=0, sampling=(1.0,))
    scores = report.samples[:, COLUMN["changepoint_score"]]
    assert report.changepoint_threshold == CHANGEPOINT_CEILING and torch.isfinite(scores).all()
    assert not report.suspect.any() and scores.max() < CHANGEPOINT_CEILING / 2


def test_not_judged_when_not_told_the_settings():
    guard = warmed_guard(0.0002, told=False)
    assert guard.calibration.changepoint_threshold_value() is None
    batch, _ = late_batch(0.5)
    report = guard.inspect(batch, step=14)
    assert report.changepoint_threshold is None
    assert not (report.reasons & RULE_BIT["changepoint"]).any()


def test_the_reading_is_saved_restored_and_restarted():
    guard = warmed_guard(0.0002)
    threshold = guard.calibration.changepoint_threshold_value()
    state = guard.state_dict()
    copy = RolloutGuard(GuardConfig(changepoint_budget=0.0002))
    copy.load_state_dict(state)
    copy.calibration.announced = True
    assert copy.calibration.changepoint_threshold_value() == threshold
    batch, _ = late_batch(0.5)
    assert torch.equal(copy.inspect(batch, step=14, sampling=(1.0,)).reasons,
                       guard.inspect(batch, step=14, sampling=(1.0,)).reasons)
    guard.inspect(evidence(*healthy(torch.Generator().manual_seed(3))), step=15, sampling=(0.7,))  # a new setting
    assert guard.calibration.changepoint_threshold_value() in (None, CHANGEPOINT_CEILING)
    assert math.isfinite(threshold)


def test_not_judged_where_a_cut_support_offset_stays_in_the_trainer_logprobs():
    """A top-k renormalisation offset varies from token to token: where the trainer's logprobs are not compared on
    the engine's support (``Calibration.per_token_offset``, set by the TRL adapter) the rule does not judge
    (measured with it judging there: 0.59 % of a top_k = 20 run's healthy rows flagged), a restart keeps that."""
    guard = RolloutGuard(GuardConfig())
    guard.calibration.per_token_offset = True
    generator = torch.Generator().manual_seed(1)
    for step in range(14):
        guard.inspect(evidence(*healthy(generator)), step=step, sampling=(1.0,))
    assert guard.calibration.changepoint_threshold_value() is None
    guard.recalibrate()
    assert guard.calibration.per_token_offset
    assert warmed_guard(GuardConfig().changepoint_budget).calibration.changepoint_threshold_value() is not None


def test_the_reading_is_made_once_a_step_and_follows_every_update(monkeypatch):
    """The threshold is read from the histogram once per update (the step reads it three times), and each step's
    reading is the histogram's as it stands then: from the ceiling to the kept rows' quantile, and after a load."""
    import rollout_guard.calibration as calibration

    reads = []
    monkeypatch.setattr(calibration, "changepoint_threshold",
                        lambda *args, **kwargs: reads.append(1) or changepoint_threshold(*args, **kwargs))
    guard = RolloutGuard(GuardConfig(changepoint_budget=0.001))
    generator = torch.Generator().manual_seed(5)
    seen = []
    for step in range(20):
        guard.inspect(evidence(*healthy(generator)), step=step, sampling=(1.0,))
        state = guard.calibration
        value = state.changepoint_threshold_value()
        assert value == changepoint_threshold(state._changepoint, state._changepoint_rows, 0.001)
        seen.append(value)
    assert len(reads) <= 20 + 1 and seen[0] in (None, CHANGEPOINT_CEILING) and seen[-1] < CHANGEPOINT_CEILING
    saved = guard.calibration.state_dict()
    fresh = RolloutGuard(GuardConfig(changepoint_budget=0.001))
    fresh.inspect(evidence(*healthy(generator)), step=0, sampling=(1.0,))
    before = fresh.calibration.changepoint_threshold_value()
    fresh.calibration.load_state_dict(saved)
    assert before != seen[-1] and fresh.calibration.changepoint_threshold_value() == seen[-1]


# the kernel's cases: (rows, tokens, dtype, lag from the middle on in nats, note)
KERNEL_CASES = {
    "short rows, partial blocks": (9, 150, torch.float32, 1.0),
    "long rows (sums of ~2,000 tokens, the kernel's chunks combined)": (3, 2100, torch.float32, 0.4),
    "bf16 logprobs": (6, 97, torch.bfloat16, 2.0),
    "far tails (lags of 30 nats)": (5, 70, torch.float32, 30.0),
}


def _kernel_inputs(name: str) -> tuple[torch.Tensor, ...]:
    rows, length, dtype, lag = KERNEL_CASES[name]
    generator = torch.Generator().manual_seed(rows * length)
    engine = -torch.rand(rows, length, generator=generator) * 4  # a quarter of the tokens below −3: unread
    trainer = engine - 0.02 - 0.3 * torch.randn(rows, length, generator=generator)
    trainer[::2, length // 2:] -= lag
    valid = torch.rand(rows, length, generator=generator) > 0.1
    engine[0, 3], trainer[0, 5], trainer[1, 7] = math.nan, -math.inf, math.nan  # not read
    valid[-1] = False  # a row with nothing read: −inf
    valid[1, 1024:2048] = False  # in long rows, a whole chunk of the kernel with nothing read
    return engine.to(dtype), trainer.to(dtype), valid


def _kernel_case(name: str) -> None:
    centre, spread = torch.tensor([0.0, 0.05, 0.02, 0.01]), torch.tensor([0.0, 0.4, 0.3, 0.25])
    engine, trainer, valid = _kernel_inputs(name)
    expected = changepoint_score(engine, trainer, valid, centre, spread, kernel=False)
    assert expected[-1] == -math.inf and torch.isfinite(expected[:-1]).all()
    torch.testing.assert_close(changepoint_score(engine, trainer, valid, centre, spread, kernel=True), expected,
                               rtol=1e-4, atol=2e-3)
    # rows of a wider tensor (row stride 2T) and a bucket not read yet (spread 0) score as in torch too
    wide = [torch.cat([side, side * 0], dim=1)[:, : side.shape[1]] for side in (engine, trainer)]
    unread = torch.tensor([0.0, 0.4, 0.0, 0.25])
    torch.testing.assert_close(changepoint_score(*wide, valid, centre, unread, kernel=True),
                               changepoint_score(engine, trainer, valid, centre, unread, kernel=False),
                               rtol=1e-4, atol=2e-3)


def test_the_kernel_matches_torch_in_the_interpreter():
    """The Triton score (one forward pass per row, a running log-sum-exp per lag) against the torch form (a reversed
    cumulative sum per lag), in Triton's interpreter on the CPU (the device benchmark compares them on a GPU)."""
    from tests.triton_interpreter import check_in_interpreter

    pytest.importorskip("triton")
    check_in_interpreter(__file__, list(KERNEL_CASES), timeout=600)


if __name__ == "__main__":
    import functools

    from tests.triton_interpreter import run_cases

    cases = {name: functools.partial(_kernel_case, name) for name in KERNEL_CASES}
    sys.exit(1 if run_cases(cases, sys.argv[1:]) else 0)
