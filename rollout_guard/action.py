"""Action: pure functions that take quarantined samples out of a GRPO batch before the loss.

A quarantined sample is (1) masked out of the loss, (2) excluded from its group's advantage baseline, exactly
as GRPO treats a sample whose reward is unknown, so that a corrupted sample's reward does not shift its
siblings' advantages, and (3) removed from the loss normaliser (the count of loss tokens).
"""

from __future__ import annotations

import torch

SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def mask_quarantined(mask: torch.Tensor, quarantined: torch.Tensor) -> torch.Tensor:
    """The (B, T) mask with every quarantined row zeroed; dtype and device kept."""
    return mask * (~quarantined.bool()).unsqueeze(-1).to(mask.dtype)


def fill_rows(values: torch.Tensor, rows: torch.Tensor, fill: float) -> torch.Tensor:
    """``values`` (B, …) with every selected row (``rows``: (B,) bool) set to ``fill``; dtype and device kept.

    >>> fill_rows(torch.tensor([[float("nan"), -1.0], [-0.5, -2.0]]), torch.tensor([True, False]), 0.0)
    tensor([[ 0.0000,  0.0000],
            [-0.5000, -2.0000]])
    """
    return values.masked_fill(rows.bool().view(-1, *([1] * (values.dim() - 1))), fill)


def loss_token_count(tokens_per_sample: torch.Tensor, quarantined: torch.Tensor) -> torch.Tensor:
    """Loss normaliser after quarantine: loss tokens of the samples that stay (summed over all processes when
    given the gathered per-sample counts)."""
    return (tokens_per_sample * (~quarantined.bool()).to(tokens_per_sample.dtype)).sum()


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected standard deviation ignoring NaN; NaN where fewer than two values remain."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance * correction)
    return std.squeeze() if dim is None else std.squeeze(dim)


def group_relative_advantages(
    rewards_per_func: torch.Tensor,
    reward_weights: torch.Tensor,
    group_size: int,
    excluded: torch.Tensor | None = None,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
    epsilon: float = 1e-4,
) -> torch.Tensor:
    """GRPO advantages over the whole (gathered) batch, with excluded samples left out of every baseline.

    ``rewards_per_func`` is (N, F) with NaN where a reward function gave no reward; groups are consecutive runs
    of ``group_size`` rows. Excluded rows, and rows with no reward at all, get advantage 0 and do not enter any
    group or batch statistic. The arithmetic matches TRL's GRPOTrainer (1.16) for the same settings.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}: use one of {SCALE_REWARDS}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}: use one of {AGGREGATIONS}")
    rewards_per_func = rewards_per_func.float()
    weights = reward_weights.to(rewards_per_func).unsqueeze(0)
    if excluded is not None:
        rewards_per_func = rewards_per_func.masked_fill(excluded.bool().unsqueeze(-1), float("nan"))
    unscorable = torch.isnan(rewards_per_func).all(dim=1)

    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights).nansum(dim=1).masked_fill(unscorable, float("nan"))
        grouped = rewards.view(-1, group_size)
        baseline = torch.nanmean(grouped, dim=1).repeat_interleave(group_size)
        if scale_rewards == "batch":
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        elif group_size > 1:
            std = nanstd(grouped, dim=1).repeat_interleave(group_size)
        else:
            std = torch.zeros_like(rewards)
        advantages = rewards - baseline
        if scale_rewards != "none":
            advantages = advantages / (std + epsilon)
    else:
        grouped = rewards_per_func.view(-1, group_size, rewards_per_func.shape[1])
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1).unsqueeze(1) if group_size > 1 else torch.zeros_like(mean_k)
        normalised = ((grouped - mean_k) / (std_k + epsilon)).view(-1, rewards_per_func.shape[1])
        rewards = (normalised * weights).nansum(dim=1).masked_fill(unscorable, float("nan"))
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = (rewards - torch.nanmean(rewards)) / (std + epsilon)
    return torch.nan_to_num(advantages, nan=0.0)
