"""Attach and lifecycle: ``attach_guard`` wraps a GRPOTrainer instance and runs the guard in its steps."""

from __future__ import annotations

import copy
import contextlib
import logging
import math
import os
import pickle
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from rollout_guard.config import GuardConfig
from rollout_guard.outputs.console import ConsoleSink
from rollout_guard.errors import CircuitBreakerTripped, GuardError
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.guard import RolloutGuard, StepReport
from rollout_guard.outcomes import is_correction_metrics, is_correction_rows, reward_metrics
from rollout_guard import checkpoint as checkpoint_state
from rollout_guard.integrations.trl.batch import (
    GroupSettings, check_action_inputs, evidence_of, loss_mask_of, quarantine_batch, replica_differs,
    replica_mismatch_message,
    require, truncated_judged_mask, truncated_rows,
)
from rollout_guard.integrations.trl.capture import GuardedStep, capture_step
from rollout_guard.integrations.trl.engine_context import (EngineContextCollector, StepEngineContext,
    add_context_to_records)
from rollout_guard.integrations.trl.records import build_records, decode_records
from rollout_guard.integrations.trl.sampling import processed_logprobs_warning, sampling_settings
from rollout_guard.integrations.trl.support import SupportCapture, describe, support_settings
from rollout_guard.integrations.trl_versions import describe_trl, warn_if_unsupported
from rollout_guard.selection import worst_suspects
from rollout_guard.outputs.sinks import LocalFilesSink, Sink
from rollout_guard.outputs.writer import BackgroundWriter, guard_snapshot

logger = logging.getLogger("rollout_guard")

# the adapter's own checks, as bits of the flags each process sends in the step's gather (RolloutGuard.inspect)
REPLICA_CHECK = 1  # TRL's advantages differ from the guard's replica of them on this process
SUPPORT_CHECK = 2  # the trainer's log-mass of the engine's support could not be computed on this process
OUTPUT_CHECK = 4  # strict mode: writing this process's outputs (records, decoding, sinks) failed since the last step
ONE_SIDED_CHECK = 8  # the setup promises engine and trainer logprobs, and this process's batch lacks one of them

# Copied into TRL's own metrics, which TRL averages over each logging window: hence the prefix, so that nobody takes
# them for the true per-step `rollout_guard/*` values (metrics.jsonl, the W&B and trackio sinks).
TRL_METRIC_PREFIX = "rollout_guard_window_mean/"
TRL_METRIC_KEYS = ("guarded", "max_abs_delta", "mean_abs_delta", "p99_abs_delta", "engine_max_logprob", "suspect",
                   "quarantined", "guard_seconds",
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
                             "attach_guard(trainer, GuardConfig(mode='monitor'))")
        if sinks is not None and not (isinstance(sinks, (list, tuple)) and all(isinstance(s, Sink) for s in sinks)):
            raise GuardError(f"attach_guard(trainer, sinks={sinks!r}): sinks must be a list of "
                             "rollout_guard.outputs.sinks.Sink subclasses, e.g. [LocalFilesSink(folder, config)], or None for "
                             "the defaults")
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
                from rollout_guard.outputs.engine_view import EngineContextSink

                report_to = trainer.args.report_to
                sinks.append(EngineContextSink(self.output_dir, self.config.chart_every_steps,
                                               wandb="wandb" in ([report_to] if isinstance(report_to, str)
                                                                 else list(report_to or []))))
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
        # strict mode, several processes: the first output failure not raised yet (raised on every process together
        # after the next step's gather; :meth:`_failure`)
        self._output_failure: tuple[str, BaseException] | None = None

        # What this setup lets the guard see (see the messages below): engine logprobs (vLLM or a rollout_func), TRL's
        # own trainer logprobs, the guard's extra forward pass where it can feed a two-sided rule.
        self.has_engine = bool(trainer.use_vllm or getattr(trainer, "rollout_func", None) is not None)
        self.trl_trainer_logprobs = trl_computes_trainer_logprobs(trainer)
        self.extra_forward = self.has_engine and not self.trl_trainer_logprobs and self.config.compute_trainer_logprobs
        two_sided = self.has_engine and (self.trl_trainer_logprobs or self.extra_forward)
        self.two_sided = two_sided  # engine and trainer logprobs expected in every batch (checked each step)
        self.nothing_to_check = not self.has_engine and not self.trl_trainer_logprobs
        # Truncated rows TRL masks out (mask_truncated_completions): judged on their engine logprobs, with correct
        # trainer logprobs from the pass that has them (TRL's are computed under a zero mask: see _collect_evidence).
        self.judges_truncated = bool(getattr(trainer, "mask_truncated_completions", False) and self.has_engine
                                     and (self.config.compute_trainer_logprobs or not self.trl_trainer_logprobs))
        self.guard.checks = None if two_sided else (  # the summary names a limited mode only
            "nothing (no logprobs; batches pass through)" if self.nothing_to_check else "non-finite values only")
        self._generated: tuple[list, list | None] | None = None  # this step's completion token lists and tool masks
        # the trainer's log-mass of the engine's top-k/top-p/min-p support, from the pass that scores the tokens
        support = support_settings(trainer) if two_sided and self.config.compare_on_engine_support else None
        self.support = SupportCapture(trainer, support) if support is not None else None
        self._support_mass: torch.Tensor | None = None  # (B, K) of TRL's own pass this step
        # rows, tokens, seconds of the latest truncated-row pass
        self.last_truncated_pass: dict[str, float] | None = None
        # every row of the latest generation batch quarantined (from the gathered verdict: the same on every
        # process), and that flag for each micro-batch the loss has seen since the last optimizer step
        self._empty_batch = False
        self._micro_batches: list[bool] = []

        self._original_generate_and_score = trainer._generate_and_score_completions
        self._original_calculate_rewards = trainer._calculate_rewards
        self._original_load_optimizer_and_scheduler = trainer._load_optimizer_and_scheduler
        trainer._generate_and_score_completions = self._generate_and_score_completions
        trainer._calculate_rewards = self._calculate_rewards
        trainer._load_optimizer_and_scheduler = self._load_optimizer_and_scheduler
        if hasattr(trainer, "_prepare_inputs"):
            self._original_prepare_inputs = trainer._prepare_inputs
            trainer._prepare_inputs = self._prepare_inputs
        if self.judges_truncated and hasattr(trainer, "_generate"):
            self._original_generate = trainer._generate
            trainer._generate = self._generate
        trainer.add_callback(_GuardCallback(self))
        trainer._rollout_guard = self
        if not self.has_engine:
            self._say_once(
                "no-engine",
                "rollout_guard: use_vllm=False: the rollouts come from the trainer's own model, so there is no engine "
                "to disagree with and the guard checks NON-FINITE VALUES ONLY, in the trainer logprobs TRL computes "
                "itself; it runs no extra forward pass. " + (
                    "TRL computes none in this setup (gradient_accumulation_steps is a multiple of "
                    "steps_per_generation "
                    "× num_iterations), so the guard has nothing to check and passes every batch through. "
                    if self.nothing_to_check else "")
                + "For the mismatch and confidence checks, sample with vLLM (use_vllm=True) or a rollout_func that "
                "returns the engine's logprobs.",
            )
        elif not two_sided:
            self._say_once(
                "engine-only",
                "rollout_guard: no trainer logprobs (TRL computes none with vllm_importance_sampling_correction=False, "
                "and GuardConfig(compute_trainer_logprobs=False)): the guard checks NON-FINITE engine logprobs ONLY, "
                "no mismatch or confidence checks.",
            )
        elif self.extra_forward:
            self._say_once(
                "extra-forward",
                "rollout_guard: TRL does not compute trainer logprobs here (no vLLM importance-sampling correction); "
                "the guard runs one extra no-grad forward pass per generation batch to get them.",
            )
        if trainer.use_vllm or getattr(trainer, "rollout_func", None) is not None:
            message = processed_logprobs_warning(trainer)
            if message is not None and self.support is not None:
                message = ("rollout_guard: the engine reports logprobs renormalised over what "
                           f"{describe(self.support.settings)} keeps; the guard compares the trainer's on the same "
                           "support (its log-mass of it from the pass "
                           "that computes its logprobs; GuardConfig.compare_on_engine_support).")
            if message is not None:
                self._say_once("processed-logprobs", message)

    # -- wrapped trainer methods ------------------------------------------------------------------------------

    def _calculate_rewards(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        rewards_per_func = self._original_calculate_rewards(*args, **kwargs)
        self._rewards_per_func = rewards_per_func
        return rewards_per_func

    def _generate(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's ``_generate``; keeps the host token lists and tool masks TRL builds the batch from (no copy)."""
        output = self._original_generate(*args, **kwargs)
        self._generated = (output[1], output[2]) if isinstance(output, tuple) and len(output) > 2 else None
        return output

    def _prepare_inputs(self, generation_batch: Any) -> Any:
        """TRL's ``_prepare_inputs`` (one micro-batch of the loss); notes whether it comes from a generation batch
        whose every row was quarantined."""
        inputs = self._original_prepare_inputs(generation_batch)
        if self.trainer.model.training:
            self._micro_batches.append(self._empty_batch)
        return inputs

    def skip_empty_optimizer_step(self, step: int) -> bool:
        """Whether the optimizer step about to be taken (TRL's 1-based ``step``) has only quarantined rows behind
        it: every micro-batch accumulated since the last optimizer step came from a generation batch whose every row
        was quarantined (the gathered verdict, so the same answer on every process). Then the step is counted
        (``skipped_optimizer_steps``) and logged; the caller skips it. Forgets the micro-batches either way."""
        empty = bool(self._micro_batches) and all(self._micro_batches)
        self._micro_batches = []
        if empty:
            totals = self.guard.totals
            totals.skipped_optimizer_steps += 1
            logger.warning("rollout_guard: every row behind optimizer step %s was quarantined; the optimizer step is "
                           "skipped (no momentum or weight decay applied on a zero gradient). Skipped so far: %s",
                           step, totals.skipped_optimizer_steps)
        return empty

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        self._rewards_per_func = None
        self._empty_batch = False
        self._engine_step = None
        if self.engine_context is not None:
            self.engine_context.begin_step()
        self._generated = None
        self._support_mass = None
        if self.support is not None and self.trl_trainer_logprobs:
            with self.support.active(first_only=True):
                batch = self._original_generate_and_score(inputs)
            self._support_mass = self.support.first()
        else:
            batch = self._original_generate_and_score(inputs)
        if not self.trainer.model.training or self.nothing_to_check:
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
                                           getattr(self.trainer, "_rollout_guard_injector", None),
                                           self.last_overhead_seconds))
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

    def _truncated(self) -> tuple[list[int], list[int], list | None]:
        """This process's rows TRL masked as truncated (host data from ``_generate``): rows, lengths, tool masks."""
        if not self.judges_truncated or self._generated is None:
            return [], [], None
        completion_ids, tool_masks = self._generated
        trainer = self.trainer
        tokenizer = getattr(trainer, "_tokenizer", None)
        tokenizer = tokenizer or getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        eos = getattr(trainer, "eos_token_ids", None)
        eos = [tokenizer.eos_token_id] if eos is None else list(eos)
        rows = truncated_rows(completion_ids, {*eos, tokenizer.pad_token_id})
        return rows, [len(completion_ids[row]) for row in rows], tool_masks

    def _collect_evidence(self, batch: dict[str, Any], truncated: tuple[list[int], list[int], list | None],
                          forward_rows: int) -> RolloutEvidence:
        """The evidence: the judged mask (loss mask, plus the truncated rows TRL masked out) and both logprobs.

        TRL scores a truncated row under a zero completion attention mask, and its LM head then leaves every label
        of the row out (TRL 1.15 on: exactly 0.0 per token; 1.14's full-logits path: logprobs of tokens that could
        not attend to the completion): not the row's logprobs. They come from a no-grad forward pass over those rows
        only (``forward_rows`` ≥ their count: every process runs the same number of chunks), or, when the guard runs
        its pass over the whole batch anyway, from that pass under the rebuilt attention mask."""
        rows, lengths, tool_masks = truncated
        loss_mask = loss_mask_of(batch)
        judged, attention = loss_mask, require(batch, "completion_mask")
        if rows:
            judged, attention = truncated_judged_mask(loss_mask, attention, rows, lengths, tool_masks)
        trainer_logprobs, log_mass = None, self._support_mass
        if self.extra_forward:
            trainer_logprobs, log_mass = self._trainer_logprobs(batch, attention)
        elif self.judges_truncated and self.trl_trainer_logprobs and forward_rows:
            trainer_logprobs, log_mass = self._trainer_logprobs(batch, attention, rows, forward_rows)
        if log_mass is not None:  # on the engine's support: trainer − log Z (compare_on_engine_support)
            base = require(batch, "old_per_token_logps") if trainer_logprobs is None else trainer_logprobs
            trainer_logprobs = base - log_mass.to(base)
        injector = getattr(self.trainer, "_rollout_guard_injector", None)
        return evidence_of(batch, trainer_logprobs, injector.last_selected if injector is not None else None,
                           mask=judged)

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
        support_failed = False
        # host work before a collective fails here without leaving that collective: its error travels in the step's
        # gather (raised as this process's evidence below), and every process skips or raises together
        truncated_error: BaseException | None = None
        try:
            truncated = self._truncated()
        except Exception as error:  # noqa: BLE001 - still join the truncated-row pass and the gathers
            truncated, truncated_error = ([], [], None), error
        forward_rows = self._forward_rows(len(truncated[0]))
        loss_tokens: torch.Tensor | None = None
        # the writer's failures since the last look, once a step, before the gather: a strict one travels in it
        # (OUTPUT_CHECK)
        self._writer_failures()
        output_failed = self._output_failure is not None
        try:
            evidence: RolloutEvidence | BaseException = self._collect_evidence(batch, truncated, forward_rows)
            if truncated_error is not None:  # raised after the forward passes, which every process runs
                raise truncated_error
            if self.judges_truncated:
                loss_tokens = self._local_loss_tokens(batch)
            support_failed = self.support is not None and self.support.error is not None
            if support_failed:  # this step's trainer logprobs are off the support here only: no process judges it
                raise GuardError(f"computing the trainer's log-mass of the engine's support (compare_on_engine_support)"
                                 f" failed: {type(self.support.error).__name__}: {self.support.error}")
            if self.config.quarantines:
                check_action_inputs(batch, rewards, self.local_rows(), self.settings)
            if rewards is not None:
                replica_failed = replica_differs(batch, rewards, self.settings, self._local_slice())
        except Exception as error:  # noqa: BLE001 - still join the collective inside inspect
            evidence = error
        self.last_evidence = evidence if isinstance(evidence, RolloutEvidence) else None
        # The 1-based training step (as TRL logs it) whose update first uses these rollouts.
        flags = SUPPORT_CHECK if support_failed else replica_failed
        if self.two_sided and self.last_evidence is not None and not (
                self.last_evidence.engine_logprobs is not None and self.last_evidence.trainer_logprobs is not None):
            flags = flags + ONE_SIDED_CHECK
        report = self.guard.inspect(evidence, step=trainer.state.global_step + 1, batch_size=self.local_rows(),
                                    check_failed=flags + OUTPUT_CHECK if output_failed else flags,
                                    sampling=self._comparison(trainer), row_extras=self._correction_rows(batch))
        self.last_report = report
        if report.flagged_on(OUTPUT_CHECK):
            self._raise_output_failure(report)
        if self._engine_step is not None and not report.skipped:
            report.metrics.update(self._engine_step.metrics)  # this process's engine, next to the mismatch
            report.engine_context = self._engine_step  # what the sinks join to this step's rows, off this thread
        if report.flagged_on(SUPPORT_CHECK):
            self._stop_comparing_on_support(report)
        if self.two_sided:
            self._check_two_sided(report)
        guarded = batch
        if not report.skipped:
            self._outcome_metrics(batch, report, rewards)
            if report.flagged_on(REPLICA_CHECK):
                self._replica_mismatch(report)  # raises on every process in quarantine mode
            if report.any_quarantined:
                try:
                    guarded = quarantine_batch(batch, report, rewards, self.settings,
                                               self._loss_tokens(loss_tokens))
                except Exception as error:  # checked inputs, identical verdict: no process may go on alone
                    raise GuardError(f"rollout_guard could not quarantine the samples of step {report.step} after "
                                     f"checking its inputs ({type(error).__name__}: {error}); stopping rather than "
                                     "training this process unguarded") from error
            if self.config.quarantines:
                self._empty_batch = bool(report.quarantined.all())
                report.metrics["empty_batch"] = float(self._empty_batch)
            if report.metrics["suspect"] > 0:
                records = self._publish_records(guarded, report, evidence, rewards, batch.get("advantages"))
        # the adapter's whole cost this step, up to handing the sinks' work to the writer (which is then cheap)
        report.metrics["overhead_seconds"] = time.perf_counter() - started
        for key in TRL_METRIC_KEYS:
            if key in report.metrics:
                trainer._metrics["train"][f"{TRL_METRIC_PREFIX}{key}"].append(report.metrics[key])
        view = guard_snapshot(self.guard) if self.is_main_process and self.sinks else self.guard
        if records:
            self._decode(records)
            self._to_sinks("on_records", records, view)
        self._to_sinks("on_step", report, view)
        if report.stop_training:
            self._stop(report)
        return guarded

    def _correction_rows(self, batch: dict[str, Any]) -> torch.Tensor | None:
        """When TRL's importance-sampling correction is on: this process's rows' (corrected tokens, loss tokens)
        (:func:`rollout_guard.outcomes.is_correction_rows`), NaN where they cannot be computed; they travel in the
        step's one gather (``row_extras``)."""
        trainer = self.trainer
        if not (trainer.use_vllm and getattr(trainer, "vllm_importance_sampling_correction", False)):
            return None
        try:
            return is_correction_rows(
                require(batch, "old_per_token_logps"), require(batch, "sampling_per_token_logps"), loss_mask_of(batch),
                trainer.vllm_importance_sampling_mode, trainer.vllm_importance_sampling_clip_min,
                trainer.vllm_importance_sampling_clip_max)
        except Exception as error:  # noqa: BLE001 - the rows travel as NaN: every process still joins the gather
            self._say_once("is-correction", f"rollout_guard: TRL's importance-sampling correction metrics are off "
                                            f"({type(error).__name__}: {error})")
            return torch.full((self.local_rows(), 2), math.nan, dtype=torch.float64)

    def _outcome_metrics(self, batch: dict[str, Any], report: StepReport, rewards: torch.Tensor | None) -> None:
        """Add the step's outcome metrics (:mod:`rollout_guard.outcomes`) to the report and the run's totals: the
        rewards of the suspect rows against the others, and, when TRL's importance-sampling correction is on, what it
        zeroes or clips next to the verdict (every process's rows, from the step's one gather)."""
        rows = report.row_extras
        if rows is not None and not bool(rows.isnan().any()):  # a host tensor
            report.metrics.update(is_correction_metrics(rows, report.suspect))
        group = self.settings.group_size
        if (rewards is not None and rewards.dim() == 2 and rewards.shape[0] == report.suspect.numel()
                and rewards.shape[0] % group == 0):
            total = (rewards * self.settings.reward_weights.to(rewards).unsqueeze(0)).nansum(dim=1)  # TRL's reward
            report.metrics.update(reward_metrics(total, group, report.suspect))
        self.guard.totals.add_outcomes(report.metrics)

    def _local_slice(self) -> slice:
        rows = self.local_rows()
        return slice(self.guard.process_index * rows, (self.guard.process_index + 1) * rows)

    def _replica_mismatch(self, report: StepReport) -> None:
        ranks = report.flagged_on(REPLICA_CHECK)
        message = replica_mismatch_message(ranks, report.step)
        if self.config.quarantines:
            raise GuardError(message)
        alert = self.guard.alerts.error("advantage_replica", report.step, float(len(ranks)), 0.0,
                                        "rollout_guard: TRL's advantages differ from the guard's replica at step "
                                        f"{report.step}",
                                        message + "; monitor mode: training goes on")
        if alert is not None:
            report.alerts.append(alert)
        self._say_once("replica-monitor", f"rollout_guard: {message}; monitor mode: training goes on")

    def _check_two_sided(self, report: StepReport) -> None:
        """Metric ``two_sided`` (1: every process's batch had engine and trainer logprobs; 0: some process judged on
        non-finite values only) and, when 0, an error alert naming the processes (``ONE_SIDED_CHECK`` in the
        step's gather: the same on every process)."""
        ranks = report.flagged_on(ONE_SIDED_CHECK)
        report.metrics["two_sided"] = 0.0 if ranks else 1.0
        if not ranks:
            return
        message = (f"the batch of step {report.step} on process(es) {ranks} lacked the engine's or the trainer's "
                   "logprobs although this setup compares both; those rollouts were checked for non-finite values "
                   "only (metric two_sided 0 on every such step)")
        alert = self.guard.alerts.error("one_sided", report.step, float(len(ranks)), 0.0,
                                        f"rollout_guard: step {report.step} judged one-sided", message)
        if alert is not None:
            report.alerts.append(alert)

    def _stop(self, report: StepReport) -> None:
        """The circuit breaker tripped (quarantine mode): stop after this step (``"stop"``: :meth:`close` raises at the
        end of training), or raise now, once everything is written (``"raise"``)."""
        self.stop_reason = report.stop_training
        if self.config.on_ceiling == "raise":
            self.close()  # records and metrics are written already; this writes the summary and the chart
            raise CircuitBreakerTripped(report.stop_training)

    def _publish_records(self, batch: dict[str, Any], report: StepReport, evidence: Any, rewards: torch.Tensor | None,
                         advantages_before: torch.Tensor | None) -> list:
        """Every suspect sample's record, on the main process (others get []): full evidence for the step's worst
        ``evidence_samples_per_step`` (chosen from the gathered report, so the same rows on every process),
        statistics only for the rest."""
        try:
            full_rows = set(worst_suspects(report.samples, report.reasons,
                                           self.config.evidence_samples_per_step).tolist())
            records = build_records(self.trainer, self.config, self.guard.process_index, batch, report, evidence,
                                    rewards,
                                    advantages_before, full_rows=full_rows, decode=False)
            add_context_to_records(records, self._engine_step)
        except Exception as error:
            self._failure("writing evidence records", error)
            records = []
        # every process calls this on the same steps (metrics are identical on all ranks)
        return self._gather_to_main(records)

    def _gather_to_main(self, records: list) -> list:
        """The records of all processes, in rank order, on the main process only (one ``gather_object`` to rank 0,
        not to every rank); a single process makes no collective call. The records are pickled before the gather: a
        process whose records cannot be pickled sends none (an output failure there) and still joins it."""
        world = self.trainer.accelerator.num_processes
        if world == 1:
            return records
        import torch.distributed as dist

        try:
            payload = pickle.dumps(records)
        except Exception as error:  # noqa: BLE001 - still join the gather
            self._failure("sending evidence records to the main process", error)
            payload = pickle.dumps([])
        parts: list | None = [None] * world if self.is_main_process else None
        dist.gather_object(payload, parts, dst=0)
        return [record for part in parts for record in pickle.loads(part)] if parts is not None else []

    def _decode(self, records: list) -> None:
        """Decode the records' tokens (main process), on the background writer before the sinks see them. The
        writer decodes with its own copy of the tokenizer: a fast tokenizer is not safe to use from two threads
        while the trainer pads a batch with it ("Already borrowed")."""
        if not self.is_main_process or not self.sinks:
            return
        if self._writer_tokenizer is None:
            tokenizer = self.trainer.processing_class
            try:
                self._writer_tokenizer = copy.deepcopy(tokenizer) if self.writer is not None else tokenizer
            except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is used here, on this thread
                self._writer_tokenizer = tokenizer
        tokenizer = self._writer_tokenizer
        if self.writer is not None and tokenizer is not self.trainer.processing_class:
            self.writer.submit("decoding evidence tokens", decode_records, records, tokenizer)
            return
        try:
            decode_records(records, tokenizer)
        except Exception as error:
            self._failure("decoding evidence tokens", error)

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
        strict mode, else counted in ``output_failures`` and logged."""
        if self.writer is None:
            return
        for what, error in self.writer.take_errors():
            self._failure(what, error)

    def _failure(self, what: str, error: BaseException) -> None:
        """A failure beside the verdict (records, decoding, sinks, the engine context): the step was judged; raised
        in strict mode, else counted in ``output_failures`` (this process's) and logged. With several processes a
        strict failure is held until the next step's gather carries it (``OUTPUT_CHECK``), after which every process
        raises together (:meth:`_raise_output_failure`): raised here, on one process (sinks run on the main one
        only), it left the others waiting in the loss's collectives. After the last step it is raised by
        :meth:`close`, on its own process."""
        if self.config.strict:
            if self.trainer.accelerator.num_processes == 1:
                raise error
            if self._output_failure is None:
                self._output_failure = (what, error)
            return
        self.guard.totals.output_failures += 1
        logger.warning("rollout_guard: failed while %s (%s: %s); the step was judged and training goes on. Output "
                       "failures so far: %s", what, type(error).__name__, error, self.guard.totals.output_failures)

    def _raise_output_failure(self, report: StepReport) -> None:
        """Strict mode: some process's outputs failed before this step (its ``OUTPUT_CHECK`` flag in the gather);
        every process raises here, the failing ones with their own error as the cause."""
        ranks = report.flagged_on(OUTPUT_CHECK)
        failure, self._output_failure = self._output_failure, None
        cause = f" ({failure[0]}: {type(failure[1]).__name__}: {failure[1]})" if failure is not None else ""
        raise GuardError(f"rollout_guard (strict=True): writing the guard's outputs failed on process(es) {ranks} "
                         f"before step {report.step}{cause}; stopping every process at this step") from (
            failure[1] if failure is not None else None)

    def _forward_rows(self, local: int) -> int:
        """Rows of this step's truncated-row pass on every process: the most truncated rows of any process (a
        sharded model, FSDP or ZeRO-3, needs every process in each forward call). One process: ``local``."""
        if not (self.judges_truncated and self.trl_trainer_logprobs):
            return 0
        accelerator = self.trainer.accelerator
        if accelerator.num_processes == 1:
            return local
        return int(accelerator.gather(torch.tensor([local], device=accelerator.device)).max())

    def _local_loss_tokens(self, batch: dict[str, Any]) -> torch.Tensor:
        """Loss tokens of each of this process's rows: the host work of :meth:`_loss_tokens`, done before the step's
        gather so that a failure here travels in it."""
        return loss_mask_of(batch).sum(dim=1).to(torch.float64 if self.guard.device.type != "mps" else torch.float32)

    def _loss_tokens(self, tokens: torch.Tensor | None) -> torch.Tensor | None:
        """Loss tokens of every row of the gathered batch from each process's :meth:`_local_loss_tokens`, when the
        judged mask is not the loss mask (None: it is, or ``tokens`` is None)."""
        if tokens is None:
            return None
        accelerator = self.trainer.accelerator
        return accelerator.gather(tokens.to(accelerator.device)) if accelerator.num_processes > 1 else tokens

    def _comparison(self, trainer: Any) -> tuple[str, ...]:
        """What the guard compares, handed to it each step as the sampling settings are: a change of either starts
        the detector's noise over (:meth:`RolloutGuard.inspect`), and both are saved with checkpoints, so that a run
        resumed on another basis (on the engine's support again after the hook failed, or no longer) does too."""
        return (*sampling_settings(trainer), f"on_engine_support={self.support is not None}")

    def _stop_comparing_on_support(self, report: StepReport) -> None:
        """The support hook failed on some process (its log Z was 0 there), which that process's flag in the step's
        gather says: the step was not judged (a failure, counted on every process), and from the next step every
        process compares off the support, the offset left to the detector's centres, its noise started over
        (:meth:`_comparison`: noise learned on the support would flag healthy rows off it). The same on every
        process: the ranks' flags are."""
        ranks = report.flagged_on(SUPPORT_CHECK)
        self.support, self._support_mass = None, None
        logger.warning("rollout_guard: the trainer's log-mass of the engine's support (compare_on_engine_support) "
                       "could not be computed on process(es) %s at step %s, which passed unguarded; from the next step "
                       "the guard compares off the support, its noise started over to learn the offset",
                       ranks, report.step)

    def _trainer_logprobs(self, batch: dict[str, Any], completion_attention: torch.Tensor,
                          rows: list[int] | None = None,
                          forward_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The trainer's logprobs of the sampled tokens: one no-grad forward pass over the batch (``rows`` None), or
        over the truncated ``rows`` only (padded to ``forward_rows`` with repeats), written into TRL's own; with
        the trainer's log-mass of the engine's support from the same pass (None when not compared on it)."""
        trainer = self.trainer
        input_ids = torch.cat([require(batch, "prompt_ids"), require(batch, "completion_ids")], dim=1)
        attention_mask = torch.cat([require(batch, "prompt_mask"), completion_attention], dim=1)
        width = batch["completion_ids"].size(1)
        if rows is not None:
            index = torch.tensor((rows or [0]) * (forward_rows // max(len(rows), 1) + 1),
                                 device=input_ids.device)[:forward_rows]
            input_ids, attention_mask = input_ids[index], attention_mask[index]
        started = time.perf_counter()
        capture = self.support.active() if self.support is not None else contextlib.nullcontext()
        with torch.no_grad(), _without_gradient_checkpointing(trainer), capture:
            logprobs, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, input_ids, attention_mask, width, batch_size=trainer.args.per_device_train_batch_size,
            )
        log_mass = self.support.first() if self.support is not None else None
        if rows is None:
            return logprobs, log_mass
        self.last_truncated_pass = {"rows": float(forward_rows), "tokens": float(attention_mask.sum()),
                                    "padded_tokens": float(attention_mask.numel()),
                                    "seconds": time.perf_counter() - started}
        merged = require(batch, "old_per_token_logps").clone()
        merged_mass = self._support_mass.clone() if self._support_mass is not None and log_mass is not None else None
        if rows:
            merged[index[: len(rows)]] = logprobs[: len(rows)].to(merged)
            if merged_mass is not None:
                merged_mass[index[: len(rows)]] = log_mass[: len(rows)].to(merged_mass)
        return merged, merged_mass

    # -- checkpoints -----------------------------------------------------------------------------------------

    def save_state(self, checkpoint_dir: str | Path, global_step: int | None = None) -> Path:
        """Write the guard's running state (totals, history, alert baselines) next to a TRL checkpoint, after the
        background writer has written everything of the steps before it."""
        self.flush()
        return checkpoint_state.save_state(self.guard, checkpoint_dir, global_step)

    def load_state(self, checkpoint_dir: str | Path) -> bool:
        """Restore the guard's state from a TRL checkpoint; the local files drop what the run wrote after that
        checkpoint (those steps run again), so a resumed run has one line per step. With several processes every
        one loads the main process's state (:meth:`_main_process_state`), so all resume in step."""
        state = self._main_process_state(checkpoint_dir) if self.trainer.accelerator.num_processes > 1 else None
        if self.trainer.accelerator.num_processes > 1 and state is None:
            return False
        state = checkpoint_state.load_state(self.guard, checkpoint_dir, state)
        if state is None:
            return False
        step = checkpoint_state.saved_step(state)
        self.flush()
        for sink in self.sinks if self.is_main_process else []:
            try:
                sink.on_resume(step, self.guard)
            except Exception as error:
                self._failure(f"{type(sink).__name__}.on_resume", error)
        return True

    def _main_process_state(self, checkpoint_dir: str | Path) -> dict | None:
        """The state the main process reads from its ``checkpoint_dir``, on every process (one
        ``broadcast_object_list`` from rank 0): only the main process writes it, and other nodes may not share its
        filesystem. A failure to read it there raises on every process."""
        import torch.distributed as dist

        payload: tuple[str, Any] | None = None
        if self.is_main_process:
            try:
                payload = ("state", checkpoint_state.read_state(checkpoint_dir))
            except Exception as error:  # noqa: BLE001 - every process must raise, not the main one alone
                payload = ("error", f"{type(error).__name__}: {error}")
        box = [payload]
        dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "error":
            raise GuardError(f"rollout_guard: reading the guard's state from the main process's checkpoint "
                             f"{checkpoint_dir} failed ({value}); stopping every process")
        return value

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
        if self._output_failure is not None:  # strict, several processes, after the last step's gather
            what, error = self._output_failure
            self._output_failure = None
            raise GuardError(f"rollout_guard (strict=True): writing the guard's outputs failed on process "
                             f"{self.guard.process_index} after the last step ({what}: {type(error).__name__}: "
                             f"{error})") from error
        if self.stop_reason is not None and self.config.on_ceiling == "stop":
            state = self.trainer.state
            raise CircuitBreakerTripped(f"{self.stop_reason} Training ended cleanly after step {state.global_step} of "
                                        f"{state.max_steps}, not as planned; the guard's records and summary are "
                                        "written.")

    def _say_once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.warning(message)


def trl_computes_trainer_logprobs(trainer: Any) -> bool:
    """Whether TRL puts ``old_per_token_logps`` in its batch (its own condition in
    ``_generate_and_score_completions``)."""
    args = trainer.args
    generate_every = args.steps_per_generation * getattr(trainer, "num_iterations", 1)
    return bool(args.gradient_accumulation_steps % generate_every != 0
                or (trainer.use_vllm and trainer.vllm_importance_sampling_correction))


def _without_gradient_checkpointing(trainer: Any) -> Any:
    """TRL's context for no-grad forward passes (no checkpointing warning); a null context where TRL lacks it."""
    try:
        from trl.models.utils import disable_gradient_checkpointing
    except ImportError:
        return contextlib.nullcontext()
    return disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs)


def _skip_next_step(optimizer: Any) -> None:
    """Make the optimizer's next ``step()`` call a no-op (parameters and optimizer state untouched), once."""
    own = optimizer.__dict__.get("step")

    def skipped(*args: Any, **kwargs: Any) -> None:
        if own is None:
            del optimizer.step
        else:
            optimizer.step = own

    optimizer.step = skipped


class _GuardCallback(TrainerCallback):
    def __init__(self, guarded: TrlGuard) -> None:
        self.guarded = guarded

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
        if self.guarded.stop_reason is not None:
            control.should_training_stop = True
        return control

    def on_pre_optimizer_step(self, args, state, control, **kwargs):  # noqa: ANN001
        if self.guarded.skip_empty_optimizer_step(state.global_step + 1):
            _skip_next_step(self.guarded.trainer.optimizer)
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
