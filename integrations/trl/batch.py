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
        return cls(trainer.reward_weights, trainer.num_generations, trainer.scale_rewards,
                   trainer.multi_objective_aggregation)

    def advantages(self, rewards_per_func: torch.Tensor, excluded: torch.Tensor | None = None) -> torch.Tensor:
        return group_relative_advantages(rewards_per_func, self.reward_weights, group_size=self.group_size,
                                         excluded=excluded,
                                         scale_rewards=self.scale_rewards, aggregation=self.aggregation)


def require(batch: dict[str, Any], key: str) -> torch.Tensor:
    value = batch.get(key)
    if not isinstance(value, torch.Tensor):
        problem = "missing" if value is None else f"a {type(value).__name__}, not a tensor"
        raise GuardInputError(f"batch['{key}']", f"{problem} in the batch TRL built",
                              f"use a TRL GRPOTrainer ({describe_trl()})")
    return value


def loss_mask_of(batch: dict[str, Any]) -> torch.Tensor:
    mask = require(batch, "completion_mask")
    return mask * batch["tool_mask"] if isinstance(batch.get("tool_mask"), torch.Tensor) else mask


def truncated_rows(completion_ids: list[list[int]], stop_ids: set[int]) -> list[int]:
    """Rows TRL masks out under ``mask_truncated_completions``: a completion whose last token is neither an EOS id nor
    the pad id (TRL's own test, on the token lists its ``_generate`` returns: host data, no device sync).

    >>> truncated_rows([[5, 6, 2], [5, 6, 7], [9]], stop_ids={2, 0})
    [1, 2]
    """
    return [row for row, ids in enumerate(completion_ids) if len(ids) and ids[-1] not in stop_ids]


def truncated_judged_mask(loss_mask: torch.Tensor, completion_mask: torch.Tensor, rows: list[int], lengths: list[int],
                          tool_masks: list[list[int]] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The judged mask and the completions' attention mask, (B, T) each, of a batch whose truncated ``rows`` TRL
    zeroed (its completion mask, hence attention, and its tool mask alike).

    On a truncated row TRL masked out, the judged mask is its first ``lengths[i]`` tokens times its tool mask
    (``tool_masks[i]``, TRL's before it zeroed the row; ``None``: no tool tokens), and the attention mask its first
    ``lengths[i]`` tokens (tool output is attended, not scored). Every other row keeps ``loss_mask`` and
    ``completion_mask``; so does a listed row that TRL did not mask (its loss mask is not all zero).

    >>> judged, attention = truncated_judged_mask(torch.tensor([[1, 1, 0], [0, 0, 0]]),
    ...                                           torch.tensor([[1, 1, 0], [0, 0, 0]]),
    ...                                           [1], [3], [[1, 1, 1], [0, 1, 1]])
    >>> judged.tolist(), attention.tolist()
    ([[1, 1, 0], [0, 1, 1]], [[1, 1, 0], [1, 1, 1]])
    """
    device, width = loss_mask.device, loss_mask.shape[1]
    index = torch.tensor(rows, dtype=torch.long, device=device)
    length = (torch.arange(width, device=device).unsqueeze(0) < torch.tensor(lengths, device=device).unsqueeze(1))
    tools = torch.ones(len(rows), width, dtype=loss_mask.dtype)
    if tool_masks is not None:
        for position, row in enumerate(rows):
            values = torch.tensor(tool_masks[row][:width], dtype=loss_mask.dtype)
            tools[position, : values.numel()] = values
    masked_by_trl = ((loss_mask[index].sum(dim=1, keepdim=True) == 0)
        & (completion_mask[index].sum(dim=1, keepdim=True) == 0))
    judged, attention = loss_mask.clone(), completion_mask.clone()
    judged[index] = torch.where(masked_by_trl, length.to(loss_mask.dtype) * tools.to(device), loss_mask[index])
    attention[index] = torch.where(masked_by_trl, length.to(completion_mask.dtype), completion_mask[index])
    return judged, attention


def evidence_of(batch: dict[str, Any], trainer_logprobs: torch.Tensor | None = None,
                injected: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> RolloutEvidence:
    """The guard's evidence in a TRL batch: vLLM's logprobs, TRL's trainer logprobs (or the given ones), and the
    judged mask: the loss mask, or the given ``mask`` (the loss mask plus the truncated rows TRL masked out)."""
    engine = batch.get("sampling_per_token_logps")
    trainer_logprobs = batch.get("old_per_token_logps") if trainer_logprobs is None else trainer_logprobs
    mask = loss_mask_of(batch) if mask is None else mask
    return RolloutEvidence(mask=mask, engine_logprobs=engine, trainer_logprobs=trainer_logprobs,
                           injected=None if injected is None else injected.to(mask.device))


# What a quarantined row's logprobs and importance-sampling ratio become: values that keep every term of every TRL
# loss finite for any logprob the trainer's forward pass can produce, so that the zeroed mask makes the row's
# contribution exactly 0 (NaN·0 is NaN). Old and sampling logprobs 0: TRL's ratio exp(logp − old) is then ≤ 1.
# Reference logprobs far below any logprob: TRL's k3 KL term exp(ref − logp) − (ref − logp) − 1 stays finite
# (a reference of 0 overflows exp() once logp < −88). IS ratio 1: no correction.
NEUTRAL_FILL = {"old_per_token_logps": 0.0, "sampling_per_token_logps": 0.0, "ref_per_token_logps": -1e4,
                "importance_sampling_ratio": 1.0}


def quarantine_batch(batch: dict[str, Any], report: StepReport, rewards_per_func: torch.Tensor, settings: GroupSettings,
                     loss_tokens: torch.Tensor | None = None) -> dict[str, Any]:
    """A copy of TRL's batch with the report's quarantined samples taken out of the loss.

    Zeroes their loss (completion) mask, recomputes the advantages of the whole gathered batch without them and
    keeps this process's slice, sets ``num_items_in_batch`` to the loss tokens left on all processes, and
    replaces their old, sampling and reference logprobs and importance-sampling ratio by neutral values
    (:data:`NEUTRAL_FILL`): TRL computes ``logp − old``, the ratio and the KL term before it applies the mask, so
    a NaN or ±inf left in a quarantined row would still reach the loss and the gradient.

    ``loss_tokens``: (N,) loss tokens of every row of the gathered batch, when the judged mask is not the loss mask
    (truncated rows judged, yet with no loss token); default: the report's ``tokens`` column (judged = loss mask).
    """
    batch = dict(batch)
    mask = require(batch, "completion_mask")
    normaliser = require(batch, "num_items_in_batch")
    advantages = require(batch, "advantages")
    rows = report.local_quarantined.to(mask.device)
    batch["completion_mask"] = mask_quarantined(mask, rows)
    tokens = report.column("tokens") if loss_tokens is None else loss_tokens.to(report.samples)
    batch["num_items_in_batch"] = loss_token_count(tokens, report.quarantined).to(
        device=normaliser.device, dtype=normaliser.dtype
    )
    excluded = report.quarantined.to(rewards_per_func.device)
    batch["advantages"] = settings.advantages(rewards_per_func, excluded)[report.local_rows].to(advantages)
    for key, fill in NEUTRAL_FILL.items():
        if isinstance(batch.get(key), torch.Tensor):
            batch[key] = fill_rows(batch[key], rows.to(batch[key].device), fill)
    return batch


def check_action_inputs(batch: dict[str, Any], rewards: torch.Tensor | None, rows: int,
                        settings: GroupSettings) -> None:
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
                              f"use a TRL GRPOTrainer ({describe_trl()}), "
                              "whose _generate_and_score_completions calls it")
    if (rewards.dim() != 2 or rewards.shape[0] % settings.group_size
            or rewards.shape[1] != settings.reward_weights.numel()):
        raise GuardInputError("rewards", f"shape {tuple(rewards.shape)}, expected "
                              f"(N, {settings.reward_weights.numel()}) "
                              f"with N a multiple of num_generations={settings.group_size}",
                              f"use a TRL GRPOTrainer ({describe_trl()})")
    for key in NEUTRAL_FILL:
        value = batch.get(key)
        if value is not None and not (isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows):
            raise GuardInputError(f"batch['{key}']", f"not a tensor with {rows} rows",
                                  f"use a TRL GRPOTrainer ({describe_trl()})")


def replica_differs(batch: dict[str, Any], rewards: torch.Tensor, settings: GroupSettings,
                    local_rows: slice) -> torch.Tensor:
    """Whether TRL's advantages on this process differ from the guard's replica of its arithmetic with nothing
    excluded: a 0-dim bool tensor on the batch's device (no host sync; it travels in the step's gather)."""
    advantages = require(batch, "advantages")
    replica = settings.advantages(rewards)[local_rows].to(advantages)
    return ~torch.isclose(replica, advantages, atol=1e-5, rtol=1e-4).all()


def replica_mismatch_message(ranks: list[int], step: int) -> str:
    return (f"TRL's advantages differ from rollout_guard's replica of its arithmetic at step {step} on process(es) "
            f"{ranks} ({describe_trl()}); re-normalising groups without quarantined samples would be "
            "wrong. Use a supported TRL or GuardConfig(mode='monitor')")
