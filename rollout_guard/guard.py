"""The stateful guard: per step, evidence → statistics → (one gather) → verdict → report; running totals.

Like a torchmetrics metric, this object holds state and syncs it across processes; the math lives in pure
functions. Each :meth:`RolloutGuard.inspect` makes exactly one collective call (``gather``, the same on every
rank) and one device→host copy, so every rank reaches the same verdict on the same global batch and logs the
same numbers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rollout_guard.alerts import Alert, AlertMonitor
from rollout_guard.config import GuardConfig
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.statistics import COLUMN, NUM_DELTA_BINS, SAMPLE_COLUMNS, delta_histogram, sample_statistics, step_aggregates
from rollout_guard.verdict import RULES, judge, rule_counts

Gather = Callable[[torch.Tensor], torch.Tensor]


def _no_gather(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass
class StepReport:
    """What the guard concluded about one batch. Host tensors cover the global batch (all processes)."""

    step: int
    samples: torch.Tensor  # (N, len(SAMPLE_COLUMNS)) host
    suspect: torch.Tensor  # (N,) bool host
    reasons: torch.Tensor  # (N,) int32 host, bitmask over verdict.RULES
    quarantined: torch.Tensor  # (N,) bool host: suspect in quarantine mode, all False in monitor mode
    delta_histogram: torch.Tensor  # (NUM_DELTA_BINS,) host, global
    local_rows: slice  # this process's rows within the global batch
    local_quarantined: torch.Tensor  # (B,) bool on the evidence's device
    metrics: dict[str, float] = field(default_factory=dict)
    alerts: list[Alert] = field(default_factory=list)

    @property
    def any_quarantined(self) -> bool:
        return bool(self.metrics.get("quarantined", 0))

    def column(self, name: str) -> torch.Tensor:
        return self.samples[:, COLUMN[name]]


_COUNTERS = ("steps", "rollouts", "suspect", "quarantined", "injected", "caught", "false_alarms", "labelled_steps")


@dataclass
class GuardTotals:
    """Running counters across the run (all processes). Saved with checkpoints."""

    steps: int = 0
    rollouts: int = 0
    suspect: int = 0
    quarantined: int = 0
    injected: int = 0
    caught: int = 0  # injected and suspect
    false_alarms: int = 0  # suspect but not injected (counted only when an injector labels the batch)
    labelled_steps: int = 0  # steps whose batch carried injector labels
    rule_counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RULES, 0))
    history: list[dict[str, float]] = field(default_factory=list)  # one compact row per step, for charts

    def to_dict(self) -> dict:
        return {
            "steps": self.steps, "rollouts": self.rollouts, "suspect": self.suspect, "quarantined": self.quarantined,
            "injected": self.injected, "caught": self.caught, "false_alarms": self.false_alarms,
            "labelled_steps": self.labelled_steps, "rule_counts": dict(self.rule_counts), "history": list(self.history),
        }

    @classmethod
    def from_dict(cls, state: dict) -> GuardTotals:
        totals = cls(**{key: state[key] for key in _COUNTERS})
        totals.rule_counts.update(state.get("rule_counts", {}))
        totals.history = list(state.get("history", []))
        return totals


class RolloutGuard:
    """Judges each batch of rollouts; engine- and framework-agnostic.

    Args:
        config: the guard's settings.
        gather: concatenates a tensor along dim 0 across processes, in rank order (``accelerator.gather``);
            identity for one process. Called exactly once per :meth:`inspect`, on every rank.
        process_index: this process's rank.
    """

    def __init__(self, config: GuardConfig | None = None, gather: Gather | None = None, process_index: int = 0) -> None:
        self.config = config or GuardConfig()
        self.gather = gather or _no_gather
        self.process_index = process_index
        self.totals = GuardTotals()
        self.alerts = AlertMonitor(self.config)
        self.last_guard_seconds = 0.0

    def inspect(self, evidence: RolloutEvidence, step: int) -> StepReport:
        started = time.perf_counter()
        evidence = evidence.validated()
        local = sample_statistics(evidence, self.config)
        histogram = delta_histogram(evidence)
        batch = local.shape[0]
        packed = torch.cat([local.flatten(), histogram])
        gathered = self.gather(packed).view(-1, packed.numel())  # the one collective: (world, B·S + H)
        width = len(SAMPLE_COLUMNS)
        samples = gathered[:, : batch * width].reshape(-1, width)
        global_histogram = gathered[:, batch * width :].sum(dim=0)

        verdict = judge(samples, self.config)
        quarantined = verdict.suspect if self.config.quarantines else torch.zeros_like(verdict.suspect)
        local_rows = slice(self.process_index * batch, (self.process_index + 1) * batch)
        local_quarantined = quarantined[local_rows]

        host = torch.cat([samples.flatten(), global_histogram, verdict.reasons.float()]).cpu()  # the one host sync
        samples_host = host[: samples.numel()].view_as(samples)
        histogram_host = host[samples.numel() : samples.numel() + NUM_DELTA_BINS]
        reasons_host = host[samples.numel() + NUM_DELTA_BINS :].to(torch.int32)
        suspect_host = reasons_host != 0
        quarantined_host = suspect_host if self.config.quarantines else torch.zeros_like(suspect_host)

        report = StepReport(
            step=step,
            samples=samples_host,
            suspect=suspect_host,
            reasons=reasons_host,
            quarantined=quarantined_host,
            delta_histogram=histogram_host,
            local_rows=local_rows,
            local_quarantined=local_quarantined,
        )
        report.metrics = self._step_metrics(report)
        report.alerts = self.alerts.check(step, report.metrics)
        self.last_guard_seconds = time.perf_counter() - started
        report.metrics["guard_seconds"] = self.last_guard_seconds
        self._update_totals(report)
        return report

    def _step_metrics(self, report: StepReport) -> dict[str, float]:
        metrics = step_aggregates(report.samples, report.delta_histogram)
        total = max(report.samples.shape[0], 1)
        metrics["suspect"] = float(report.suspect.sum())
        metrics["quarantined"] = float(report.quarantined.sum())
        metrics["suspect_share"] = metrics["suspect"] / total
        metrics["quarantined_share"] = metrics["quarantined"] / total
        kept = report.column("max_abs_delta")[~report.quarantined]
        kept = kept[~torch.isnan(kept)]
        metrics["kept_max_abs_delta"] = float(kept.max()) if kept.numel() else math.nan
        for name, count in rule_counts(report.reasons).items():
            metrics[f"rule/{name}"] = float(count)
        injected = report.column("injected")
        if not torch.isnan(injected).all():
            labelled = injected == 1
            metrics["caught"] = float((labelled & report.suspect).sum())
            metrics["missed"] = float((labelled & ~report.suspect).sum())
            metrics["false_alarms"] = float((~labelled & report.suspect).sum())
        return metrics

    def _update_totals(self, report: StepReport) -> None:
        totals, metrics = self.totals, report.metrics
        totals.steps += 1
        totals.rollouts += int(metrics["samples"])
        totals.suspect += int(metrics["suspect"])
        totals.quarantined += int(metrics["quarantined"])
        for name in RULES:
            totals.rule_counts[name] += int(metrics[f"rule/{name}"])
        if "caught" in metrics:
            totals.labelled_steps += 1
            totals.injected += int(metrics["caught"] + metrics["missed"])
            totals.caught += int(metrics["caught"])
            totals.false_alarms += int(metrics["false_alarms"])
        totals.history.append(
            {
                "step": report.step,
                "max_abs_delta": metrics["max_abs_delta"],
                "p99_abs_delta": metrics["p99_abs_delta"],
                "kept_max_abs_delta": metrics["kept_max_abs_delta"],
                "suspect": metrics["suspect"],
                "quarantined": metrics["quarantined"],
                "guard_seconds": metrics["guard_seconds"],
            }
        )

    def state_dict(self) -> dict:
        return {"config": self.config.to_dict(), "totals": self.totals.to_dict(), "alerts": self.alerts.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.totals = GuardTotals.from_dict(state["totals"])
        self.alerts.load_state_dict(state["alerts"])

    def summary(self) -> dict[str, float]:
        totals = self.totals
        summary = {
            "steps": totals.steps, "rollouts": totals.rollouts, "suspect": totals.suspect,
            "quarantined": totals.quarantined, "alerts": self.alerts.sent,
            **{f"rule/{k}": v for k, v in totals.rule_counts.items()},
        }
        if totals.labelled_steps:
            summary.update(injected=totals.injected, caught=totals.caught, missed=totals.injected - totals.caught,
                           false_alarms=totals.false_alarms)
        return summary

