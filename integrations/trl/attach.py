"""Attach and lifecycle: ``attach_guard`` wraps a GRPOTrainer instance and runs the guard in its steps."""

from __future__ import annotations

import copy
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from rollout_guard.config import GuardConfig
from rollout_guard.console import ConsoleSink
from rollout_guard.errors import CircuitBreakerTripped, GuardConfigError, GuardError
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.guard import RolloutGuard, StepReport
from rollout_guard.integrations.trl import checkpoint as checkpoint_state
from rollout_guard.integrations.trl.batch import (
    GroupSettings, check_action_inputs, evidence_of, quarantine_batch, replica_differs, replica_mismatch_message, require,
)
from rollout_guard.integrations.trl.capture import GuardedStep, capture_step
from rollout_guard.integrations.trl.engine_context import EngineContextCollector, StepEngineContext, add_context_to_records
from rollout_guard.integrations.trl.records import build_records, decode_records
from rollout_guard.integrations.trl.sampling import processed_logprobs_warning
from rollout_guard.integrations.trl_versions import describe_trl, warn_if_unsupported
from rollout_guard.selection import worst_suspects
from rollout_guard.sinks import LocalFilesSink, Sink
from rollout_guard.writer import BackgroundWriter, guard_snapshot

logger = logging.getLogger("rollout_guard")

# Copied into TRL's own metrics, which TRL averages over each logging window: hence the prefix, so that nobody takes
# them for the true per-step `rollout_guard/*` values (metrics.jsonl, the W&B and trackio sinks).
TRL_METRIC_PREFIX = "rollout_guard_window_mean/"
TRL_METRIC_KEYS = ("max_abs_delta", "mean_abs_delta", "p99_abs_delta", "engine_max_logprob", "suspect", "quarantined", "guard_seconds",
                   "overhead_seconds")


def default_sinks(report_to: list[str] | str | None, config: GuardConfig, output_dir: Path) -> list[Sink]:
    """Local files and the console (alerts, end-of-training summary) always; W&B and trackio when the trainer
    reports to them."""
    report_to = [report_to] if isinstance(report_to, str) else list(report_to or [])
    sinks: list[Sink] = [LocalFilesSink(output_dir, config), ConsoleSink(output_dir)]
    if "wandb" in report_to:
        from rollout_guard.integrations.wandb import WandbSink

        sinks.append(WandbSink(config, image_dir=output_dir / "images"))
    if "trackio" in report_to:
        from rollout_guard.integrations.trackio import TrackioSink

        sinks.append(TrackioSink())
    return sinks


class TrlGuard:
    """The guard attached to one GRPOTrainer. Create it with :func:`attach_guard`."""

    def __init__(self, trainer: Any, config: GuardConfig | None = None, sinks: list[Sink] | None = None,
                 keep_steps: bool = False) -> None:
        if config is not None and not isinstance(config, GuardConfig):
            raise GuardError(f"attach_guard(trainer, config={config!r}): config must be a GuardConfig, e.g. "
                             f"attach_guard(trainer, GuardConfig(mode='monitor'))")
        if sinks is not None and not (isinstance(sinks, (list, tuple)) and all(hasattr(s, "on_step") for s in sinks)):
            raise GuardError(f"attach_guard(trainer, sinks={sinks!r}): sinks must be a list of sinks (objects with on_records, "
                             "on_step and on_end), e.g. [LocalFilesSink(folder, config)], or None for the defaults")
        if not isinstance(keep_steps, bool):
            raise GuardError(f"attach_guard(trainer, keep_steps={keep_steps!r}): use True or False")
        if getattr(trainer, "_rollout_guard", None) is not None:
            raise GuardError("this trainer already has a rollout guard attached; call attach_guard(trainer) once")
        for attribute in ("_generate_and_score_completions", "_calculate_rewards", "_load_optimizer_and_scheduler",
                          "accelerator", "num_generations", "reward_weights", "scale_rewards"):
            if not hasattr(trainer, attribute):
                raise GuardError(
                    f"trainer of type {type(trainer).__name__} has no '{attribute}': attach_guard needs a TRL "
                    f"GRPOTrainer ({describe_trl()})"
                )
        warn_if_unsupported()
        self.trainer = trainer
        self.config = config or GuardConfig()
        has_trainer_logprobs = trainer.use_vllm and trainer.vllm_importance_sampling_correction
        if not trainer.use_vllm and getattr(trainer, "rollout_func", None) is None and not self.config.compute_trainer_logprobs:
            raise GuardConfigError(
                "compute_trainer_logprobs", False,
                "with use_vllm=False there are no engine logprobs, so the guard needs the trainer's: set it to True",
            )
        accelerator = trainer.accelerator
        self.guard = RolloutGuard(self.config, gather=accelerator.gather, process_index=accelerator.process_index,
                                  device=accelerator.device)
        self.settings = GroupSettings.of(trainer)
        self.is_main_process = accelerator.is_main_process
        self.output_dir = Path(self.config.output_dir or os.path.join(trainer.args.output_dir, "rollout_guard"))
        # engine context of each rollout (vLLM only): wraps this trainer's engine calls, no extra round trip
        self.engine_context = EngineContextCollector.attach(trainer)
        self._engine_step: StepEngineContext | None = None
        if sinks is None:
            sinks = default_sinks(trainer.args.report_to, self.config, self.output_dir) if self.is_main_process else []
            if self.is_main_process and self.engine_context is not None:
                from rollout_guard.engine_view import EngineContextSink

                report_to = trainer.args.report_to
                sinks.append(EngineContextSink(self.output_dir, lambda: self._engine_step, self.config.chart_every_steps,
                                               wandb="wandb" in ([report_to] if isinstance(report_to, str) else list(report_to or []))))
        self.sinks = list(sinks)
        # the sinks' per-step work runs on this thread, off the training thread (main process only)
        self.writer: BackgroundWriter | None = BackgroundWriter() if self.is_main_process and self.sinks else None
        self._writer_tokenizer: Any = None
        self.last_report: StepReport | None = None
        self.last_evidence: RolloutEvidence | None = None  # what the latest step was judged on (this process)
        self.last_overhead_seconds = 0.0
        self.stop_reason: str | None = None
        self.keep_steps = keep_steps
        self.steps: list[GuardedStep] = []
        self._rewards_per_func: torch.Tensor | None = None
        self._said: set[str] = set()
        self._closed = False

        self._original_generate_and_score = trainer._generate_and_score_completions
        self._original_calculate_rewards = trainer._calculate_rewards
        self._original_load_optimizer_and_scheduler = trainer._load_optimizer_and_scheduler
        trainer._generate_and_score_completions = self._generate_and_score_completions
        trainer._calculate_rewards = self._calculate_rewards
        trainer._load_optimizer_and_scheduler = self._load_optimizer_and_scheduler
        trainer.add_callback(_GuardCallback(self))
        trainer._rollout_guard = self
        if not trainer.use_vllm and getattr(trainer, "rollout_func", None) is None:
            self._say_once(
                "no-engine",
                "rollout_guard: use_vllm=False, so there are no engine logprobs to compare with: the guard checks "
                "the trainer's own logprobs only (confidence and non-finite values).",
            )
        elif not has_trainer_logprobs and self.config.compute_trainer_logprobs:
            self._say_once(
                "extra-forward",
                "rollout_guard: TRL does not compute trainer logprobs here (no vLLM importance-sampling correction); "
                "the guard runs one extra no-grad forward pass per generation batch to get them.",
            )
        if trainer.use_vllm or getattr(trainer, "rollout_func", None) is not None:
            message = processed_logprobs_warning(trainer)
            if message is not None:
                self._say_once("processed-logprobs", message)

    # -- wrapped trainer methods ------------------------------------------------------------------------------

    def _calculate_rewards(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        rewards_per_func = self._original_calculate_rewards(*args, **kwargs)
        self._rewards_per_func = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        self._rewards_per_func = None
        self._engine_step = None
        if self.engine_context is not None:
            self.engine_context.begin_step()
        batch = self._original_generate_and_score(inputs)
        if not self.trainer.model.training:
            return batch
        if self.engine_context is not None:
            try:
                self._engine_step = self.engine_context.end_step(self.local_rows())
            except Exception as error:
                self._failure("collecting the engine context", error)
        started = time.perf_counter()
        guarded = self.guard_batch(batch)
        self.last_overhead_seconds = time.perf_counter() - started
        if self.keep_steps and self.last_report is not None:
            self.steps.append(capture_step(batch, guarded, self.last_report, self.last_evidence, self._rewards_per_func,
                                           getattr(self.trainer, "_rollout_guard_injector", None), self.last_overhead_seconds))
        return guarded

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        self._original_load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self.load_state(checkpoint)

    # -- the guarded step -------------------------------------------------------------------------------------

    def local_rows(self) -> int:
        """Rows of one generation batch on this process (the same on every process)."""
        args = self.trainer.args
        return args.per_device_train_batch_size * args.steps_per_generation

    def _collect_evidence(self, batch: dict[str, Any]) -> RolloutEvidence:
        trainer_logprobs = None
        if batch.get("old_per_token_logps") is None and self.config.compute_trainer_logprobs:
            trainer_logprobs = self._trainer_logprobs(batch)
        injector = getattr(self.trainer, "_rollout_guard_injector", None)
        return evidence_of(batch, trainer_logprobs, injector.last_selected if injector is not None else None)

    def guard_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Judge TRL's batch and, in quarantine mode, return the batch the loss sees. Symmetric across processes:
        whatever could fail on one process only (collecting evidence, checking what the action needs, the replica
        of TRL's advantages) happens before the step's one gather and travels in it, so that every process skips,
        raises or acts together; after the gather the action is arithmetic on checked inputs."""
        started = time.perf_counter()
        trainer = self.trainer
        rewards = self._rewards_per_func
        records: list = []
        replica_failed: torch.Tensor | bool = False
        try:
            evidence: RolloutEvidence | BaseException = self._collect_evidence(batch)
            if self.config.quarantines:
                check_action_inputs(batch, rewards, self.local_rows(), self.settings)
            if rewards is not None:
                replica_failed = replica_differs(batch, rewards, self.settings, self._local_slice())
        except Exception as error:  # noqa: BLE001 - still join the collective inside inspect
            evidence = error
        self.last_evidence = evidence if isinstance(evidence, RolloutEvidence) else None
        # The 1-based training step (as TRL logs it) whose update first uses these rollouts.
        report = self.guard.inspect(evidence, step=trainer.state.global_step + 1, batch_size=self.local_rows(),
                                    check_failed=replica_failed)
        self.last_report = report
        if self._engine_step is not None and not report.skipped:
            report.metrics.update(self._engine_step.metrics)  # this process's engine, next to the mismatch
        guarded = batch
        if not report.skipped:
            if report.check_failed_on:
                self._replica_mismatch(report)  # raises on every process in quarantine mode
            if report.any_quarantined:
                try:
                    guarded = quarantine_batch(batch, report, rewards, self.settings)
                except Exception as error:  # checked inputs, identical verdict: no process may go on alone
                    raise GuardError(f"rollout_guard could not quarantine the samples of step {report.step} after "
                                     f"checking its inputs ({type(error).__name__}: {error}); stopping rather than "
                                     "training this process unguarded") from error
            if report.metrics["suspect"] > 0:
                records = self._publish_records(guarded, report, evidence, rewards, batch.get("advantages"))
        # the adapter's whole cost this step, up to handing the sinks' work to the writer (which is then cheap)
        report.metrics["overhead_seconds"] = time.perf_counter() - started
        for key in TRL_METRIC_KEYS:
            if key in report.metrics:
                trainer._metrics["train"][f"{TRL_METRIC_PREFIX}{key}"].append(report.metrics[key])
        self._writer_failures()
        view = guard_snapshot(self.guard) if self.is_main_process and self.sinks else self.guard
        if records:
            self._decode(records)
            self._to_sinks("on_records", records, view)
        self._to_sinks("on_step", report, view)
        if report.stop_training:
            self._stop(report)
        return guarded

    def _local_slice(self) -> slice:
        rows = self.local_rows()
        return slice(self.guard.process_index * rows, (self.guard.process_index + 1) * rows)

    def _replica_mismatch(self, report: StepReport) -> None:
        message = replica_mismatch_message(report.check_failed_on, report.step)
        if self.config.quarantines:
            raise GuardError(message)
        alert = self.guard.alerts.error("advantage_replica", report.step, float(len(report.check_failed_on)), 0.0,
                                        f"rollout_guard: TRL's advantages differ from the guard's replica at step {report.step}",
                                        message + "; monitor mode: training goes on")
        if alert is not None:
            report.alerts.append(alert)
        self._say_once("replica-monitor", f"rollout_guard: {message}; monitor mode: training goes on")

    def _stop(self, report: StepReport) -> None:
        """The circuit breaker tripped (quarantine mode): stop after this step, or raise once everything is written."""
        self.stop_reason = report.stop_training
        logger.error(report.stop_training)
        if self.config.on_ceiling == "raise":
            self.close()  # records and metrics are written already; this writes the summary and the chart
            raise CircuitBreakerTripped(report.stop_training)

    def _publish_records(self, batch: dict[str, Any], report: StepReport, evidence: Any, rewards: torch.Tensor | None,
                         advantages_before: torch.Tensor | None) -> list:
        """Every suspect sample's record, on the main process (others get []): full evidence for the step's worst
        ``evidence_samples_per_step`` (chosen from the gathered report, so the same rows on every process),
        statistics only for the rest."""
        try:
            full_rows = set(worst_suspects(report.samples, report.reasons, self.config.evidence_samples_per_step).tolist())
            records = build_records(self.trainer, self.config, self.guard.process_index, batch, report, evidence, rewards,
                                    advantages_before, full_rows=full_rows, decode=False)
        except Exception as error:
            self._failure("writing evidence records", error)
            records = []
from rollout_guard.integrations.trl.engine_context import EngineContextCollector, StepEngineContext, add_context_to_records
from rollout_guard.integrations.trl.records import build_records, decode_records

    def _to_sinks(self, event: str, *payload: Any) -> None:
        """Hand each sink's ``event`` to the background writer (main process only); without a writer (closed, or
        no sinks) run it here."""
        if not self.is_main_process:
            return
        for sink in self.sinks:
            what = f"{type(sink).__name__}.{event}"
            if self.writer is not None:
                self.writer.submit(what, getattr(sink, event), *payload)
                continue
            try:
                getattr(sink, event)(*payload)
            except Exception as error:
                self._failure(what, error)

    def flush(self) -> None:
        """Wait until the background writer has run everything handed to it, then report its failures here."""
        if self.writer is not None:
            self.writer.flush()
        self._writer_failures()

    def _writer_failures(self) -> None:
        """Report what failed on the writer thread since the last look, on this (the training) thread: raised in
        strict mode, else counted in ``guard_failures`` and logged."""
        if self.writer is None:
            return
        for what, error in self.writer.take_errors():
            self._failure(what, error)

    def _failure(self, what: str, error: BaseException) -> None:
        if self.config.strict:
            raise error
        self.guard.totals.failures += 1
        logger.warning("rollout_guard: failed while %s (%s: %s); training goes on. Failures so far: %s",
                       what, type(error).__name__, error, self.guard.totals.failures)

    def _trainer_logprobs(self, batch: dict[str, Any]) -> torch.Tensor:
        trainer = self.trainer
        input_ids = torch.cat([require(batch, "prompt_ids"), require(batch, "completion_ids")], dim=1)
        attention_mask = torch.cat([require(batch, "prompt_mask"), require(batch, "completion_mask")], dim=1)
        with torch.no_grad():
            logprobs, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, input_ids, attention_mask, batch["completion_ids"].size(1),
                batch_size=trainer.args.per_device_train_batch_size,
            )
        return logprobs

    # -- checkpoints -----------------------------------------------------------------------------------------

    def save_state(self, checkpoint_dir: str | Path, global_step: int | None = None) -> Path:
        """Write the guard's running state (totals, history, alert baselines) next to a TRL checkpoint, after the
        background writer has written everything of the steps before it."""
        self.flush()
        return checkpoint_state.save_state(self.guard, checkpoint_dir, global_step)

    def load_state(self, checkpoint_dir: str | Path) -> bool:
        """Restore the guard's state from a TRL checkpoint; the local files drop what the run wrote after that
        checkpoint (those steps run again), so a resumed run has one line per step."""
        state = checkpoint_state.load_state(self.guard, checkpoint_dir)
        if state is None:
            return False
        step = checkpoint_state.saved_step(state)
        self.flush()
        for sink in self.sinks if self.is_main_process else []:
            if hasattr(sink, "on_resume"):
                try:
                    sink.on_resume(step, self.guard)
                except Exception as error:
                    self._failure(f"{type(sink).__name__}.on_resume", error)
        return True

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            if self.writer is not None:
                self.writer.close()
                self.writer = None
        self._to_sinks("on_end", self.guard)
        if self.stop_reason is not None and self.config.on_ceiling == "stop":
            state = self.trainer.state
            logger.error("rollout_guard: training was STOPPED by the circuit breaker at step %s of %s: %s trainer.train() "
                         "returned normally, but the model did not train as planned; summary.json says so under "
                         "'stopped'. GuardConfig(on_ceiling='raise') makes this an exception.",
                         state.global_step, state.max_steps, self.stop_reason)

    def _say_once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.warning(message)


class _GuardCallback(TrainerCallback):
    def __init__(self, guarded: TrlGuard) -> None:
        self.guarded = guarded

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
        if self.guarded.stop_reason is not None:
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):  # noqa: ANN001
        if args.should_save:
            checkpoint = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            if checkpoint.is_dir():
                self.guarded.save_state(checkpoint, state.global_step)
        return control

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001
        self.guarded.close()


def attach_guard(trainer: Any, config: GuardConfig | None = None, sinks: list[Sink] | None = None,
                 keep_steps: bool = False) -> TrlGuard:
    """Guard this GRPOTrainer's rollouts from now on; returns the attached guard (also ``trainer._rollout_guard``).

    ``sinks``: where reports go (default: local files, plus W&B / trackio when ``report_to`` names them).
    ``keep_steps``: keep every step's batches, evidence and report in ``.steps`` (for checking a setup)."""
    return TrlGuard(trainer, config=config, sinks=sinks, keep_steps=keep_steps)
