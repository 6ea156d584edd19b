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
…                     len(AGGREGATES)                     step aggregates of this process's rollouts
====================  ==================================  =======================================================

The verdict travels in the packet: each process judges its own rows against the detector's state, which is the
same on every rank, so every rank reads the same gathered verdict, and the kept rows' histogram, summed over ranks,
is what every rank's detector learns (:meth:`rollout_guard.detector.Detector.update`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from rollout_guard.detector import RULE_BIT, RULES
from rollout_guard.detector.noise import NUM_BINS
from rollout_guard.detector.score import NUM_REGIONS
from rollout_guard.statistics import COLUMN, NUM_DELTA_BINS, SAMPLE_COLUMNS, histogram_quantile

COUNTS_SIZE = NUM_REGIONS * NUM_BINS
NOISE_SIZE = 3 * NUM_REGIONS

# Per-step aggregates each process adds up over its own rollouts, so that the host reads a few numbers per rank
# instead of reducing the whole table: (name, how ranks combine). ``*_num``/``*_den``: token-weighted means (a
# rollout's mean weighs by the tokens it stands on; NaN means skipped). ``kept_*``: over rollouts the verdict keeps.
# ``caught``: rollouts labelled injected (1) and suspect.
_MEANS = (("mean_abs_delta", "compared_tokens"), ("kl_k3", "compared_tokens"),
          ("engine_mean_logprob", "engine_tokens"), ("trainer_mean_logprob", "trainer_tokens"))
AGGREGATES = (
    *((name, "sum") for name in ("tokens", "compared_tokens", "nonfinite_engine_tokens", "nonfinite_trainer_tokens")),
    *((name, "max") for name in ("max_abs_delta", "engine_max_logprob", "trainer_max_logprob", "kept_max_abs_delta",
                                 "max_score", "kept_max_score")),
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
        start = self.samples.stop
        return slice(start, start + self.batch)

    @property
    def histogram(self) -> slice:
        return slice(self.reasons.stop, self.reasons.stop + NUM_DELTA_BINS)

    @property
    def counts(self) -> slice:
        return slice(self.histogram.stop, self.histogram.stop + COUNTS_SIZE)

    @property
    def noise(self) -> slice:
        return slice(self.counts.stop, self.counts.stop + NOISE_SIZE)

    @property
    def aggregates(self) -> slice:
        return slice(self.noise.stop, self.noise.stop + len(AGGREGATES))

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
    """The :data:`AGGREGATES` of one process's rollouts, (len(AGGREGATES),) float64 (float32 on MPS), on their device.

    Args:
        samples: (B, len(SAMPLE_COLUMNS)) per-rollout statistics.
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
    column["max_score"] = column["score"]
    column["kept_max_score"] = torch.where(suspect, math.nan, column["score"])
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
    maxima = stacked[:, first:last].nan_to_num(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
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
    """The per-step metrics from the combined aggregates: token counts, maxima and token-weighted means, the |Δ|
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
