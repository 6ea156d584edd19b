"""Pure transforms of the batch TRL builds: the guard's evidence in it, the quarantine action on it, and the
replica of TRL's advantage arithmetic the action relies on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rollout_guard.action import fill_rows, group_relative_advantages, loss_token_count, mask_quarantined
from rollout_guard.errors import GuardError, GuardInputError
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.guard import StepReport
from rollout_guard.integrations.trl_versions import describe_trl


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


# What a quarantined row's logprobs and importance-sampling ratio become: values that keep every term of every TRL
# loss finite for any logprob the trainer's forward pass can produce, so that the zeroed mask makes the row's
# contribution exactly 0 (NaN·0 is NaN). Old and sampling logprobs 0: TRL's ratio exp(logp − old) is then ≤ 1.
# Reference logprobs far below any logprob: TRL's k3 KL term exp(ref − logp) − (ref − logp) − 1 stays finite
# (a reference of 0 overflows exp() once logp < −88). IS ratio 1: no correction.
NEUTRAL_FILL = {"old_per_token_logps": 0.0, "sampling_per_token_logps": 0.0, "ref_per_token_logps": -1e4,
                "importance_sampling_ratio": 1.0}


def quarantine_batch(batch: dict[str, Any], report: StepReport, rewards_per_func: torch.Tensor, settings: GroupSettings) -> dict[str, Any]:
    """A copy of TRL's batch with the report's quarantined samples taken out of the loss.

    Zeroes their loss (completion) mask, recomputes the advantages of the whole gathered batch without them and
    keeps this process's slice, sets ``num_items_in_batch`` to the loss tokens left on all processes, and
    replaces their old, sampling and reference logprobs and importance-sampling ratio by neutral values
    (:data:`NEUTRAL_FILL`): TRL computes ``logp − old``, the ratio and the KL term before it applies the mask, so
    a NaN or ±inf left in a quarantined row would still reach the loss and the gradient.
    """
    batch = dict(batch)
    mask = require(batch, "completion_mask")
    normaliser = require(batch, "num_items_in_batch")
    advantages = require(batch, "advantages")
    rows = report.local_quarantined.to(mask.device)
    batch["completion_mask"] = mask_quarantined(mask, rows)
    batch["num_items_in_batch"] = loss_token_count(report.column("tokens"), report.quarantined).to(
        device=normaliser.device, dtype=normaliser.dtype
    )
    excluded = report.quarantined.to(rewards_per_func.device)
    batch["advantages"] = settings.advantages(rewards_per_func, excluded)[report.local_rows].to(advantages)
    for key, fill in NEUTRAL_FILL.items():
        if isinstance(batch.get(key), torch.Tensor):
            batch[key] = fill_rows(batch[key], rows.to(batch[key].device), fill)
    return batch


def check_action_inputs(batch: dict[str, Any], rewards: torch.Tensor | None, rows: int, settings: GroupSettings) -> None:
    """Raise (before the step's gather, so that every process then skips together) if this process could not
    carry out the quarantine action on this batch; afterwards the action is tensor arithmetic on checked inputs."""
    mask = require(batch, "completion_mask")
    require(batch, "num_items_in_batch")
    advantages = require(batch, "advantages")
    if mask.dim() != 2 or mask.shape[0] != rows or tuple(advantages.shape) != (rows,):
        raise GuardInputError("batch['advantages']", f"shape {tuple(advantages.shape)} for a completion_mask of shape "
                              f"{tuple(mask.shape)}; expected ({rows},)", f"use a TRL GRPOTrainer ({describe_trl()})")
    if rewards is None:
        raise GuardInputError("rewards", "TRL's _calculate_rewards was not called in this generation step",
                              f"use a TRL GRPOTrainer ({describe_trl()}), whose _generate_and_score_completions calls it")
    if rewards.dim() != 2 or rewards.shape[0] % settings.group_size or rewards.shape[1] != settings.reward_weights.numel():
        raise GuardInputError("rewards", f"shape {tuple(rewards.shape)}, expected (N, {settings.reward_weights.numel()}) "
                              f"with N a multiple of num_generations={settings.group_size}", f"use a TRL GRPOTrainer ({describe_trl()})")
    for key in NEUTRAL_FILL:
        value = batch.get(key)
        if value is not None and not (isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows):
            raise GuardInputError(f"batch['{key}']", f"not a tensor with {rows} rows", f"use a TRL GRPOTrainer ({describe_trl()})")


def replica_differs(batch: dict[str, Any], rewards: torch.Tensor, settings: GroupSettings, local_rows: slice) -> torch.Tensor:
    """Whether TRL's advantages on this process differ from the guard's replica of its arithmetic with nothing
    excluded: a 0-dim bool tensor on the batch's device (no host sync; it travels in the step's gather)."""
    advantages = require(batch, "advantages")
    replica = settings.advantages(rewards)[local_rows].to(advantages)
    return ~torch.isclose(replica, advantages, atol=1e-5, rtol=1e-4).all()


def replica_mismatch_message(ranks: list[int], step: int) -> str:
    return (f"TRL's advantages differ from rollout_guard's replica of its arithmetic at step {step} on process(es) "
            f"{ranks} ({describe_trl()}); re-normalising groups without quarantined samples would be "
            "wrong. Use a supported TRL or GuardConfig(mode='monitor')")
