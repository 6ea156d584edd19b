"""Alerts: notice when the quarantine rate or the max |Δ| jumps past its running baseline, throttled.

Baselines are exponential moving averages over past steps (the max |Δ| one in log space, since |Δ| spans
decades), updated after each check so a jump is compared with what came before it. An alert of a kind is sent
at most once per ``alert_cooldown_steps``, so a bad hour does not send hundreds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from rollout_guard.config import GuardConfig


@dataclass(frozen=True)
class Alert:
    # "quarantine_rate" | "max_abs_delta" | "noise_growth" | "circuit_breaker" | "advantage_replica" | "guard_failure"
    kind: str
    level: str  # "WARN" | "ERROR"
    step: int
    value: float
    baseline: float
    title: str
    text: str

    def to_dict(self) -> dict:
        return asdict(self)


class AlertMonitor:
    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self.alpha = 2.0 / (config.alert_baseline_steps + 1)
        self.share_baseline: float | None = None
        self.log_delta_baseline: float | None = None
        self.last_alert_step: dict[str, int] = {}
        self.sent = 0

    def _cooled_down(self, kind: str, step: int) -> bool:
        last = self.last_alert_step.get(kind)
        return last is None or step - last >= self.config.alert_cooldown_steps

    def check(self, step: int, metrics: dict[str, float]) -> list[Alert]:
        config, alerts = self.config, []
        share = metrics.get("quarantined_share" if config.quarantines else "suspect_share", 0.0)
        share_baseline = self.share_baseline if self.share_baseline is not None else 0.0
        if (share >= config.alert_min_share and share > config.alert_jump * share_baseline
                and self._cooled_down("quarantine_rate", step)):
            verb = "quarantined" if config.quarantines else "flagged (monitor mode)"
            alerts.append(Alert(
                "quarantine_rate", "WARN", step, share, share_baseline,
                f"rollout_guard: {share:.1%} of rollouts {verb} at step {step}",
                f"{int(metrics.get('suspect', 0))} of {int(metrics.get('samples', 0))} rollouts at step {step} were "
                f"suspect (running baseline {share_baseline:.2%}). "
                f"Max |Δ| {metrics.get('max_abs_delta', math.nan):.3g} "
                "nats. Rules: " + ", ".join(f"{k.removeprefix('rule/')}={int(v)}" for k, v in metrics.items()
                                            if k.startswith("rule/") and v),
            ))
        max_delta = metrics.get("max_abs_delta", math.nan)
        if math.isfinite(max_delta) and max_delta > 0:
            baseline = math.exp(self.log_delta_baseline) if self.log_delta_baseline is not None else None
            threshold = config.ceiling_delta if config.ceiling_delta is not None else 0.0
            if (
                max_delta > threshold
                and (baseline is None or max_delta > config.alert_jump * baseline)
                and self._cooled_down("max_abs_delta", step)
            ):
                alerts.append(Alert(
                    "max_abs_delta", "WARN", step, max_delta, baseline if baseline is not None else math.nan,
                    f"rollout_guard: logprob spike of {max_delta:.3g} nats at step {step}",
                    f"Engine and trainer disagree by {max_delta:.3g} nats on one token at step {step} "
                    + (f"(running baseline {baseline:.3g} nats)." if baseline is not None else "(first measurement).")
                    + f" p99 |Δ| {metrics.get('p99_abs_delta', math.nan):.3g} nats.",
                ))
            log_delta = math.log(max_delta)
            self.log_delta_baseline = log_delta if self.log_delta_baseline is None else (
                (1 - self.alpha) * self.log_delta_baseline + self.alpha * log_delta
            )
        self.share_baseline = (share if self.share_baseline is None
            else (1 - self.alpha) * self.share_baseline + self.alpha * share)
        for alert in alerts:
            self.last_alert_step[alert.kind] = step
        self.sent += len(alerts)
        return alerts

    def noise_growth(self, step: int, metrics: dict[str, float], limit: float) -> Alert | None:
        """A warning when some confidence region's healthy-noise scale (``noise/growth_r*`` in ``metrics``) has grown
        past ``limit`` times its early level: a fault that grows over the run would otherwise be learned as healthy
        noise (``docs/detector.md``). Throttled like the others."""
        growth = {key: value for key, value in metrics.items() if key.startswith("noise/growth_r")
                  and math.isfinite(value) and value > limit}
        if not growth or not self._cooled_down("noise_growth", step):
            return None
        key, value = max(growth.items(), key=lambda item: item[1])
        region = key.removeprefix("noise/growth_r")
        scale = metrics.get(f"noise/scale_r{region}", math.nan)
        self.last_alert_step["noise_growth"] = step
        self.sent += 1
        return Alert("noise_growth", "WARN", step, value, limit,
                     f"rollout_guard: healthy noise grew {value:.1f}x at step {step}",
                     f"The run's engine-vs-trainer noise in confidence region {region} is {scale:.3g} nats, {value:.1f} "
                     f"times its level early in the run (alert above {limit:g}x). A fixed stack does not drift like "
                     "this: check for a weight sync that skips a layer or an engine degrading as its cache fills.")

    def circuit_breaker(self, step: int, share: float, ceiling: float, title: str, text: str,
                        throttle: bool) -> Alert | None:
        """An error-level alert for a tripped circuit breaker; ``throttle`` applies the cooldown."""
        return self.error("circuit_breaker", step, share, ceiling, title, text, throttle)

    def error(self, kind: str, step: int, value: float, baseline: float, title: str, text: str,
              throttle: bool = True) -> Alert | None:
        """An error-level alert of ``kind`` (e.g. ``"advantage_replica"``); ``throttle`` applies the cooldown."""
        if throttle and not self._cooled_down(kind, step):
            return None
        self.last_alert_step[kind] = step
        self.sent += 1
        return Alert(kind, "ERROR", step, value, baseline, title, text)

    def state_dict(self) -> dict:
        return {
            "share_baseline": self.share_baseline, "log_delta_baseline": self.log_delta_baseline,
            "last_alert_step": dict(self.last_alert_step), "sent": self.sent,
        }

    def load_state_dict(self, state: dict) -> None:
        self.share_baseline = state["share_baseline"]
        self.log_delta_baseline = state["log_delta_baseline"]
        self.last_alert_step = dict(state["last_alert_step"])
        self.sent = state["sent"]
