"""The stateful guard: per step, evidence → statistics → (one gather) → verdict → report; running totals.

Like a torchmetrics metric, this object holds state and syncs it across processes; the math lives in pure
functions. Each :meth:`RolloutGuard.inspect` makes exactly one collective call (``gather``, the same on every
rank, whatever happens) and one device→host copy, so every rank reaches the same verdict on the same global
batch, logs the same numbers and takes the same decisions, failures included: a rank that cannot build its
statistics still joins the gather, flagging its failure, and every rank then skips (or raises) together.

The host work that does not need this step's results runs while the device computes the step's packet: the
calibration update of the step before (held a step once the calibration is past its first steps,
:meth:`rollout_guard.calibration.Calibration.defer`), the thresholds read from it and the next kernel table.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout_guard.alerts import Alert, AlertMonitor  # noqa: F401 - Alert is part of StepReport
from rollout_guard.config import GuardConfig
from rollout_guard.errors import GuardError, GuardInputError
from rollout_guard.evidence import RolloutEvidence
from rollout_guard import fused_statistics
from rollout_guard.calibration import Calibration
from rollout_guard.changepoint import changepoint_score
from rollout_guard.packet import (PacketLayout, combine_aggregates, empty_packet, reanchor, reference_packet,
    step_metrics)
from rollout_guard.statistics import (
    CALIBRATION_WIDTH, COLUMN, NUM_DELTA_BINS, NUM_ENGINE_BUCKETS, SAMPLE_COLUMNS, batch_thresholds,
)
from rollout_guard.verdict import RULE_BIT, RULES, fired_rules

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
    drift_threshold: float | None = None  # nats: the drift threshold this step was judged with (calibrated)
    changepoint_threshold: float | None = None  # ln Λ: the changepoint rule's this step (None: it did not judge)
    # this process's engine context of the step's rollouts (an object with ``rows`` and ``injected``), set by an
    # integration that collects it (the TRL adapter with vLLM) before the report goes to the sinks, which may run on
    # the background writer after the next step's context exists
    engine_context: Any = None

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


_COUNTERS = ("steps", "rollouts", "suspect", "quarantined", "injected", "caught", "false_alarms", "labelled_steps",
             "failures", "output_failures", "steps_above_ceiling")


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
    # failures, on this process, of what is written or collected beside the verdict (records, decoding, sinks, the
    # engine context; non-strict mode): those steps were judged
    output_failures: int = 0
    steps_above_ceiling: int = 0  # consecutive steps above max_quarantine_share, for the circuit breaker
    rule_counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RULES, 0))
    history: list[dict[str, float]] = field(default_factory=list)  # one compact row per step, for charts
    stopped: str | None = None  # why the circuit breaker stopped training, if it did

    def to_dict(self) -> dict:
        return {**{key: getattr(self, key) for key in _COUNTERS}, "rule_counts": dict(self.rule_counts),
                "history": list(self.history), "stopped": self.stopped}

    @classmethod
    def from_dict(cls, state: dict) -> GuardTotals:
        totals = cls(**{key: state.get(key, 0) for key in _COUNTERS})
        totals.rule_counts.update(state.get("rule_counts", {}))
        totals.history = list(state.get("history", []))
        totals.stopped = state.get("stopped")
        return totals


class RolloutGuard:
    """Judges each batch of rollouts; engine- and framework-agnostic.

    Args:
        config: the guard's settings.
        gather: concatenates a tensor along dim 0 across processes, in rank order (``accelerator.gather``);
            identity for one process. Called exactly once per :meth:`inspect`, on every rank.
        process_index: this process's rank.
        device: where the gathered tensors live (the collective's device, e.g. ``accelerator.device``).
    """

    def __init__(self, config: GuardConfig | None = None, gather: Gather | None = None, process_index: int = 0,
                 device: torch.device | str = "cpu") -> None:
        self.config = config or GuardConfig()
        self.gather = gather or _no_gather
        self.process_index = process_index
        self.device = torch.device(device)
        self.totals = GuardTotals()
        self.alerts = AlertMonitor(self.config)
        self.calibration = Calibration(self.config)
        self.sampling: tuple | None = None  # the sampling settings the calibration was learned under
        self.calibration_resets = 0
        self.last_guard_seconds = 0.0
        self._kernel_parameters: tuple | None = None  # (thresholds, drift and changepoint thresholds, their kernel table)
        self._judged_drift: float | None = None  # nats: the drift threshold of the last packet built
        self._judged_changepoint: float | None = None  # ln Λ: the changepoint threshold of the last packet built
        self._judged_with: tuple | None = None  # the centres and centred flags it was built with (Calibration)
        self._metrics_cache: tuple | None = None  # (thresholds, drift and changepoint thresholds, resets, metrics)
        self.checks: str | None = None  # what the caller's setup lets the guard check, when not everything (summary)

    def inspect(self, evidence: RolloutEvidence | BaseException, step: int, batch_size: int | None = None,
                check_failed: torch.Tensor | bool | int = False,
                sampling: Sequence[object] | None = None) -> StepReport:
        """Judge one batch. ``evidence`` may instead be the exception raised while collecting it on this rank;
        ``batch_size`` (rows on this rank) lets a failing rank still join the collective with the right shape.
        ``check_failed``: this rank's verdict on checks of the caller's own (a bool, a bitmask of flags below 2^24,
        or a 0-dim device tensor so that it costs no host sync), carried in the one gather, also in a step the guard
        could not judge: ``report.check_flags`` holds every rank's, the same on every rank, so that all of them act
        on it together (``report.check_failed_on``, ``report.flagged_on(flag)``). ``sampling``: the settings these
        rollouts were sampled with (e.g. temperature, top_p, top_k; the same on every rank); when they differ from
        the previous step's, the calibrated centres start over (:meth:`recalibrate`): the processed logprobs' offset
        depends on them. A guard that has been told them also judges with its own drift threshold and the lower
        ``calibrated_spike_floor`` (:attr:`Calibration.announced`: an unannounced change would fire them on healthy
        rows). ``None``: unknown, the calibration carries on."""
        started = time.perf_counter()
        if sampling is not None:
            settings = tuple(sampling)
            if self.sampling is not None and settings != self.sampling:
                self.recalibrate()
            self.sampling = settings
            self.calibration.announced = True
        error: BaseException | None = evidence if isinstance(evidence, BaseException) else None
        packet: torch.Tensor | None = None
        if error is None:
            try:
                evidence = evidence.validated()
                if batch_size is not None and evidence.batch_size != batch_size:
                    raise GuardInputError("mask", f"{evidence.batch_size} rows, expected {batch_size} on every process",
                                          "give every process a batch of the same size")
                packet = self._packet(evidence)
                batch = evidence.batch_size
            except Exception as caught:  # noqa: BLE001 - must still join the collective below
                error = caught
        try:  # on every rank, whatever happened above, so that every rank holds the same calibration
            self._settle_calibration()
        except Exception as caught:  # noqa: BLE001 - deterministic on gathered data: every rank lands here
            error = error if error is not None else caught
        if error is not None:
            if batch_size is None:
                raise error
            status = STATUS_INPUT_ERROR if isinstance(error, GuardInputError) else STATUS_FAILURE
            packet, batch = empty_packet(batch_size, status, self.device), batch_size
        if isinstance(check_failed, torch.Tensor):  # a device flag: copied on the device, no host sync
            packet[1:2] = check_failed.to(device=packet.device, dtype=packet.dtype).reshape(1)
        elif check_failed:
            packet[1:2] = float(check_failed)
        sent = packet.to(self.device)
        # this rank's verdicts as a device mask, launched before the gather's wait (no host→device copy after it)
        local = sent[PacketLayout(batch).reasons] != 0 if self.config.quarantines else None
        gathered = self.gather(sent).view(-1, packet.numel())  # the one collective
        try:
            return self._judge(step, batch, gathered, error, started, local)
        except Exception as caught:  # noqa: BLE001 - deterministic on the gathered data, so every rank lands here
            return self._failed_step(step, batch, gathered[:, :2].cpu(), caught, started)

    def recalibrate(self) -> None:
        """Start the calibration over (:meth:`Calibration.restart`): centre 0, the warm-up allowance and the
        uncalibrated spike thresholds (never below the ones in use before; for tokens no side found likely, the
        reading from all such tokens kept, at least ``spike_excess``) until each bucket is calibrated again from new
        kept tokens alone. Called by :meth:`inspect` when the sampling settings change; call it yourself
        when the offset between engine and trainer changes in a way the guard cannot see (another engine version,
        a new dtype)."""
        self.calibration.restart()
        self.calibration_resets += 1

    def _packet(self, evidence: RolloutEvidence) -> torch.Tensor:
        """This process's packet (:mod:`rollout_guard.packet`): the fused kernel where it applies, else the
        pure-torch reference. Buckets whose centre the calibration does not know yet are judged around the batch's
        own (:func:`batch_thresholds`), and so are those whose batch median moved away from it when the guard is not
        told the sampling settings (:meth:`Calibration.follow`); the packet's calibration sums are then moved back
        to the calibration's centres. Buckets not calibrated yet take their spike threshold from the batch too,
        where that is lower than the uncalibrated one (:func:`rollout_guard.statistics.batch_spike_thresholds`)."""
        own = self.calibration.uncentred_on(evidence.device, evidence.batch_size)  # None: every centre is set
        follow = self.calibration.follow()  # None when told the sampling settings
        spiky = self.calibration.uncalibrated_on(evidence.device, evidence.batch_size)  # None: all calibrated
        batch_centres = own is not None or follow is not None or spiky is not None
        fused = (self.config.fused_statistics and evidence.device.type == "cuda" and evidence.mask.shape[-1] > 0
                 and fused_statistics.available())
        # the threshold tensors on the device: for the reference path, or to replace the batch's centres in; the
        # fused path otherwise reads its cached parameter table only
        thresholds = self.calibration.thresholds(evidence.device) if batch_centres or not fused else None
        shift = own_noise = None
        if batch_centres:
            thresholds, shift, spread = batch_thresholds(evidence, self.config, thresholds, own, follow, spiky,
                                                         self.calibration.spike_floor())
            own_noise = None if own is None else (thresholds.centre, spread)
        self._judged_drift = self.calibration.drift_threshold_value()
        self._judged_with = self.calibration.judged_with()
        score = self._changepoint_score(evidence, fused, own_noise)
        if fused:
            table = self._kernel_table(evidence.device)
            table = table if shift is None else fused_statistics.with_centres(table, thresholds)
            packet = fused_statistics.fused_packet(evidence, self.config, table, changepoint=score)
        else:
            packet = reference_packet(evidence, self.config, thresholds, self._judged_drift,
                                      self.calibration.row_scaling(evidence.device), score, self._judged_changepoint)
        return packet if shift is None else reanchor(packet, PacketLayout(evidence.batch_size), shift)

    def _changepoint_score(self, evidence: RolloutEvidence, fused: bool,
                           own_noise: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        """(B,) each row's change-point score on the evidence's device (no host sync), when the ``changepoint``
        rule judges this step (:meth:`Calibration.changepoint_threshold_value`) and both sides' logprobs are
        there; sets the threshold it is judged with (``None``: not judged). ``fused``: the score's Triton kernel
        (where the packet's runs), else its torch form. ``own_noise``: (K,) centre and spread from the batch
        (:func:`batch_thresholds`), read for the buckets whose spread there is > 0 — those whose centre the
        calibration does not know yet, as in a setting's first step."""
        threshold = self.calibration.changepoint_threshold_value()
        if threshold is None or not (evidence.has_engine and evidence.has_trainer):
            self._judged_changepoint = None
            return None
        self._judged_changepoint = threshold
        centre, spread = self.calibration.changepoint_noise(evidence.device)
        if own_noise is not None:
            batch = own_noise[1] > 0
            centre, spread = torch.where(batch, own_noise[0], centre), torch.where(batch, own_noise[1], spread)
        return changepoint_score(evidence.engine_logprobs, evidence.trainer_logprobs, evidence.mask, centre, spread,
                                 kernel=fused)

    def _settle_calibration(self) -> None:
        """The previous step's calibration update (:meth:`Calibration.defer`), the thresholds read from it and,
        for the fused kernel, the next step's parameter table: host work done while the device computes this
        step's packet."""
        if not self.calibration.settle():
            return
        self._calibration_metrics()  # reads the thresholds
        if self._kernel_parameters is not None:
            self._kernel_table(self._kernel_parameters[2].device)

    def _kernel_table(self, device: torch.device) -> torch.Tensor:
        """The fused kernel's parameter table for the calibration's current thresholds on ``device``: built once
        per calibration update (:func:`fused_statistics.kernel_parameters`, a non-blocking copy), then reused."""
        values = self.calibration.threshold_values()  # the same object until the next update
        # the changepoint threshold: where no score is computed the kernel reads NaN, which never fires
        readings = (self.calibration.drift_threshold_value(), self.calibration.changepoint_threshold_value())
        cached = self._kernel_parameters
        if cached is None or cached[0] is not values or cached[1] != readings or cached[2].device != device:
            table = fused_statistics.kernel_parameters(self.config, values, device, readings[0],
                                                       self.calibration.row_scaling(), readings[1])
            cached = (values, readings, table)
            self._kernel_parameters = cached
        return cached[2]

    def _judge(self, step: int, batch: int, gathered: torch.Tensor, error: BaseException | None,
               started: float, local: torch.Tensor | None) -> StepReport:
        layout = PacketLayout(batch)
        width = layout.width
        # the one host sync: statuses, check flags, statistics, verdicts, histogram and calibration in one copy
        host = gathered.cpu()
        head = host[:, :2].tolist()  # per rank: status, check flag
        if any(status != STATUS_OK for status, _ in head):
            return self._failed_step(step, batch, host[:, :2], error, started)
        local_rows = slice(self.process_index * batch, (self.process_index + 1) * batch)
        reasons_host = host[:, layout.reasons].reshape(-1).to(torch.int32)
        suspect_host = reasons_host != 0
        if self.config.quarantines:  # from the device copy (inspect): no host→device transfer
            local_quarantined = local
        else:
            local_quarantined = torch.zeros(batch, dtype=torch.bool, device=gathered.device)
        # the step's sums over ranks in one op: histogram, calibration, kept rows
        offset = layout.histogram.start
        summed = host[:, offset: layout.kept_rows + 1].sum(dim=0)
        histogram = summed[: NUM_DELTA_BINS].to(torch.int64)
        report = StepReport(
            step=step,
            samples=host[:, layout.samples].reshape(-1, width).double(),
            suspect=suspect_host,
            reasons=reasons_host,
            quarantined=suspect_host if self.config.quarantines else torch.zeros_like(suspect_host),
            delta_histogram=histogram,
            local_rows=local_rows,
            local_quarantined=local_quarantined,
            check_flags=[int(flag) for _, flag in head],
            drift_threshold=self._judged_drift,
            changepoint_threshold=self._judged_changepoint,
        )
        report.metrics = step_metrics(combine_aggregates(host[:, layout.aggregates].tolist()), host.shape[0] * batch,
                                      summed[: NUM_DELTA_BINS].tolist(), self.config.quarantines)
        report.metrics["guard_failures"] = float(self.totals.failures)
        calibration = summed[layout.calibration.start - offset: layout.calibration.stop - offset].view(
            NUM_ENGINE_BUCKETS, CALIBRATION_WIDTH)
        # the drift histogram also sees the rows the drift rule alone flagged: without them it only sees CUSUMs below
        # the threshold in use, its reading can only fall, and a heavy tail then fires at the floor (measured: 0.37 %
        # of healthy rows in a dense-7B-tail stream); the ceiling bounds what corruption can do to it
        seen = (reasons_host & ~RULE_BIT["drift"]) == 0
        kept_drift = report.samples[seen, COLUMN["drift_cusum"]]  # the global batch: the same on every rank
        # likewise the change-point reading sees the rows the changepoint rule alone flagged
        kept_changepoint = None
        if self._judged_changepoint is not None:
            scored = (reasons_host & ~RULE_BIT["changepoint"]) == 0
            kept_changepoint = report.samples[scored, COLUMN["changepoint_score"]]
        # applied while the next step's packet is computed (Calibration.defer): off the host's critical path
        self.calibration.defer(calibration, float(summed[-1]), kept_drift, self._judged_with, kept_changepoint)
        report.metrics.update(self._calibration_metrics())
        report.alerts = self.alerts.check(step, report.metrics)
        self._circuit_breaker(report)
        self.last_guard_seconds = time.perf_counter() - started
        report.metrics["guard_seconds"] = self.last_guard_seconds
        self._update_totals(report)
        return report

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
        self.totals.failures += 1
        cause = error if error is not None else "that process's log names the cause"
        logger.warning("rollout_guard: could not judge step %s (%s: %s); the batch passes through unguarded. "
                       "Failures so far: %s", step, where, cause, self.totals.failures)
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
        report.metrics = {"guard_failures": float(self.totals.failures), "suspect": 0.0, "quarantined": 0.0,
                          "guard_seconds": self.last_guard_seconds}
        return report

    def _circuit_breaker(self, report: StepReport) -> None:
        config, totals = self.config, self.totals
        if config.max_quarantine_share is None:
            return
        share = report.metrics["suspect_share"]
        totals.steps_above_ceiling = totals.steps_above_ceiling + 1 if share > config.max_quarantine_share else 0
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
                reason += "; monitor mode: training goes on"
            alert = self.alerts.circuit_breaker(report.step, share, config.max_quarantine_share,
                                                f"rollout_guard: engine looks broken at step {report.step}", reason,
                                                throttle=True)
        if alert is not None:
            report.alerts.append(alert)

    def _calibration_metrics(self) -> dict[str, float]:
        """The thresholds the next step will use, per engine bucket (nats); read once per calibration update."""
        values = self.calibration.threshold_values()  # the same object until the next update
        readings = (self.calibration.drift_threshold_value(), self.calibration.changepoint_threshold_value())
        cached = self._metrics_cache
        if cached is not None and cached[0] is values and cached[1] == readings and cached[2] == self.calibration_resets:
            return cached[3]
        centre, _, spike, unlikely, _ = values
        metrics = {"calibrated_buckets": float(sum(self.calibration.calibrated_flags())),
                   "calibration_resets": float(self.calibration_resets),
                   "calibration/drift_threshold": readings[0] if readings[0] is not None else math.nan,
                   "calibration/changepoint_threshold": readings[1] if readings[1] is not None else math.nan}
        # the spread of the run's own mismatch by the engine's confidence (where its noise lives: the fidelity
        # benchmark's --noise-shape); NaN until a bucket's centre is set
        spread = [math.sqrt(v) if own else math.nan
                  for v, own in zip(self.calibration.variance.tolist(), self.calibration.centred_flags(), strict=True)]
        for bucket in range(NUM_ENGINE_BUCKETS):
            metrics[f"calibration/centre_b{bucket}"] = centre[bucket]
            metrics[f"calibration/spread_b{bucket}"] = spread[bucket]
            metrics[f"calibration/spike_b{bucket}"] = spike[bucket]
        # the other buckets have (almost) no such tokens; NaN while they are not judged (+inf): a metric with no data
        metrics["calibration/unlikely_spike_b0"] = unlikely[0] if math.isfinite(unlikely[0]) else math.nan
        self._metrics_cache = (values, readings, self.calibration_resets, metrics)
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
        return {"config": self.config.to_dict(), "totals": self.totals.to_dict(), "alerts": self.alerts.state_dict(),
                "calibration": self.calibration.state_dict(), "calibration_resets": self.calibration_resets,
                "sampling": list(self.sampling) if self.sampling is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.totals = GuardTotals.from_dict(state["totals"])
        self.alerts.load_state_dict(state["alerts"])
        if "calibration" in state:
            self.calibration.load_state_dict(state["calibration"])
        self.calibration_resets = int(state.get("calibration_resets", 0))
        self.sampling = tuple(state["sampling"]) if state.get("sampling") is not None else None
        self.calibration.announced = self.sampling is not None

    def summary(self) -> dict[str, float]:
        totals = self.totals
        summary = {
            "steps": totals.steps, "rollouts": totals.rollouts, "suspect": totals.suspect,
            "quarantined": totals.quarantined, "alerts": self.alerts.sent, "guard_failures": totals.failures,
            "output_failures": totals.output_failures,
            **{f"rule/{k}": v for k, v in totals.rule_counts.items()},
        }
        if totals.labelled_steps:
            summary.update(injected=totals.injected, caught=totals.caught, missed=totals.injected - totals.caught,
                           false_alarms=totals.false_alarms)
        if totals.stopped:
            summary["stopped"] = totals.stopped
        if self.checks is not None:
            summary["checks"] = self.checks
        return summary
