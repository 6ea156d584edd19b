"""The step's packet: everything one process contributes to the guard's one gather, as one flat tensor.

Layout (float64; float32 on MPS, which has no float64), for a process with B rows and W = len(SAMPLE_COLUMNS):

====================  ==================================  =======================================================
offset                size                                what
====================  ==================================  =======================================================
0                     2                                   status (1 ok, 0 input error, −1 failure), check flag
2                     B·W                                 per-sample statistics, row-major (:func:`summarise`)
2 + B·W               B                                   verdict bitmask per sample over ``verdict.RULES``
2 + B·(W+1)           NUM_DELTA_BINS                      |Δ| histogram of all compared tokens (counts)
…                     NUM_ENGINE_BUCKETS·CALIBRATION_WIDTH calibration contributions of the kept samples, summed
…                     1                                   kept samples
…                     len(AGGREGATES)                     step aggregates of this process's samples (sums, maxima)
====================  ==================================  =======================================================

The verdict travels in the packet: it is a pure function of a sample's row and of the calibration, which is the
same on every rank, so judging locally and judging after the gather agree, and the local verdict is what decides
which samples feed the calibration. Two builders produce the same packet: :func:`reference_packet` (pure torch,
any device) and :func:`rollout_guard.fused_statistics.fused_packet` (one Triton kernel, CUDA).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from rollout_guard.config import GuardConfig
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.statistics import (
    CALIBRATION_WIDTH, NUM_DELTA_BINS, NUM_ENGINE_BUCKETS, RowScaling, SAMPLE_COLUMNS, Thresholds, summarise,
)
from rollout_guard.statistics import COLUMN, histogram_quantile
from rollout_guard.verdict import RULE_BIT, RULES, judge

CALIBRATION_SIZE = NUM_ENGINE_BUCKETS * CALIBRATION_WIDTH

# Per-step aggregates each process adds up over its own samples, so that the host reads a few numbers per rank
# instead of reducing the whole sample table: (name, how ranks combine). ``*_num``/``*_den``: token-weighted means
# (a sample's mean weighs by the tokens it stands on; NaN means skipped). ``kept_max_abs_delta``: over samples the
# verdict keeps. ``caught``: samples labelled injected (1) and suspect.
_MEANS = (("mean_abs_delta", "compared_tokens"), ("kl_k3", "compared_tokens"),
          ("engine_mean_logprob", "engine_tokens"), ("trainer_mean_logprob", "trainer_tokens"))
AGGREGATES = (
    *((name, "sum") for name in ("tokens", "compared_tokens", "confident_wrong_tokens", "nonfinite_engine_tokens",
                                 "nonfinite_trainer_tokens")),
    *((name, "max") for name in ("max_abs_delta", "engine_max_logprob", "trainer_max_logprob", "kept_max_abs_delta")),
    *((f"{name}_{part}", "sum") for name, _ in _MEANS for part in ("num", "den")),
    ("injected", "sum"), ("labelled", "sum"), ("suspect", "sum"), ("caught", "sum"),
    *((f"rule/{name}", "sum") for name in RULES),
)
AGGREGATE = {name: index for index, (name, _) in enumerate(AGGREGATES)}
MAX_AGGREGATES = tuple(index for index, (_, how) in enumerate(AGGREGATES) if how == "max")
assert MAX_AGGREGATES == tuple(range(MAX_AGGREGATES[0], MAX_AGGREGATES[-1] + 1))


class PacketLayout(NamedTuple):
    """Offsets into one process's packet (see the module docstring)."""

    batch: int

    @property
    def width(self) -> int:
        return len(SAMPLE_COLUMNS)

    @property
    def samples(self) -> slice:
        return slice(2, 2 + self.batch * self.width)

    @property
    def reasons(self) -> slice:
        start = 2 + self.batch * self.width
        return slice(start, start + self.batch)

    @property
    def histogram(self) -> slice:
        start = 2 + self.batch * (self.width + 1)
        return slice(start, start + NUM_DELTA_BINS)

    @property
    def calibration(self) -> slice:
        start = 2 + self.batch * (self.width + 1) + NUM_DELTA_BINS
        return slice(start, start + CALIBRATION_SIZE)

    @property
    def kept_rows(self) -> int:
        return 2 + self.batch * (self.width + 1) + NUM_DELTA_BINS + CALIBRATION_SIZE

    @property
    def aggregates(self) -> slice:
        return slice(self.kept_rows + 1, self.kept_rows + 1 + len(AGGREGATES))

    @property
    def size(self) -> int:
        return self.aggregates.stop


def packet_dtype(device: torch.device) -> torch.dtype:
    """float64 (counts exact to 2^53; float32 loses whole tokens above 2^24); float32 on MPS."""
    return torch.float32 if device.type == "mps" else torch.float64


def empty_packet(batch: int, status: float, device: torch.device) -> torch.Tensor:
    """A packet of zeros with ``status``: what a process that could not build its own sends."""
    packet = torch.zeros(PacketLayout(batch).size, dtype=packet_dtype(device), device=device)
    packet[0] = status
    return packet


def aggregate_rows(samples: torch.Tensor, reasons: torch.Tensor) -> torch.Tensor:
    """The :data:`AGGREGATES` of one process's samples, (len(AGGREGATES),) float64 (float32 on MPS), on their device.

    Args:
        samples: (B, len(SAMPLE_COLUMNS)) per-sample statistics.
        reasons: (B,) verdict bitmask.

    >>> samples = torch.full((2, len(SAMPLE_COLUMNS)), float("nan"))
    >>> samples[:, COLUMN["max_abs_delta"]] = torch.tensor([0.5, 9.0])
    >>> a = aggregate_rows(samples, torch.tensor([0, 4]))
    >>> a[AGGREGATE["max_abs_delta"]].item(), a[AGGREGATE["kept_max_abs_delta"]].item(), a[AGGREGATE["suspect"]].item()
    (9.0, 0.5, 1.0)
    """
    dtype = packet_dtype(samples.device)
    table = samples.to(dtype)
    column = {name: table[:, index] for name, index in COLUMN.items()}
    column["engine_tokens"] = column["tokens"] - column["nonfinite_engine_tokens"]
    column["trainer_tokens"] = column["tokens"] - column["nonfinite_trainer_tokens"]
    suspect = reasons != 0
    column["kept_max_abs_delta"] = torch.where(suspect, math.nan, column["max_abs_delta"])
    for name, weight in _MEANS:
        keep = ~torch.isnan(column[name]) & (column[weight] > 0)
        column[f"{name}_num"] = torch.where(keep, column[name] * column[weight], 0.0)
        column[f"{name}_den"] = torch.where(keep, column[weight], 0.0)
    labelled = ~torch.isnan(column["injected"])
    column["labelled"] = labelled.to(dtype)
    column["injected"] = torch.where(labelled, column["injected"], 0.0)
    column["suspect"] = suspect.to(dtype)
    column["caught"] = ((column["injected"] == 1) & suspect).to(dtype)
    for name in RULES:
        column[f"rule/{name}"] = ((reasons & RULE_BIT[name]) != 0).to(dtype)
    stacked = torch.stack([column[name] for name, _ in AGGREGATES], dim=1)
    first, last = MAX_AGGREGATES[0], MAX_AGGREGATES[-1] + 1  # the maxima are contiguous
    sums = stacked.sum(dim=0)
    maxima = stacked[:, first:last].nan_to_num(nan=-math.inf)
    maxima = maxima.amax(dim=0) if stacked.shape[0] else torch.full_like(sums[first:last], -math.inf)
    return torch.cat([sums[:first], maxima, sums[last:]])


def combine_aggregates(per_rank: list[list[float]]) -> dict[str, float]:
    """Aggregates of every rank (host lists, rank order) → one dict: sums added, maxima maxed (−inf → NaN)."""
    combined = {}
    columns = list(zip(*per_rank)) if per_rank else [()] * len(AGGREGATES)
    for (name, how), values in zip(AGGREGATES, columns, strict=True):
        if how == "max":
            best = max(values) if values else -math.inf
            combined[name] = best if best != -math.inf else math.nan
        else:
            combined[name] = sum(values)
    return combined


def step_metrics(aggregates: dict[str, float], samples: int, histogram: torch.Tensor | list[float],
                 quarantines: bool) -> dict[str, float]:
    """The per-step metrics from the combined aggregates: what :func:`rollout_guard.statistics.step_aggregates`
    computes from the sample table, plus suspect/quarantined counts and shares, rule counts and, when the batch
    is labelled by an injector, caught/missed/false alarms."""
    a = aggregates
    metrics = {"samples": float(samples)}
    for name in ("tokens", "compared_tokens", "confident_wrong_tokens", "nonfinite_engine_tokens",
                 "nonfinite_trainer_tokens",
                 "max_abs_delta", "engine_max_logprob", "trainer_max_logprob"):
        metrics[name] = a[name]
    for name, _ in _MEANS:
        metrics[name] = a[f"{name}_num"] / a[f"{name}_den"] if a[f"{name}_den"] > 0 else math.nan
    metrics["p99_abs_delta"] = min(histogram_quantile(histogram, 0.99), a["max_abs_delta"])
    labelled = a["labelled"] > 0
    metrics["injected"] = a["injected"] if labelled else math.nan
    total = max(samples, 1)
    metrics["suspect"] = a["suspect"]
    metrics["quarantined"] = a["suspect"] if quarantines else 0.0
    metrics["suspect_share"] = metrics["suspect"] / total
    metrics["quarantined_share"] = metrics["quarantined"] / total
    metrics["kept_max_abs_delta"] = a["kept_max_abs_delta"] if quarantines else a["max_abs_delta"]
    for name in RULES:
        metrics[f"rule/{name}"] = a[f"rule/{name}"]
    if labelled:
        metrics["caught"] = a["caught"]
        metrics["missed"] = a["injected"] - a["caught"]
        metrics["false_alarms"] = a["suspect"] - a["caught"]
    return metrics


def reanchor(packet: torch.Tensor, layout: PacketLayout, shift: torch.Tensor) -> torch.Tensor:
    """Move the packet's calibration sums from the centres the batch was judged around to the calibration's own
    (in place; returns the packet): a kept token's ``clip(x)`` around a centre moved by ``s`` is, around the
    calibration's, ``clip(x) + s``, so per bucket

    .. math:: \\Sigma_1 \\leftarrow \\Sigma_1 + n\\,s,\\qquad \\Sigma_2 \\leftarrow \\Sigma_2 + 2s\\,\\Sigma_1 + n\\,s^2

    (``n`` kept tokens, ``Σ₁ = Σ clip(x)``, ``Σ₂ = Σ clip(x)²``; the histograms are left as they are: a bucket
    judged around the batch's own centre feeds only its centre and spread, see
    :func:`rollout_guard.statistics.batch_thresholds`).

    Args:
        packet: one process's packet.
        layout: its layout.
        shift: (NUM_ENGINE_BUCKETS,) nats, on the packet's device.

    >>> layout = PacketLayout(0); packet = torch.zeros(layout.size, dtype=torch.float64)
    >>> packet[layout.calibration.start : layout.calibration.start + 3] = torch.tensor([10.0, 1.0, 2.0])
    >>> reanchor(packet, layout, torch.tensor([0.5, 0.0, 0.0, 0.0]))[layout.calibration][:3].tolist()
    [10.0, 6.0, 5.5]
    """
    sums = packet[layout.calibration].view(NUM_ENGINE_BUCKETS, CALIBRATION_WIDTH)
    shift = shift.to(sums.dtype)
    tokens, first = sums[:, 0].clone(), sums[:, 1].clone()
    sums[:, 1] = first + tokens * shift
    sums[:, 2] = sums[:, 2] + 2 * shift * first + tokens * shift * shift
    return packet


def reference_packet(evidence: RolloutEvidence, config: GuardConfig, thresholds: Thresholds,
                     drift_threshold: float | None = None, scaling: RowScaling | None = None,
                     changepoint: torch.Tensor | None = None,
                     changepoint_threshold: float | None = None) -> torch.Tensor:
    """The packet from the pure-torch statistics (:func:`summarise`) and verdict (:func:`judge`), on the
    evidence's device; status 1 and check flag 0 (the caller sets the flag). ``drift_threshold``: the calibrated
    one in use (nats; default ``config.drift_threshold``); ``scaling``: each row's own spike threshold
    (:func:`rollout_guard.statistics.spike_per_row`); ``changepoint``: (B,) each row's change-point score and
    ``changepoint_threshold`` the rule's threshold (``None``: not judged)."""
    samples, histogram, contribution = summarise(evidence, config, thresholds, scaling, changepoint)
    verdict = judge(samples, config, drift_threshold, changepoint_threshold)
    dtype = packet_dtype(samples.device)
    exact = torch.float32 if samples.device.type == "mps" else torch.float64
    kept = ~verdict.suspect
    calibration = (contribution.to(exact) * kept.view(-1, 1, 1)).sum(dim=0).flatten()
    head = torch.ones(2, dtype=dtype, device=samples.device)
    head[1] = 0.0
    return torch.cat([head, samples.flatten().to(dtype), verdict.reasons.to(dtype), histogram.to(dtype),
                      calibration.to(dtype), kept.sum().view(1).to(dtype), aggregate_rows(samples, verdict.reasons)])
