"""verl's v1 trainers with the guard between the old-logprob pass and the advantages, registered with verl as
``guarded_sync``, ``guarded_colocate_async`` and ``guarded_separate_async`` (``trainer.v1.trainer_mode=...``).

:class:`GuardedTrainer` overrides four methods of verl 0.9's ``PPOTrainer``: ``__init__`` (the guard's settings are
checked before any worker starts), ``_compute_advantage`` (verl's own steps, with the guard's verdict and the
advantages computed without the rows it leaves out), ``_save_checkpoint``/``_load_checkpoint`` (the guard's state
in verl's ``global_step_N`` folder) and ``fit`` (the guard's summary and report at the end, also when training
raises). Importing this module imports verl.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from rollout_guard.extras import require_extra

require_extra("rollout_guard.integrations.verl.trainer", ("verl", "transfer_queue"), "verl")

from verl.trainer.ppo.v1 import (  # noqa: E402
    PPOTrainerColocateAsync, PPOTrainerSeparateAsync, PPOTrainerSync, register_trainer)
from verl.trainer.ppo.v1 import trainer_base as base  # noqa: E402 - the names verl's own _compute_advantage calls

from rollout_guard.integrations.verl.batch import advantages_without, neutral_rows, thin_groups  # noqa: E402
from rollout_guard.integrations.verl.guard import VerlGuard  # noqa: E402

FIELDS = ["uid", "response_mask", "rm_scores", "rollout_log_probs", "old_log_probs", "ref_log_prob", "values"]
"""What ``_compute_advantage`` reads from the TransferQueue: verl's own list."""

MIN_KEPT = {"grpo_passk": 2}
"""rows. verl's estimators that need more than one row per group: a group left with fewer is excluded whole."""


class GuardedTrainer:
    """Mixin before a verl v1 ``PPOTrainer`` subclass: the guard judges every batch before its advantages. Its
    settings come from the config's ``rollout_guard`` node (``+rollout_guard.mode=monitor``, …;
    :func:`rollout_guard.integrations.verl.guard.guard_config`)."""

    base_mode = "sync"
    """The verl trainer mode this one guards: verl reads its settings (``trainer.v1.<mode>``) and branches on it."""

    def __init__(self, config: Any) -> None:
        self.rollout_guard = VerlGuard(config)  # before verl builds anything: bad settings fail first
        from omegaconf import open_dict

        with open_dict(config):  # verl then runs as the mode it guards (replay buffer, refills, checkpoints)
            config.trainer.v1.trainer_mode = self.base_mode
        super().__init__(config)

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().fit(*args, **kwargs)
        finally:
            self.rollout_guard.close()

    def _guard_step(self) -> int:
        """The update this batch feeds, counted from 1: verl's global step, or with ``parameter_sync_step`` > 1 each
        of its local updates."""
        sync = int(getattr(self, "parameter_sync_step", 1) or 1)
        return (self.global_steps - 1) * sync + int(getattr(self, "local_trigger_step", 0)) + 1

    def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
        """verl's ``_compute_advantage`` with the guard's step between the rollout correction and the advantages:
        rows it leaves out get no vote in any baseline, advantages 0 and a zero ``response_mask``, written back."""
        config = self.config
        data = base.tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=FIELDS)
        response_mask = data["response_mask"]
        data = base.DataProto(batch=data.to_padded_tensor())
        data.batch["token_level_scores"] = data.batch["rm_scores"]
        data.non_tensor_batch["uid"] = np.array(data.batch.pop("uid").tolist(), dtype=object)

        if config.algorithm.use_kl_in_reward:
            data, kl_metrics = base.apply_kl_penalty(data, kl_ctrl=self.kl_ctrl_in_reward,
                                                     kl_penalty=config.algorithm.kl_penalty)
            metrics.update(kl_metrics)
        else:
            data.batch["token_level_rewards"] = data.batch["token_level_scores"]

        mask_before = data.batch["response_mask"].clone()
        correction_config = config.algorithm.get("rollout_correction", None)
        bypass = correction_config and correction_config.get("bypass_mode", False)
        rollout_correction = correction_config is not None and "rollout_log_probs" in data.batch and not bypass
        if rollout_correction:
            data, is_metrics = base.compute_rollout_correction_and_add_to_batch(data, correction_config)
            metrics.update(is_metrics)

        guard = self.rollout_guard
        excluded, report, evidence = guard.judge(data, mask_before, batch.keys, self._guard_step())
        suspect = bool(report.suspect.any()) and evidence is not None
        before = self._advantages(data, batch.keys, copy=True) if suspect and excluded.any() else None
        min_kept = _min_kept(config.algorithm.adv_estimator)
        if min_kept > 1 and excluded.any():
            excluded = thin_groups(excluded, list(data.non_tensor_batch["uid"]), min_kept)
        data = advantages_without(data, excluded, lambda part, kept: self._advantages(
            part, [batch.keys[i] for i in kept.tolist()]))
        metrics.update(guard.metrics(report))
        records = []
        if suspect:
            records = guard.records(report, evidence, self._tokens(batch, guard.full_rows(report)),
                                    rewards=data.batch["token_level_scores"].sum(-1).float(),
                                    advantages_before=_first(before, mask_before) if before is not None else
                                    _first(data, mask_before),
                                    advantages_after=_first(data, mask_before),
                                    tokenizer=getattr(self, "tokenizer", None))

        fields = ["advantages", "returns"]
        if config.algorithm.use_kl_in_reward:
            fields.append("token_level_rewards")
        if rollout_correction or excluded.any():
            fields.append("response_mask")
        if rollout_correction and "rollout_is_weights" in data.batch:
            fields.append("rollout_is_weights")
        if excluded.any():  # left-out rows: finite zeros wherever the actor's loss reads them
            fields.extend(key for key in neutral_rows(data, excluded) if key not in fields)
        output = base.TensorDict({field: base.response_to_nested(data.batch[field], response_mask) for field in fields},
                                 batch_size=len(batch))
        batch = base.tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=output)
        guard.publish(report, records)
        return batch

    def _advantages(self, data: Any, keys: list[str], copy: bool = False) -> Any:
        """verl's advantage function on ``data`` (its rows' TransferQueue ``keys``); with ``copy``, on a copy of every
        row (what verl alone would have computed, for the records)."""
        algorithm = self.config.algorithm
        if copy:
            data = data.select_idxs(torch.arange(len(data)))
        return base.compute_advantage_for_multi_trajectories(
            data, batch_keys=keys, adv_estimator=algorithm.adv_estimator, gamma=algorithm.gamma, lam=algorithm.lam,
            num_repeat=self.config.actor_rollout_ref.rollout.n,
            norm_adv_by_std_in_grpo=algorithm.get("norm_adv_by_std_in_grpo", True), config=algorithm,
        )

    def _tokens(self, batch: Any, rows: list[int]) -> dict[int, tuple[list[int], list[int]]]:
        """Prompt and response token ids of ``rows`` (one TransferQueue read of those rows only)."""
        if not rows:
            return {}
        keys = [batch.keys[row] for row in rows]
        try:
            data = base.tq.kv_batch_get(keys=keys, partition_id=batch.partition_id,
                                        select_fields=["prompts", "responses"])
            prompts, responses = _rows(data["prompts"]), _rows(data["responses"])
        except Exception as error:  # noqa: BLE001 - the records keep their statistics
            self.rollout_guard.output_failure("reading evidence tokens", error)
            return {}
        return {row: (prompts[i], responses[i]) for i, row in enumerate(rows)}

    def _save_checkpoint(self) -> None:
        super()._save_checkpoint()
        folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        self.rollout_guard.save(folder, self.global_steps)

    def _load_checkpoint(self) -> None:
        super()._load_checkpoint()
        if self.global_steps <= 0:
            return
        trainer = self.config.trainer
        if trainer.resume_mode == "resume_path":
            folder = trainer.resume_from_path
        else:
            folder = os.path.join(trainer.default_local_dir, f"global_step_{self.global_steps}")
        self.rollout_guard.resume(os.path.abspath(folder))


def _min_kept(estimator: Any) -> int:
    return MIN_KEPT.get(str(getattr(estimator, "value", estimator)), 1)


def _rows(values: Any) -> list[list[int]]:
    """Token ids per row of a TransferQueue field (a jagged nested tensor or a padded one)."""
    if getattr(values, "is_nested", False):
        return [row.tolist() for row in values.unbind()]
    return [row.tolist() for row in values]


def _first(data: Any, mask: torch.Tensor) -> torch.Tensor:
    """Each row's advantage at its first response token, (B,) (outcome estimators give one value per row)."""
    first = mask.float().argmax(dim=-1)
    return data.batch["advantages"].gather(1, first.view(-1, 1)).flatten().float()


@register_trainer("guarded_sync")
class GuardedSyncTrainer(GuardedTrainer, PPOTrainerSync):
    """verl's ``sync`` trainer with the guard."""

    base_mode = "sync"


@register_trainer("guarded_colocate_async")
class GuardedColocateAsyncTrainer(GuardedTrainer, PPOTrainerColocateAsync):
    """verl's ``colocate_async`` trainer with the guard."""

    base_mode = "colocate_async"


@register_trainer("guarded_separate_async")
class GuardedSeparateAsyncTrainer(GuardedTrainer, PPOTrainerSeparateAsync):
    """verl's ``separate_async`` trainer with the guard."""

    base_mode = "separate_async"


__all__ = ["FIELDS", "GuardedColocateAsyncTrainer", "GuardedSeparateAsyncTrainer",
           "GuardedSyncTrainer", "GuardedTrainer"]
