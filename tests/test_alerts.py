import math

from rollout_guard.outputs.alerts import AlertMonitor
from rollout_guard.config import GuardConfig


def step_metrics(share: float, max_delta: float, samples: int = 100) -> dict[str, float]:
    return {"quarantined_share": share, "suspect_share": share, "suspect": share * samples, "samples": samples,
            "max_abs_delta": max_delta, "p99_abs_delta": max_delta / 2, "rule/ceiling": share * samples}


def test_quiet_run_sends_nothing():
    monitor = AlertMonitor(GuardConfig())
    assert all(not monitor.check(step, step_metrics(0.0, 1e-6)) for step in range(1, 200))


def test_rate_jump_alerts_once_then_cools_down():
    monitor = AlertMonitor(GuardConfig(alert_cooldown_steps=100, ceiling_delta=8.0))
    for step in range(1, 50):
        assert not monitor.check(step, step_metrics(0.0, 1e-6))
    alerts = monitor.check(50, step_metrics(0.25, 12.0))
    assert {a.kind for a in alerts} == {"quarantine_rate", "max_abs_delta"}
    rate = next(a for a in alerts if a.kind == "quarantine_rate")
    assert rate.value == 0.25 and rate.baseline == 0.0 and "25.0%" in rate.title and "ceiling=25" in rate.text
    # a bad stretch: every step bad, but at most one alert of each kind per cooldown window
    sent = sum(len(monitor.check(step, step_metrics(0.25, 12.0))) for step in range(51, 150))
    assert sent == 0
    assert {a.kind for a in monitor.check(150, step_metrics(0.9, 40.0))} == {"quarantine_rate", "max_abs_delta"}
    assert monitor.sent == 4


def test_small_share_below_the_floor_and_below_the_jump_do_not_alert():
    monitor = AlertMonitor(GuardConfig(alert_min_share=0.02))
    assert not monitor.check(1, step_metrics(0.01, 1e-6))  # under the floor
    for step in range(2, 100):
        monitor.check(step, step_metrics(0.1, 1e-6))  # baseline climbs to ~0.1 (first alert sent at step 2)
    assert not [a for a in monitor.check(200, step_metrics(0.2, 1e-6)) if a.kind == "quarantine_rate"]  # 2× < 3×


def test_spike_must_pass_the_rule_threshold_and_the_baseline():
    monitor = AlertMonitor(GuardConfig(ceiling_delta=8.0))
    assert not monitor.check(1, step_metrics(0.0, 5.0))  # first measurement, under the threshold
    for step in range(2, 60):
        monitor.check(step, step_metrics(0.0, 1e-5))
    alerts = monitor.check(60, step_metrics(0.0, 9.0))
    assert [a.kind for a in alerts] == ["max_abs_delta"] and 1e-5 < alerts[0].baseline < 1e-3


def test_state_round_trip_keeps_baselines_and_cooldowns():
    monitor = AlertMonitor(GuardConfig(ceiling_delta=8.0))
    monitor.check(1, step_metrics(0.3, 12.0))
    restored = AlertMonitor(GuardConfig(ceiling_delta=8.0))
    restored.load_state_dict(monitor.state_dict())
    assert restored.state_dict() == monitor.state_dict()
    assert not restored.check(2, step_metrics(0.9, 40.0))  # still cooling down
    assert not math.isnan(restored.share_baseline)


def test_noise_growth_alerts_past_the_limit_once_per_cooldown():
    monitor = AlertMonitor(GuardConfig(alert_cooldown_steps=10))
    quiet = {"noise/growth_r0": 1.2, "noise/growth_r3": float("nan"), "noise/scale_r0": 0.05}
    assert monitor.noise_growth(1, quiet, 2.0) is None  # under the limit; NaN: no early level yet
    grown = {"noise/growth_r0": 1.2, "noise/growth_r2": 2.5, "noise/scale_r2": 0.4}
    alert = monitor.noise_growth(2, grown, 2.0)
    assert alert is not None and alert.kind == "noise_growth" and alert.value == 2.5
    assert "region 2" in alert.text and "0.4 nats" in alert.text
    assert monitor.noise_growth(5, grown, 2.0) is None  # cooling down
    assert monitor.noise_growth(12, grown, 2.0) is not None
