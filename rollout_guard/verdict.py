"""Verdict: which samples are suspect, and which rules fired (a bitmask per sample).

Pure and vectorised over the per-sample statistics. A statistic that is NaN (no token to stand on) never fires
a threshold rule. The verdict does not depend on the mode: the mode decides what is done with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from rollout_guard.config import GuardConfig
from rollout_guard.statistics import COLUMN

RULES = ("nonfinite_engine", "nonfinite_trainer", "token_spike", "mean_drift", "confident_wrong", "directional_spike",
         "drift", "changepoint")
RULE_BIT = {name: 1 << index for index, name in enumerate(RULES)}


class Verdict(NamedTuple):
    suspect: torch.Tensor  # (N,) bool
    reasons: torch.Tensor  # (N,) int32 bitmask over RULES


def rule_firings(samples: torch.Tensor, config: GuardConfig, drift_threshold: float | torch.Tensor | None = None,
                 changepoint_threshold: float | torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """(N,) bool per enabled rule. ``drift_threshold``: the drift threshold in use (nats; a number or one per
    sample), i.e. the calibrated one (:meth:`rollout_guard.calibration.Calibration.drift_threshold_value`);
    default ``config.drift_threshold``. ``changepoint_threshold``: the ``changepoint`` rule's in use (ln Λ; a
    number or one per sample, +inf or ``None`` where it does not judge:
    :meth:`rollout_guard.calibration.Calibration.changepoint_threshold_value`)."""
    column = {name: samples[:, index] for name, index in COLUMN.items()}
    firings: dict[str, torch.Tensor] = {}
    if config.nonfinite_engine_tokens is not None:
        firings["nonfinite_engine"] = column["nonfinite_engine_tokens"] >= config.nonfinite_engine_tokens
    if config.nonfinite_trainer_tokens is not None:
        firings["nonfinite_trainer"] = column["nonfinite_trainer_tokens"] >= config.nonfinite_trainer_tokens
    if config.spike_delta is not None:
        firings["token_spike"] = column["max_abs_delta"] > config.spike_delta
    if config.mean_delta is not None:
        firings["mean_drift"] = column["mean_abs_delta"] > config.mean_delta
    if config.confident_wrong_tokens is not None:
        firings["confident_wrong"] = column["confident_wrong_tokens"] >= config.confident_wrong_tokens
    if config.spike_excess is not None:
        firings["directional_spike"] = column["spike_margin"] > 0
    if config.drift_threshold is not None:
        threshold = drift_threshold if drift_threshold is not None else config.drift_threshold
        firings["drift"] = column["drift_cusum"] > threshold
        if config.joint_drift_limit is not None:  # both near: NaN margins never fire
            joint = column["spike_margin"] + config.joint_drift_weight * (column["drift_cusum"] - threshold)
            firings["drift"] |= joint > config.joint_drift_limit
    if config.changepoint_budget is not None and changepoint_threshold is not None:  # NaN, −inf never fire
        firings["changepoint"] = column["changepoint_score"] > changepoint_threshold
    return firings


def judge(samples: torch.Tensor, config: GuardConfig, drift_threshold: float | torch.Tensor | None = None,
          changepoint_threshold: float | torch.Tensor | None = None) -> Verdict:
    """The verdict of every sample (the thresholds: as :func:`rule_firings`)."""
    reasons = torch.zeros(samples.shape[0], dtype=torch.int32, device=samples.device)
    for name, fired in rule_firings(samples, config, drift_threshold, changepoint_threshold).items():
        reasons |= fired.to(torch.int32) * RULE_BIT[name]
    return Verdict(suspect=reasons != 0, reasons=reasons)


def rule_names(reasons: int) -> list[str]:
    return [name for name in RULES if reasons & RULE_BIT[name]]


def fired_rules(counts: Mapping[str, int]) -> str:
    """The rules that fired, most samples first (ties in :data:`RULES` order), each with its count; ``"none"``.

    >>> fired_rules({"drift": 1, "changepoint": 0, "mean_drift": 3, "token_spike": 1})
    'mean_drift 3, token_spike 1, drift 1'
    >>> fired_rules({"drift": 0})
    'none'
    """
    fired = sorted(((name, int(count)) for name, count in counts.items() if count),
                   key=lambda item: (-item[1], RULES.index(item[0]) if item[0] in RULES else len(RULES)))
    return ", ".join(f"{name} {count}" for name, count in fired) or "none"


def rule_counts(reasons: torch.Tensor) -> dict[str, int]:
    """How many samples each rule fired on (a sample can count under several rules)."""
    bits = torch.tensor([RULE_BIT[name] for name in RULES], dtype=reasons.dtype, device=reasons.device)
    counts = ((reasons.unsqueeze(-1) & bits) != 0).sum(dim=0)
    return dict(zip(RULES, counts.tolist(), strict=True))
