"""The stateful guard: per step, update (evidence → detector → packet) → sync (one gather) → compute (verdict, metrics,
the detector's state); running totals.

Like a torchmetrics metric, this object holds state and syncs it across processes; the math lives in pure
functions. Each :meth:`RolloutGuard.inspect` makes exactly one collective call (``gather``, the same on every
rank, whatever happens) and one device→host copy, so every rank reaches the same verdict on the same global
batch, logs the same numbers and takes the same decisions, failures included: a rank that cannot build its
packet still joins the gather, flagging its failure, and every rank then skips (or raises) together. The
detector's state grows by the kept rows of the whole global batch, summed on the device from the gathered packets,
so it stays the same on every rank.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout_guard.outputs.alerts import Alert, AlertMonitor  # noqa: F401 - Alert is part of StepReport
from rollout_guard.config import GuardConfig
from rollout_guard.detector import GROWTH_ALERT, Detector
from rollout_guard.detector.noise import NUM_BINS
from rollout_guard.detector.score import NUM_REGIONS
from rollout_guard.errors import GuardError, GuardInputError
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.outcomes import outcome_sums
from rollout_guard.packet import (PacketLayout, combine_aggregates, empty_packet, packet_dtype, partial_aggregates,
                                  step_metrics)
from rollout_guard.statistics import COLUMN, NUM_DELTA_BINS, SAMPLE_COLUMNS, summarise
from rollout_guard.verdict import RULES, fired_rules

logger = logging.getLogger("rollout_guard")

Gather = Callable[[torch.Tensor], torch.Tensor]

STATUS_OK, STATUS_INPUT_ERROR, STATUS_FAILURE = 1.0, 0.0, -1.0


def _no_gather(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass
class StepReport:
    """What the guard concluded about one batch. Host tensors cover the global batch (all processes)."""

    step: int
    samples: torch.Tensor  # (N, len(SAMPLE_COLUMNS)) float64 host
    suspect: torch.Tensor  # (N,) bool host
    reasons: torch.Tensor  # (N,) int32 host, bitmask over verdict.RULES
    quarantined: torch.Tensor  # (N,) bool host: suspect in quarantine mode, all False in monitor mode
    delta_histogram: torch.Tensor  # (NUM_DELTA_BINS,) int64 host, global
    local_rows: slice  # this process's rows within the global batch
    local_quarantined: torch.Tensor  # (B,) bool on the guard's device
    metrics: dict[str, float] = field(default_factory=dict)
    alerts: list[Alert] = field(default_factory=list)
    skipped: bool = False  # the guard failed on some rank this step; the batch passes through unguarded
    # the circuit breaker's reason to stop (quarantine mode, on_ceiling "stop"/"raise")
    stop_training: str | None = None
    check_flags: list[int] = field(default_factory=list)  # per rank, the caller's check flags (see inspect); 0: none
    threshold: float = math.nan  # ln Λ: the score's threshold this step was judged with
    # this process's engine context of the step's rollouts (an object with ``rows`` and ``injected``), set by an
    # integration that collects it (the TRL adapter with vLLM) before the report goes to the sinks, which may run on
    # the background writer after the next step's context exists
    engine_context: Any = None
    # the detector's state this step was judged against (name → tensor on the guard's device, taken before the
    # step's update without a host sync), on steps with suspect rows: what ``rollout-guard replay`` judges with
    detector_state: dict[str, torch.Tensor] | None = None
    # every rank's ``row_extras`` (see inspect), (ranks · rows, k) float64 on the host, rank order; None without
    row_extras: torch.Tensor | None = None

    @property
    def check_failed_on(self) -> list[int]:
        """The ranks where some check of the caller's failed (a nonzero flag)."""
        return [rank for rank, flags in enumerate(self.check_flags) if flags]

    def flagged_on(self, flag: int) -> list[int]:
        """The ranks whose check flags include ``flag`` (one bit of the caller's own)."""
        return [rank for rank, flags in enumerate(self.check_flags) if flags & flag]

    @property
    def any_quarantined(self) -> bool:
        return bool(self.metrics.get("quarantined", 0))

    def column(self, name: str) -> torch.Tensor:
        return self.samples[:, COLUMN[name]]


HISTORY_ROWS = 2048
"""rows. :attr:`GuardTotals.history` holds at most this many (a chart's worth): when full, each two neighbouring rows
become the worse of them and every later row covers twice the steps, so memory, each checkpoint's size and the
per-step copy for the background writer stay flat over any number of steps."""


def _worse(first: dict[str, float], second: dict[str, float]) -> dict[str, float]:
    """Of two history rows, the one with more suspect rollouts (ties: the larger max |Δ|), covering both rows'
    steps (``span``)."""
    def key(row: dict[str, float]) -> tuple[float, float]:
        delta = row.get("max_abs_delta", math.nan)
        return row.get("suspect", 0.0), delta if delta is not None and math.isfinite(delta) else -math.inf

    worse = second if key(second) > key(first) else first
    return {**worse, "span": first.get("span", 1) + second.get("span", 1)}


_COUNTERS = ("steps", "rollouts", "suspect", "quarantined", "injected", "caught", "false_alarms", "labelled_steps",
             "failures", "consecutive_failures", "output_failures", "steps_above_ceiling", "steps_over_ceiling",
             "history_stride", "skipped_optimizer_steps")


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
    failures: int = 0  # steps the guard could not judge (non-strict mode): their batches passed through unguarded
    consecutive_failures: int = 0  # failures since the last judged step (max_consecutive_failures)
    # failures, on this process, of what is written or collected beside the verdict (records, decoding, sinks, the
    # engine context; non-strict mode): those steps were judged
    output_failures: int = 0
    steps_above_ceiling: int = 0  # consecutive steps above max_quarantine_share, for the circuit breaker
    steps_over_ceiling: int = 0  # every step above max_quarantine_share in the run (the metric over_ceiling sums to it)
    # optimizer steps not taken because every row of every micro-batch behind them was quarantined (an integration
    # that can skip them counts them here)
    skipped_optimizer_steps: int = 0
    rule_counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RULES, 0))
    # compact rows for charts, at most HISTORY_ROWS: one per step until full, then each the worst step (most suspect,
    # then largest max |Δ|) of ``span`` consecutive steps, at most ``history_stride`` (add_history)
    history: list[dict[str, float]] = field(default_factory=list)
    history_stride: int = 1  # steps per history row, doubled each time the history fills
    stopped: str | None = None  # why the circuit breaker stopped training, if it did
    # monitor mode: the first breaker trip that quarantine mode (on_ceiling "stop"/"raise") would have stopped on
    would_have_stopped: str | None = None
    # the run's sums of the steps' outcome counts (rollout_guard.outcomes.outcome_sums): the trainer's own
    # importance-sampling correction next to the verdict, the rewards of suspect and other rows
    outcomes: dict[str, float] = field(default_factory=dict)

    def add_outcomes(self, metrics: dict[str, float]) -> None:
        """Add one step's outcome counts (:func:`rollout_guard.outcomes.outcome_sums` of its metrics)."""
        for key, value in outcome_sums(metrics).items():
            self.outcomes[key] = self.outcomes.get(key, 0.0) + value

    def to_dict(self) -> dict:
        return {**{key: getattr(self, key) for key in _COUNTERS}, "rule_counts": dict(self.rule_counts),
                "history": list(self.history), "stopped": self.stopped, "would_have_stopped": self.would_have_stopped,
                "outcomes": dict(self.outcomes)}

    def add_history(self, row: dict[str, float]) -> None:
        """Append one step's row: merged into the last row while that covers fewer than ``history_stride`` steps,
        and the whole history halved (neighbouring rows merged, the stride doubled) when it reaches
        ``HISTORY_ROWS``. New row objects throughout, never an edit of one in the list: a copy of the list taken
        earlier (:func:`rollout_guard.outputs.writer.guard_snapshot`) stays as it was."""
        history = self.history
        if history and history[-1].get("span", 1) < self.history_stride:
            history[-1] = _worse(history[-1], row)
        else:
            history.append({**row, "span": 1})
        if len(history) >= HISTORY_ROWS:
            self.history = [_worse(history[i], history[i + 1]) if i + 1 < len(history) else history[i]
                            for i in range(0, len(history), 2)]
            self.history_stride *= 2

    @classmethod
    def from_dict(cls, state: dict) -> GuardTotals:
        totals = cls(**{key: state.get(key, 1 if key == "history_stride" else 0) for key in _COUNTERS})
        totals.rule_counts.update(state.get("rule_counts", {}))
        totals.history = list(state.get("history", []))
        totals.stopped = state.get("stopped")
        totals.would_have_stopped = state.get("would_have_stopped")
        totals.outcomes = dict(state.get("outcomes", {}))
        return totals


class RolloutGuard:
    """Judges each batch of rollouts; engine- and framework-agnostic.

    Args:
        config: the guard's settings.
        gather: concatenates a tensor along dim 0 across processes, in rank order (``accelerator.gather``);
            identity for one process. Called exactly once per :meth:`inspect`, on every rank.
        process_index: this process's rank.
        device: where the gathered tensors and the detector's state live (the collective's device, e.g.
            ``accelerator.device``).
    """

    def __init__(self, config: GuardConfig | None = None, gather: Gather | None = None, process_index: int = 0,
                 device: torch.device | str = "cpu") -> None:
        self.config = config or GuardConfig()
        self.gather = gather or _no_gather
        self.process_index = process_index
        self.device = torch.device(device)
        self.totals = GuardTotals()
        self.alerts = AlertMonitor(self.config)
        self.detector = Detector(self.config.false_alarm_budget, self.config.ceiling_delta, self.device,
                                 tolerance=self.config.tolerance_delta)
        self.sampling: tuple | None = None  # the sampling settings the detector's noise was learned under
        self.noise_resets = 0
        self.last_guard_seconds = 0.0
        # host seconds of the last judged step: until its one host copy, in the copy (waiting for the device, the
        # collective's wait included), after it
        self.last_step_parts = (0.0, 0.0, 0.0)
        self.checks: str | None = None  # what the caller's setup lets the guard check, when not everything (summary)
        self._heads: dict[torch.device, torch.Tensor] = {}  # per device, a packet's head: status ok, no check flag

    def inspect(self, evidence: RolloutEvidence | BaseException, step: int, batch_size: int | None = None,
                check_failed: torch.Tensor | bool | int = False,
                sampling: Sequence[object] | None = None, row_extras: torch.Tensor | None = None) -> StepReport:
        """Judge one batch: :meth:`update` → :meth:`sync` → :meth:`compute`.

        ``evidence`` may instead be the exception raised while collecting it on this rank; ``batch_size`` (rows on
        this rank) lets a failing rank still join the collective with the right shape. ``check_failed``: this
        rank's verdict on checks of the caller's own (a bool, a bitmask of flags below 2^24, or a 0-dim device
        tensor so that it costs no host sync), carried in the one gather, also in a step the guard could not judge:
        ``report.check_flags`` holds every rank's, the same on every rank, so that all of them act on it together
        (``report.check_failed_on``, ``report.flagged_on(flag)``). ``sampling``: the settings these rollouts were
        sampled with (e.g. temperature, top_p, top_k; the same on every rank); when they differ from the previous
        step's, the detector's noise starts over (:meth:`reset_noise`): the processed logprobs' offset depends on
        them. ``None``: unknown, the noise carries on. ``row_extras``: (rows on this rank, k) values of the caller's
        per row (NaN where unknown; the same k on every rank) that travel in the same gather and come back in
        ``report.row_extras`` for every rank's rows, so a caller needs no collective of its own."""
        started = time.perf_counter()
        if sampling is not None:
            settings = tuple(sampling)
            if self.sampling is not None and settings != self.sampling:
                self.reset_noise()
            self.sampling = settings
        packet, batch, error = self.update(evidence, batch_size)
        extras = 0
        if row_extras is not None:  # appended after the packet's own layout
            extras = row_extras.shape[-1]
            if row_extras.dim() != 2 or row_extras.shape[0] != batch:  # the gather needs the same size on every rank
                row_extras = torch.full((batch, extras), math.nan)
            packet = torch.cat([packet, row_extras.to(device=packet.device, dtype=packet.dtype).reshape(-1)])
        if isinstance(check_failed, torch.Tensor):  # a device flag: copied on the device, no host sync
            packet[1:2] = check_failed.to(device=packet.device, dtype=packet.dtype).reshape(1)
        elif check_failed:
            packet[1:2] = float(check_failed)
        # this rank's verdicts as a device mask, taken before the gather's wait (no host→device copy after it)
        local = packet[PacketLayout.of(batch).reasons] != 0 if self.config.quarantines else None
        gathered = self.sync(packet)
        return self.compute(step, batch, gathered, error, started, local, extras)

    def update(self, evidence: RolloutEvidence | BaseException,
               batch_size: int | None = None) -> tuple[torch.Tensor, int, BaseException | None]:
        """This process's packet (:mod:`rollout_guard.packet`) on the guard's device, its rows and the error that
        stopped it (then an empty packet flagging the failure, when ``batch_size`` says its shape; without it the
        error is raised). No host sync, no collective."""
        error: BaseException | None = evidence if isinstance(evidence, BaseException) else None
        if error is None:
            try:
                evidence = evidence.validated()
                if batch_size is not None and evidence.batch_size != batch_size:
                    raise GuardInputError("mask", f"{evidence.batch_size} rows, expected {batch_size} on every process",
                                          "give every process a batch of the same size")
                return self._packet(evidence).to(self.device), evidence.batch_size, None
            except Exception as caught:  # noqa: BLE001 - must still join the collective
                error = caught
        if batch_size is None:
            raise error
        status = STATUS_INPUT_ERROR if isinstance(error, GuardInputError) else STATUS_FAILURE
        return empty_packet(batch_size, status, self.device), batch_size, error

    def sync(self, packet: torch.Tensor) -> torch.Tensor:
        """Every process's packet, (ranks, packet size), in rank order: the step's one collective."""
        return self.gather(packet).view(-1, packet.numel())

    def reset_noise(self) -> None:
        """Forget the run's healthy noise (the detector starts over from its prior). Called by :meth:`inspect`
        when the sampling settings change; call it yourself when the offset between engine and trainer changes in a
        way the guard cannot see (another engine version, a new dtype)."""
        self.detector.reset()
        self.noise_resets += 1

    def _packet(self, evidence: RolloutEvidence) -> torch.Tensor:
        """Judge the rows and pack everything this process contributes, on the evidence's device."""
        detector = self.detector
        if detector.device != evidence.device:  # the state follows the evidence
            detector.to(evidence.device)
        judgement = detector.judge(evidence.engine_logprobs, evidence.trainer_logprobs, evidence.mask,
                                   evidence.injected)
        dtype = packet_dtype(evidence.device)
        head = self._heads.get(evidence.device)
        if head is None:
            head = torch.zeros(2, dtype=dtype, device=evidence.device)
            head[:1].fill_(STATUS_OK)  # a fill kernel: no host→device copy, no host sync
            self._heads[evidence.device] = head
        if judgement.record is not None and judgement.record.dtype == dtype:  # the fused step's, in packet order
            return torch.cat([head, judgement.record])
        samples, histogram = summarise(evidence, judgement)
        noise = torch.cat([judgement.noise.centre, judgement.noise.scale, judgement.growth])
        return torch.cat([head, samples.flatten().to(dtype), judgement.reasons.to(dtype), histogram.to(dtype),
                          judgement.kept_counts.flatten().to(dtype), noise.to(dtype),
                          partial_aggregates(samples, judgement.reasons).to(dtype)])

    def compute(self, step: int, batch: int, gathered: torch.Tensor, error: BaseException | None,
                started: float, local: torch.Tensor | None, extras: int = 0) -> StepReport:
        """The step's report from every process's packet; the detector learns the kept rows of the global batch."""
        layout = PacketLayout.of(batch)
        # the state the step was judged against: the update replaces the state's tensors, never writes into them
        judged_with = {name: getattr(self.detector, name) for name in self.detector.STATE}
        host = None
        try:
            # the learning is launched before the one host copy, so that it runs while the host waits for the
            # device; on the device, from the gathered packets (summed over ranks there): the same on every rank
            self.detector.update(gathered[:, layout.counts].view(-1, NUM_REGIONS, NUM_BINS))
            # the one host sync: statuses, check flags, statistics, verdicts, histogram and noise in one copy
            copying = time.perf_counter()
            host = gathered.cpu()
            copied = time.perf_counter()
            if bool((host[:, 0] != STATUS_OK).any()):  # some process could not judge its rows
                caught: BaseException | None = error
            else:
                report = self._report(step, batch, host, layout, gathered.device, judged_with, started, local,
                                      extras)
                self.last_step_parts = (copying - started, copied - copying,
                                        started + self.last_guard_seconds - copied)
                return report
        except Exception as failure:  # noqa: BLE001 - deterministic on the gathered data, so every rank lands here
            caught = failure
        for name, value in judged_with.items():  # a step that was not judged teaches nothing
            setattr(self.detector, name, value)
        head = host[:, :2] if host is not None else gathered[:, :2].cpu()
        return self._failed_step(step, batch, head, caught, started)

    def _report(self, step: int, batch: int, host: torch.Tensor, layout: PacketLayout, device: torch.device,
                judged_with: dict[str, torch.Tensor], started: float, local: torch.Tensor | None,
                extras: int) -> StepReport:
        """The report of a judged step from every process's packet, copied to the host."""
        width = layout.width
        head = host[:, :2].tolist()  # per rank: status, check flag
        reasons_host = host[:, layout.reasons].reshape(-1).to(torch.int32)
        local_rows = slice(self.process_index * batch, (self.process_index + 1) * batch)
        suspect_host = reasons_host != 0
        if self.config.quarantines:  # from the device copy (inspect): no host→device transfer
            local_quarantined = local
        else:
            local_quarantined = torch.zeros(batch, dtype=torch.bool, device=device)
        histogram = host[:, layout.histogram].sum(dim=0)
        report = StepReport(
            step=step,
            samples=host[:, layout.samples].reshape(-1, width).double(),
            suspect=suspect_host,
            reasons=reasons_host,
            quarantined=suspect_host if self.config.quarantines else torch.zeros_like(suspect_host),
            delta_histogram=histogram.to(torch.int64),
            local_rows=local_rows,
            local_quarantined=local_quarantined,
            check_flags=[int(flag) for _, flag in head],
            threshold=self.detector.threshold,
            detector_state=judged_with if bool(suspect_host.any()) else None,
            row_extras=host[:, layout.size:].reshape(-1, extras).double() if extras else None,
        )
        report.metrics = step_metrics(combine_aggregates(host[:, layout.aggregates]), host.shape[0] * batch,
                                      histogram.tolist(), self.config.quarantines)
        self.totals.consecutive_failures = 0
        report.metrics["guarded"] = 1.0
        report.metrics["guard_failures"] = float(self.totals.failures)
        report.metrics.update(self._noise_metrics(host[0, layout.noise].tolist()))
        report.alerts = self.alerts.check(step, report.metrics)
        growth = self.alerts.noise_growth(step, report.metrics, GROWTH_ALERT)
        if growth is not None:
            report.alerts.append(growth)
        self._circuit_breaker(report)
        self.last_guard_seconds = time.perf_counter() - started
        report.metrics["guard_seconds"] = self.last_guard_seconds
        self._update_totals(report)
        return report

    def _noise_metrics(self, noise: list[float]) -> dict[str, float]:
        """The healthy noise the step was judged against, per confidence region (nats), and its growth over the
        run's early level (NaN until it is recorded); the score's threshold (ln Λ)."""
        n = NUM_REGIONS
        metrics = {"score_threshold": self.detector.threshold, "noise_resets": float(self.noise_resets)}
        for region in range(n):
            metrics[f"noise/centre_r{region}"] = noise[region]
            metrics[f"noise/scale_r{region}"] = noise[n + region]
            metrics[f"noise/growth_r{region}"] = noise[2 * n + region]
        return metrics

    def _failed_step(self, step: int, batch: int, head: torch.Tensor, error: BaseException | None,
                     started: float) -> StepReport:
        """The report of a step the guard could not judge; ``head``: (ranks, 2) status and check flags."""
        statuses = head[:, 0]
        failed = [rank for rank, status in enumerate(statuses.tolist()) if status != STATUS_OK]
        structural = bool((statuses == STATUS_INPUT_ERROR).any())
        where = f"on process(es) {failed}" if failed else "after the gather"
        if self.config.strict or (structural and self.totals.steps == 0):
            if error is not None:
                raise error
            raise GuardError(f"rollout_guard failed {where} at step {step}; that process's log names the field")
        totals = self.totals
        totals.failures += 1
        totals.consecutive_failures += 1
        cause = error if error is not None else "that process's log names the cause"
        limit = self.config.max_consecutive_failures
        if limit is not None and totals.consecutive_failures >= limit:
            raise GuardError(f"rollout_guard could not judge {totals.consecutive_failures} steps in a row (the last, "
                             f"step {step}, {where}: {cause}); their batches passed through unguarded. Stopping "
                             "rather than training unguarded: fix the cause, or raise "
                             "GuardConfig.max_consecutive_failures (None: never stop for failures)") from error
        logger.warning("rollout_guard: could not judge step %s (%s: %s); the batch passes through unguarded. "
                       "Failures so far: %s", step, where, cause, totals.failures)
        world = max(len(statuses), 1)
        empty = torch.zeros(world * batch, dtype=torch.bool)
        report = StepReport(
            step=step, samples=torch.full((world * batch, len(SAMPLE_COLUMNS)), math.nan, dtype=torch.float64),
            suspect=empty,
            reasons=torch.zeros(world * batch, dtype=torch.int32), quarantined=empty,
            delta_histogram=torch.zeros(NUM_DELTA_BINS, dtype=torch.int64),
            local_rows=slice(self.process_index * batch, (self.process_index + 1) * batch),
            local_quarantined=torch.zeros(batch, dtype=torch.bool, device=self.device), skipped=True,
            check_flags=[int(flag) for flag in head[:, 1].tolist()],
        )
        self.last_guard_seconds = time.perf_counter() - started
        report.metrics = {"guarded": 0.0, "guard_failures": float(totals.failures), "suspect": 0.0,
                          "quarantined": 0.0, "guard_seconds": self.last_guard_seconds}
        alert = self.alerts.error("guard_failure", step, float(totals.failures), 0.0,
                                  f"rollout_guard could not judge step {step}",
                                  f"The guard failed {where} at step {step} ({cause}); the batch passed through "
                                  f"unguarded. Failures so far: "
                                  f"{totals.failures}, {totals.consecutive_failures} in a row"
                                  + (f" (training stops at {limit} in a row)." if limit is not None else "."))
        if alert is not None:
            report.alerts.append(alert)
        return report

    def _circuit_breaker(self, report: StepReport) -> None:
        config, totals = self.config, self.totals
        if config.max_quarantine_share is None:
            return
        share = report.metrics["suspect_share"]
        over = share > config.max_quarantine_share
        report.metrics["over_ceiling"] = float(over)  # every such step, whatever the alerts' cooldown
        totals.steps_over_ceiling += over
        totals.steps_above_ceiling = totals.steps_above_ceiling + 1 if over else 0
        if totals.steps_above_ceiling < config.ceiling_steps:
            return
        rules = fired_rules({name: report.metrics[f"rule/{name}"] for name in RULES})
        reason = (
            f"{share:.0%} of the rollouts at step {report.step} were suspect, above max_quarantine_share="
            f"{config.max_quarantine_share:g} for {totals.steps_above_ceiling} step(s) in a row: "
            "the engine itself looks broken "
            f"(max |Δ| {report.metrics['max_abs_delta']:.3g} nats; rules fired: {rules}), not one sample"
        )
        if config.on_ceiling in ("stop", "raise") and config.quarantines:  # monitor mode never stops training
            report.stop_training = (f"rollout_guard stopped training: {reason}. "
                                    "Check the engine (weight sync, cache state, "
                                    "version) before resuming; the quarantine store holds the evidence.")
            totals.stopped = report.stop_training
            alert = self.alerts.circuit_breaker(report.step, share, config.max_quarantine_share,
                                                f"rollout_guard stopped training at step {report.step}",
                                                report.stop_training, throttle=False)
        else:
            if not config.quarantines:
                if config.on_ceiling != "alert" and totals.would_have_stopped is None:
                    totals.would_have_stopped = (f"quarantine mode (on_ceiling={config.on_ceiling!r}) would have "
                                                 f"stopped training at step {report.step}: {reason}")
                reason += "; monitor mode: training goes on"
            alert = self.alerts.circuit_breaker(report.step, share, config.max_quarantine_share,
                                                f"rollout_guard: engine looks broken at step {report.step}", reason,
                                                throttle=True)
        if alert is not None:
            report.alerts.append(alert)

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
        totals.add_history(
            {
                "step": report.step,
                "max_abs_delta": metrics["max_abs_delta"],
                "p99_abs_delta": metrics["p99_abs_delta"],
                "kept_max_abs_delta": metrics["kept_max_abs_delta"],
                "max_score": metrics["max_score"],
                "kept_max_score": metrics["kept_max_score"],
                "score_threshold": metrics["score_threshold"],
                "suspect": metrics["suspect"],
                "quarantined": metrics["quarantined"],
                "guard_seconds": metrics["guard_seconds"],
            }
        )

    def state_dict(self) -> dict:
        return {"config": self.config.to_dict(), "totals": self.totals.to_dict(), "alerts": self.alerts.state_dict(),
                "detector": {name: value.tolist() for name, value in self.detector.state_dict().items()},
                "noise_resets": self.noise_resets,
                "sampling": list(self.sampling) if self.sampling is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.totals = GuardTotals.from_dict(state["totals"])
        self.alerts.load_state_dict(state["alerts"])
        if "detector" in state:
            self.detector.load_state_dict({name: torch.tensor(value, dtype=torch.float64)
                                           for name, value in state["detector"].items()})
        self.noise_resets = int(state.get("noise_resets", 0))
        self.sampling = tuple(state["sampling"]) if state.get("sampling") is not None else None

    def summary(self) -> dict[str, float]:
        totals = self.totals
        summary = {
            "steps": totals.steps + totals.failures, "guarded_steps": totals.steps, "rollouts": totals.rollouts, "suspect": totals.suspect,
            "quarantined": totals.quarantined, "alerts": self.alerts.sent, "guard_failures": totals.failures,
            "output_failures": totals.output_failures,
            **{f"rule/{k}": v for k, v in totals.rule_counts.items()},
        }
        if totals.labelled_steps:
            summary.update(injected=totals.injected, caught=totals.caught, missed=totals.injected - totals.caught,
                           false_alarms=totals.false_alarms)
        if self.config.max_quarantine_share is not None:
            summary["steps_over_ceiling"] = totals.steps_over_ceiling
        if totals.skipped_optimizer_steps:
            summary["skipped_optimizer_steps"] = totals.skipped_optimizer_steps
        if totals.stopped:
            summary["stopped"] = totals.stopped
        if totals.would_have_stopped:
            summary["would_have_stopped"] = totals.would_have_stopped
        if self.checks is not None:
            summary["checks"] = self.checks
        return summary
