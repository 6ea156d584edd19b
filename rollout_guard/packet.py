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
====================  ==================================  =======================================================

The verdict travels in the packet: it is a pure function of a sample's row and of the calibration, which is the
same on every rank, so judging locally and judging after the gather agree, and the local verdict is what decides
which samples feed the calibration. Two builders produce the same packet: :func:`reference_packet` (pure torch,
any device) and :func:`rollout_guard.fused_statistics.fused_packet` (one Triton kernel, CUDA).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rollout_guard.config import GuardConfig
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.statistics import (
    CALIBRATION_WIDTH, NUM_DELTA_BINS, NUM_ENGINE_BUCKETS, SAMPLE_COLUMNS, Thresholds, summarise,
)
from rollout_guard.verdict import judge

CALIBRATION_SIZE = NUM_ENGINE_BUCKETS * CALIBRATION_WIDTH


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
    def size(self) -> int:
        return self.kept_rows + 1


def packet_dtype(device: torch.device) -> torch.dtype:
    """float64 (counts exact to 2^53; float32 loses whole tokens above 2^24); float32 on MPS."""
    return torch.float32 if device.type == "mps" else torch.float64


def empty_packet(batch: int, status: float, device: torch.device) -> torch.Tensor:
    """A packet of zeros with ``status``: what a process that could not build its own sends."""
    packet = torch.zeros(PacketLayout(batch).size, dtype=packet_dtype(device), device=device)
    packet[0] = status
    return packet


def reference_packet(evidence: RolloutEvidence, config: GuardConfig, thresholds: Thresholds) -> torch.Tensor:
    """The packet from the pure-torch statistics (:func:`summarise`) and verdict (:func:`judge`), on the
    evidence's device; status 1 and check flag 0 (the caller sets the flag)."""
    samples, histogram, contribution = summarise(evidence, config, thresholds)
    verdict = judge(samples, config)
    dtype = packet_dtype(samples.device)
    exact = torch.float32 if samples.device.type == "mps" else torch.float64
    kept = ~verdict.suspect
    calibration = (contribution.to(exact) * kept.view(-1, 1, 1)).sum(dim=0).flatten()
    head = torch.ones(2, dtype=dtype, device=samples.device)
    head[1] = 0.0
    return torch.cat([head, samples.flatten().to(dtype), verdict.reasons.to(dtype), histogram.to(dtype),
                      calibration.to(dtype), kept.sum().view(1).to(dtype)])
