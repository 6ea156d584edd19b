"""What the verdict did to a step, next to what else acts on the same rows: the trainer's own importance-sampling
correction (TRL's ``vllm_importance_sampling_mode``) and the rewards of the rows the guard flags.

Pure tensor functions; the adapters call them with the batch they already hold. Metric names are the keys of the
returned dicts (per step; counts are rows or tokens, shares are 0–1, rewards are in the reward's own unit).
"""

from __future__ import annotations

import math

import torch

IS_MODES = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate")
"""TRL's importance-sampling correction modes: ``*_mask`` zeroes the ratio outside [clip_min, clip_max],
``*_truncate`` clamps it into that range; ``sequence_*`` per row (the product of the token ratios), ``token_*`` per
token."""

CORRECTION_COLUMNS = ("corrected_tokens", "loss_tokens")
"""Per row, what :func:`is_correction_rows` returns: loss tokens whose importance-sampling ratio the correction
zeroes or clips, and loss tokens."""


def is_correction_rows(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor,
                       mode: str = "sequence_mask", clip_min: float | None = None,
                       clip_max: float | None = 3.0) -> torch.Tensor:
    """(B, 2) float64 per row: :data:`CORRECTION_COLUMNS`, for TRL's importance-sampling correction of the batch.

    TRL's arithmetic (``GRPOTrainer._generate_and_score_completions``): ``d = (trainer − engine)·mask`` in nats,
    NaN set to 0 (a NaN engine logprob counts as a perfect match), summed over the row in ``sequence_*`` modes;
    ratio ``exp(d)``; a ratio outside [``clip_min``, ``clip_max``] (``None``: no bound) is zeroed (``*_mask``) or
    clamped (``*_truncate``). A row's ratio acts on every loss token of the row. No host sync.

    >>> trainer = torch.tensor([[-0.1, -0.2], [-0.1, -0.2], [-0.1, -0.2]])
    >>> engine = torch.tensor([[-0.1, -0.2], [-1.5, -0.2], [-0.1, float("nan")]])
    >>> is_correction_rows(trainer, engine, torch.ones(3, 2)).tolist()  # row 1: ratio e^1.4 ≈ 4.1 > 3
    [[0.0, 2.0], [2.0, 2.0], [0.0, 2.0]]
    """
    if mode not in IS_MODES:
        raise ValueError(f"vllm_importance_sampling_mode={mode!r}: use one of {IS_MODES}")
    loss = mask.to(torch.float64)
    diff = torch.nan_to_num((trainer_logprobs.double() - engine_logprobs.double()) * loss, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    # clamp and mask act on the same ratios: those outside the bounds (a clamp leaves the others as they are)
    corrected = ((ratio < low) | (ratio > high)).expand_as(loss) & (loss != 0)
    return torch.stack([corrected.sum(dim=-1).double(), loss.sum(dim=-1)], dim=-1)


def is_correction_metrics(rows: torch.Tensor, suspect: torch.Tensor) -> dict[str, float]:
    """The step's ``trl_is/*`` metrics from every row's :func:`is_correction_rows` (the global batch) and the guard's
    verdict (``suspect``, (N,) bool). A row is *corrected* when the correction zeroes or clips the ratio of at least
    one of its loss tokens.

    ``trl_is/rows`` (rows judged), ``trl_is/corrected_rows`` and ``trl_is/corrected_row_share`` (of the rows), ``trl_is/corrected_tokens`` and
    ``trl_is/corrected_token_share`` (of the loss tokens), ``trl_is/loss_tokens``; the overlap with the guard, in
    rows: ``trl_is/both`` (corrected and suspect), ``trl_is/only_trl``, ``trl_is/only_guard``.

    >>> rows = torch.tensor([[2.0, 2.0], [0.0, 3.0], [1.0, 4.0], [0.0, 1.0]])
    >>> m = is_correction_metrics(rows, torch.tensor([True, True, False, False]))
    >>> m["trl_is/both"], m["trl_is/only_trl"], m["trl_is/only_guard"], m["trl_is/corrected_token_share"]
    (1.0, 1.0, 1.0, 0.3)
    """
    rows = rows.double().cpu()
    suspect = suspect.bool().cpu()
    corrected = rows[:, 0] > 0
    tokens, loss_tokens = float(rows[:, 0].sum()), float(rows[:, 1].sum())
    return {
        "trl_is/rows": float(rows.shape[0]),
        "trl_is/corrected_rows": float(corrected.sum()),
        "trl_is/corrected_row_share": float(corrected.sum()) / max(rows.shape[0], 1),
        "trl_is/corrected_tokens": tokens,
        "trl_is/loss_tokens": loss_tokens,
        "trl_is/corrected_token_share": tokens / loss_tokens if loss_tokens > 0 else math.nan,
        "trl_is/both": float((corrected & suspect).sum()),
        "trl_is/only_trl": float((corrected & ~suspect).sum()),
        "trl_is/only_guard": float((~corrected & suspect).sum()),
    }


def reward_metrics(rewards: torch.Tensor, group_size: int, suspect: torch.Tensor) -> dict[str, float]:
    """The step's ``reward/*`` metrics: did the verdict remove good rows? ``rewards``: (N,) each row's total reward
    (the global batch, groups of ``group_size`` consecutive rows, as the advantages are computed); ``suspect``:
    (N,) the guard's verdict (the quarantined rows, in quarantine mode).

    ``reward/suspect_mean`` and ``reward/not_suspect_mean`` (NaN without such rows), and
    ``reward/suspect_above_group_median``: the share of suspect rows whose reward is above the median of their
    whole group (suspect rows included; NaN without suspect rows).

    >>> m = reward_metrics(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]), 4,
    ...                    torch.tensor([True, False, False, False, False, False, True, False]))
    >>> m["reward/suspect_mean"], m["reward/not_suspect_mean"], m["reward/suspect_above_group_median"]
    (0.5, 0.5, 0.5)
    """
    rewards = rewards.double().cpu().flatten()
    suspect = suspect.bool().cpu().flatten()
    if rewards.numel() != suspect.numel() or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of {rewards.numel()} rows, verdicts of {suspect.numel()}, groups of {group_size}: "
                         "pass one reward and one verdict per row, whole groups")
    median = torch.quantile(rewards.view(-1, group_size), 0.5, dim=1).repeat_interleave(group_size)
    count = int(suspect.sum())

    def mean(where: torch.Tensor) -> float:
        return float(rewards[where].mean()) if bool(where.any()) else math.nan

    return {
        "reward/suspect_mean": mean(suspect),
        "reward/not_suspect_mean": mean(~suspect),
        "reward/suspect_above_group_median": float((rewards > median)[suspect].sum()) / count if count else math.nan,
    }


SUMMED = ("trl_is/corrected_rows", "trl_is/corrected_tokens", "trl_is/loss_tokens", "trl_is/both", "trl_is/only_trl",
          "trl_is/only_guard", "trl_is/rows")
"""Per-step counts a run's totals add up (:meth:`rollout_guard.guard.GuardTotals.add_outcomes`)."""


def outcome_sums(metrics: dict[str, float]) -> dict[str, float]:
    """The counts of one step's metrics that a run's totals add up: :data:`SUMMED` (``trl_is/rows``: the rows the
    correction metrics cover) and, from the ``reward/*`` means, the reward sums and row counts behind them
    (``reward/suspect_sum``, ``reward/suspect_rows``, ``reward/not_suspect_sum``, ``reward/not_suspect_rows``,
    ``reward/suspect_above_group_median_rows``). Empty for a step without these metrics."""
    sums = {key: metrics[key] for key in SUMMED if key in metrics}
    if "reward/suspect_mean" in metrics:
        suspect, rows = metrics.get("suspect", 0.0), metrics.get("samples", 0.0)
        for side, count in (("suspect", suspect), ("not_suspect", rows - suspect)):
            value = metrics[f"reward/{side}_mean"]
            sums[f"reward/{side}_rows"] = count if math.isfinite(value) else 0.0
            sums[f"reward/{side}_sum"] = value * count if math.isfinite(value) else 0.0
        above = metrics["reward/suspect_above_group_median"]
        sums["reward/suspect_above_group_median_rows"] = above * suspect if math.isfinite(above) else 0.0
    return sums


def outcome_lines(sums: dict[str, float]) -> list[str]:
    """The console summary's lines for a run's :func:`outcome_sums` totals (none without them)."""
    lines = []
    rows = sums.get("trl_is/rows", 0.0)
    if rows:
        loss = sums.get("trl_is/loss_tokens", 0.0)
        lines.append(
            f"  TRL's importance-sampling correction zeroed or clipped {int(sums['trl_is/corrected_rows'])} of "
            f"{int(rows)} rollouts ({sums['trl_is/corrected_rows'] / rows:.2%}), "
            f"{sums['trl_is/corrected_tokens'] / loss if loss else math.nan:.2%} of loss tokens; "
            f"both it and the guard: {int(sums['trl_is/both'])}, only TRL: {int(sums['trl_is/only_trl'])}, "
            f"only the guard: {int(sums['trl_is/only_guard'])}")
    suspect = sums.get("reward/suspect_rows", 0.0)
    if suspect:
        kept = sums.get("reward/not_suspect_rows", 0.0)
        kept_mean = sums["reward/not_suspect_sum"] / kept if kept else math.nan
        lines.append(
            f"  reward: suspect rollouts {sums['reward/suspect_sum'] / suspect:.3g} on average, the others "
            f"{kept_mean:.3g}; {sums['reward/suspect_above_group_median_rows'] / suspect:.0%} of the suspect "
            "ones above their group's median")
    return lines
