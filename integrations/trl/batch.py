"""Pure transforms of the batch TRL builds: the guard's evidence in it, the quarantine action on it, and the
replica of TRL's advantage arithmetic the action relies on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rollout_guard.action import group_relative_advantages, loss_token_count, mask_quarantined
from rollout_guard.errors import GuardError, GuardInputError
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.guard import StepReport
from rollout_guard.integrations.trl.versions import version


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
        raise GuardInputError(f"batch['{key}']", f"{problem} in the batch TRL built", "use trl 1.16 (GRPOTrainer)")
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


def check_advantage_replica(batch: dict[str, Any], report: StepReport, rewards: torch.Tensor, settings: GroupSettings) -> None:
    """With nothing excluded, the guard's advantage arithmetic must reproduce TRL's. A mismatch means this TRL
    computes advantages differently: re-normalising groups would be wrong, so it raises in every mode."""
    advantages = require(batch, "advantages")
    replica = settings.advantages(rewards)[report.local_rows].to(advantages)
    if not torch.allclose(replica, advantages, atol=1e-5, rtol=1e-4):
        raise GuardError(
            "TRL's advantages differ from rollout_guard's replica of its arithmetic (installed trl "
            f"{version('trl')}); re-normalising groups without quarantined samples would be wrong. "
            "Use trl 1.16 or GuardConfig(mode='monitor')"
        )
