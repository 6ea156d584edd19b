"""The step's packet: everything one process contributes to the guard's one gather, as one flat tensor.

Layout (float64; float32 on MPS, which has no float64), for a process with B rows and W = len(SAMPLE_COLUMNS):

====================  ==================================  =======================================================
offset                size                                what
====================  ==================================  =======================================================
0                     2                                   status (1 ok, 0 input error, −1 failure), check flag
2                     B·W                                 per-rollout statistics, row-major (:func:`summarise`)
2 + B·W               B                                   verdict bitmask per rollout over ``detector.RULES``
2 + B·(W+1)           NUM_DELTA_BINS                      |Δ| histogram of all compared tokens (counts)
…                     NUM_REGIONS·NUM_BINS                the kept rollouts' ``d`` histogram (the detector learns)
…                     3·NUM_REGIONS                       the noise judged against: centre, scale; its growth
…                     len(AGGREGATES)                     this process's share of the step's aggregates
====================  ==================================  =======================================================

The verdict travels in the packet: each process judges its own rows against the detector's state, which is the
same on every rank, so every rank reads the same gathered verdict, and the kept rows' histogram, summed over ranks,
is what every rank's detector learns (:meth:`rollout_guard.detector.Detector.update`). The step's aggregates are
sums and maxima over rollouts, so each process sends its own (:func:`partial_aggregates`, on the fused CUDA step
computed with the verdict) and the host only combines the processes' (:func:`combine_aggregates`).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from rollout_guard.detector import RULE_BIT, RULES
from rollout_guard.detector.fused import record_size
from rollout_guard.detector.noise import NUM_BINS
from rollout_guard.detector.score import NUM_REGIONS
from rollout_guard.statistics import COLUMN, NUM_DELTA_BINS, SAMPLE_COLUMNS, histogram_quantile

COUNTS_SIZE = NUM_REGIONS * NUM_BINS
NOISE_SIZE = 3 * NUM_REGIONS

_MEANS = (("mean_abs_delta", "compared_tokens"), ("kl_k3", "compared_tokens"),
          ("engine_mean_logprob", "engine_tokens"), ("trainer_mean_logprob", "trainer_tokens"))
"""Token-weighted means: (statistic, the tokens a rollout's value stands on)."""
_SUMS = ("tokens", "compared_tokens", "nonfinite_engine_tokens", "nonfinite_trainer_tokens")
_MAXIMA = ("max_abs_delta", "engine_max_logprob", "trainer_max_logprob")
AGGREGATES = (*_SUMS, *_MAXIMA, "max_score", "kept_max_abs_delta", "kept_max_score",
              *(f"{name}_num" for name, _ in _MEANS), *(f"{name}_den" for name, _ in _MEANS),
              *(f"rule/{name}" for name in RULES), "injected", "labelled", "suspect", "caught")
"""The step's aggregates (:func:`aggregate`), in the packet's order: each a sum over rollouts except the maxima
(:data:`MAXIMA_AT`)."""
_FIRST_MAXIMUM = len(_SUMS)
MAXIMA_AT = slice(_FIRST_MAXIMUM, _FIRST_MAXIMUM + len(_MAXIMA) + 3)
"""Where the maxima lie among :data:`AGGREGATES` (−inf without any rollout; NaN once combined)."""


class PacketLayout(NamedTuple):
    """Offsets into one process's packet (see the module docstring); :meth:`of` gives one computed once per batch
    size."""

    batch: int
    width: int
    samples: slice
    reasons: slice
    histogram: slice
    counts: slice
    noise: slice
    aggregates: slice
    size: int

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def of(batch: int) -> PacketLayout:
        width = len(SAMPLE_COLUMNS)
        samples = slice(2, 2 + batch * width)
        reasons = slice(samples.stop, samples.stop + batch)
        histogram = slice(reasons.stop, reasons.stop + NUM_DELTA_BINS)
        counts = slice(histogram.stop, histogram.stop + COUNTS_SIZE)
        noise = slice(counts.stop, counts.stop + NOISE_SIZE)
        aggregates = slice(noise.stop, noise.stop + len(AGGREGATES))
        return PacketLayout(batch, width, samples, reasons, histogram, counts, noise, aggregates, aggregates.stop)


assert all(record_size(batch) == PacketLayout.of(batch).size - 2 for batch in (1, 5))  # the fused step's record
assert all(RULE_BIT[name] == 1 << index for index, name in enumerate(RULES))


def packet_dtype(device: torch.device) -> torch.dtype:
    """float64 (counts exact to 2^53; float32 loses whole tokens above 2^24); float32 on MPS."""
    return torch.float32 if device.type == "mps" else torch.float64


def empty_packet(batch: int, status: float, device: torch.device) -> torch.Tensor:
    """A packet of zeros with ``status``: what a process that could not build its own sends."""
    packet = torch.zeros(PacketLayout.of(batch).size, dtype=packet_dtype(device), device=device)
    packet[0] = status
    return packet


def partial_aggregates(samples: torch.Tensor, reasons: torch.Tensor) -> torch.Tensor:
    """(len(AGGREGATES),) float64: one process's share of the step's aggregates, on ``samples``' device, no host
    sync: column sums, maxima over rollouts (−inf without any), ``kept_*`` maxima over the rollouts the verdict keeps,
    token-weighted means as sums of ``*_num``/``*_den``, and the rule, injected/labelled/suspect/caught counts.

    Args:
        samples: (N, len(SAMPLE_COLUMNS)) per-rollout statistics (NaN: no token to stand on).
        reasons: (N,) int verdict bitmask.
    """
    table = samples.double()
    column = {name: table[:, index] for name, index in COLUMN.items()}
    suspect = reasons != 0
    nan = torch.full_like(column["score"], math.nan)
    maxima = torch.stack([column["max_abs_delta"], column["engine_max_logprob"], column["trainer_max_logprob"],
                          column["score"], torch.where(suspect, nan, column["max_abs_delta"]),
                          torch.where(suspect, nan, column["score"])], dim=1)
    if table.shape[0]:
        top = maxima.nan_to_num(nan=-math.inf).amax(dim=0)
    else:
        top = torch.full((6,), -math.inf, dtype=table.dtype, device=table.device)
    tokens = column["tokens"]
    values = torch.stack([column[name] for name, _ in _MEANS], dim=1)
    weights = torch.stack([column["compared_tokens"], column["compared_tokens"],
                           tokens - column["nonfinite_engine_tokens"], tokens - column["nonfinite_trainer_tokens"]], 1)
    keep = ~torch.isnan(values) & (weights > 0)
    labelled = ~torch.isnan(column["injected"])
    injected = labelled & (column["injected"] == 1)
    bits = torch.arange(len(RULES), device=reasons.device)  # RULE_BIT: one bit per rule, in order
    counts = torch.cat([((reasons.long().unsqueeze(1) >> bits) & 1) != 0,
                        torch.stack([injected, labelled, suspect, injected & suspect], 1)], 1)
    return torch.cat([table[:, [COLUMN[name] for name in _SUMS]].sum(dim=0), top,
                      torch.where(keep, values * weights, 0.0).sum(dim=0), torch.where(keep, weights, 0.0).sum(dim=0),
                      counts.sum(dim=0).double()])


def combine_aggregates(parts: torch.Tensor) -> dict[str, float]:
    """The step's aggregates (:data:`AGGREGATES` → value; maxima NaN without any rollout) from every process's
    :func:`partial_aggregates`, (P, len(AGGREGATES)) on the host: sums of the sums, maxima of the maxima."""
    if parts.shape[0] == 1:
        flat = parts[0].tolist()
    else:
        flat = parts.sum(dim=0).tolist()
        flat[MAXIMA_AT] = parts[:, MAXIMA_AT].amax(dim=0).tolist()
    result = dict(zip(AGGREGATES, flat, strict=True))
    for name in AGGREGATES[MAXIMA_AT]:
        if result[name] == -math.inf:
            result[name] = math.nan
    return result


def aggregate(samples: torch.Tensor, reasons: torch.Tensor) -> dict[str, float]:
    """The step's aggregates over the rollouts of (N, len(SAMPLE_COLUMNS)) ``samples`` and (N,) ``reasons``
    (:func:`partial_aggregates`, :func:`combine_aggregates`).

    >>> samples = torch.full((2, len(SAMPLE_COLUMNS)), float("nan"), dtype=torch.float64)
    >>> samples[:, COLUMN["max_abs_delta"]] = torch.tensor([0.5, 9.0])
    >>> a = aggregate(samples, torch.tensor([0, 4]))
    >>> a["max_abs_delta"], a["kept_max_abs_delta"], a["suspect"]
    (9.0, 0.5, 1.0)
    """
    return combine_aggregates(partial_aggregates(samples, reasons).cpu().unsqueeze(0))


def step_metrics(aggregates: dict[str, float], samples: int, histogram: torch.Tensor | list[float],
                 quarantines: bool) -> dict[str, float]:
    """The per-step metrics from the step's :func:`aggregate`: token counts, maxima and token-weighted means, the |Δ|
    p99, suspect/quarantined counts and shares, rule counts and, when the batch is labelled by an injector,
    caught/missed/false alarms."""
    a = aggregates
    metrics = {"samples": float(samples)}
    for name in ("tokens", "compared_tokens", "nonfinite_engine_tokens", "nonfinite_trainer_tokens",
                 "max_abs_delta", "engine_max_logprob", "trainer_max_logprob", "max_score"):
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
    metrics["kept_max_score"] = a["kept_max_score"] if quarantines else a["max_score"]
    for name in RULES:
        metrics[f"rule/{name}"] = a[f"rule/{name}"]
    if labelled:
        metrics["caught"] = a["caught"]
        metrics["missed"] = a["injected"] - a["caught"]
        metrics["false_alarms"] = a["suspect"] - a["caught"]
    return metrics
