"""The guard's token pass as one Triton kernel: statistics, verdict, histograms and calibration in one launch.

:func:`rollout_guard.packet.reference_packet` computes a process's packet with ~100 small torch kernels (each a
launch and a pass over the B×T tensors); :func:`fused_packet` computes the same packet in one kernel that reads
each token once. One program per sample walks its row in blocks of ``BLOCK`` tokens, carrying the running sums,
maxima, the CUSUM's running sum and running minimum (with its position) from block to block, so the drift
statistic is exact (same recursion, float32 sums in another order). At the row's end the program writes the
row's statistics and verdict, adds the row's |Δ| histogram to the packet and, if the row is kept, its
calibration contribution (float64 atomics).

Used when ``GuardConfig.fused_statistics`` allows it, the evidence is on a CUDA device and Triton is installed;
the pure-torch reference stays the definition and the fallback, and ``tests/test_fused_statistics.py`` checks
the kernel against it (in Triton's interpreter on CPU).
"""

from __future__ import annotations

import functools
import math

import torch

from rollout_guard.config import GuardConfig
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.packet import AGGREGATES, MAX_AGGREGATES, PacketLayout, packet_dtype
from rollout_guard.statistics import (
    _K3_LOG_RATIO_CAP, CALIBRATION_WIDTH, DELTA_BIN_EDGES, ENGINE_BUCKET_EDGES, EXCESS_CLIP, EXCESS_EDGES,
    NUM_DELTA_BINS, NUM_ENGINE_BUCKETS, NUM_EXCESS_BINS, SAMPLE_COLUMNS, UNLIKELY_STEP_CLIP, RowScaling, Thresholds,
    to_device,
)
from rollout_guard.verdict import RULES

# The kernel writes the columns and the rule bits in this order; a change to either must change the kernel.
_KERNEL_COLUMNS = ("tokens", "compared_tokens", "max_abs_delta", "mean_abs_delta", "seq_log_ratio", "kl_k3",
                   "engine_max_logprob", "engine_mean_logprob", "trainer_max_logprob", "trainer_mean_logprob",
                   "confident_wrong_tokens", "first_divergent_token", "nonfinite_engine_tokens",
                   "nonfinite_trainer_tokens", "injected", "spike_margin", "drift_cusum", "drift_start",
                   "changepoint_score")
_KERNEL_RULES = ("nonfinite_engine", "nonfinite_trainer", "token_spike", "mean_drift", "confident_wrong",
                 "directional_spike", "drift", "changepoint")
_KERNEL_AGGREGATES = ("tokens", "compared_tokens", "confident_wrong_tokens", "nonfinite_engine_tokens",
                      "nonfinite_trainer_tokens", "max_abs_delta", "engine_max_logprob", "trainer_max_logprob",
                      "kept_max_abs_delta", "mean_abs_delta_num", "mean_abs_delta_den", "kl_k3_num", "kl_k3_den",
                      "engine_mean_logprob_num", "engine_mean_logprob_den", "trainer_mean_logprob_num",
                      "trainer_mean_logprob_den", "injected", "labelled", "suspect", "caught",
                      *(f"rule/{name}" for name in _KERNEL_RULES))
assert SAMPLE_COLUMNS == _KERNEL_COLUMNS and RULES == _KERNEL_RULES, "update rollout_guard/fused_statistics.py"
assert tuple(name for name, _ in AGGREGATES) == _KERNEL_AGGREGATES and MAX_AGGREGATES == (5, 6, 7, 8)
assert NUM_ENGINE_BUCKETS == 4 and NUM_DELTA_BINS <= 127 and NUM_EXCESS_BINS <= 63

BLOCK = 1024  # tokens per block of a row
NUM_WARPS = 4


def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel():
    """Imported on first use (so that ``TRITON_INTERPRET=1`` set before the first call is honoured)."""
    from rollout_guard._fused_kernel import guard_rows

    return guard_rows


def _threshold(value: float | int | None) -> float:
    return math.inf if value is None else float(value)


def kernel_parameters(config: GuardConfig, thresholds: Thresholds | tuple[list[float], ...],
                      device: torch.device | str, drift_threshold: float | None = None,
                      scaling: RowScaling | None = None, changepoint_threshold: float | None = None) -> torch.Tensor:
    """Everything the kernel reads besides the tokens, as one float32 table on ``device`` (one copy per
    calibration update): the per-bucket thresholds (centre, allowance, spike, unlikely spike, whether the spike rules
    read the surprise-weighted |x|; 20), the config's token
    thresholds and rule thresholds (16; +inf for a rule that is off), the trainer's spike-candidate cut and the CUSUM
    step clip of tokens no side found likely (2), the drift rule's joint limit (−``joint_margin``, +inf if off) and
    weight (2), the |Δ| and |x| histogram edges as the reference compares them
    (float32), then how the spike thresholds move with a row's candidates (4 slopes, the floor, the mean row's
    candidates: :func:`rollout_guard.statistics.spike_per_row`), and the ``changepoint`` rule's threshold (+inf:
    it does not judge). ``thresholds``: tensors or the calibration's lists of floats; ``drift_threshold``: the
    calibrated drift threshold in use (nats; default ``config.drift_threshold``); ``scaling``: ``None``, every row
    alike."""
    drift = config.drift_threshold if config.drift_threshold is None or drift_threshold is None else drift_threshold
    values = [float(v) for t in thresholds for v in (t.tolist() if isinstance(t, torch.Tensor) else t)]
    values += [float(config.confident_logprob), float(config.doubtful_logprob), float(config.divergence_delta),
               float(config.spike_min_engine_logprob), *map(float, ENGINE_BUCKET_EDGES), *map(float, EXCESS_CLIP),
               _K3_LOG_RATIO_CAP, _threshold(config.nonfinite_engine_tokens),
               _threshold(config.nonfinite_trainer_tokens),
               _threshold(config.spike_delta), _threshold(config.mean_delta), _threshold(config.confident_wrong_tokens),
               _threshold(drift), float(config.spike_min_trainer_logprob), UNLIKELY_STEP_CLIP,
               _threshold(config.joint_drift_limit), float(config.joint_drift_weight)]
    assert len(values) == 40
    rows = ([0.0] * NUM_ENGINE_BUCKETS + [0.0, 1.0] if scaling is None
            else [float(v) for v in scaling.slope.tolist()] + [float(scaling.floor), float(scaling.candidates)])
    changepoint = [_threshold(changepoint_threshold if config.changepoint_budget is not None else None)]
    return to_device(torch.tensor(values + _EDGE_VALUES + rows + changepoint, dtype=torch.float32), device)


def with_centres(table: torch.Tensor, thresholds: Thresholds) -> torch.Tensor:
    """A copy of a :func:`kernel_parameters` table with the per-bucket centres, allowances and spike thresholds of
    ``thresholds`` (device tensors, e.g. :func:`rollout_guard.statistics.batch_thresholds`'): on the device, no
    host sync."""
    table = table.clone()
    table[: 3 * NUM_ENGINE_BUCKETS] = torch.cat([thresholds.centre, thresholds.allowance, thresholds.spike]).to(table)
    return table


_EDGE_VALUES = DELTA_BIN_EDGES.float().tolist() + torch.tensor(EXCESS_EDGES, dtype=torch.float32).tolist()


@functools.lru_cache(maxsize=16)
def _empty_packet(batch: int, device: str) -> torch.Tensor:
    """The packet the kernel adds into: zeros, −inf where the aggregates are maxima (kept per size and device;
    never written: :func:`fused_packet` clones it)."""
    layout = PacketLayout(batch)
    out = torch.zeros(layout.size, dtype=packet_dtype(torch.device(device)), device=device)
    out[layout.aggregates.start + MAX_AGGREGATES[0] : layout.aggregates.start + MAX_AGGREGATES[-1] + 1] = -math.inf
    return out


def fused_packet(evidence: RolloutEvidence, config: GuardConfig, thresholds: Thresholds | torch.Tensor,
                 block: int = BLOCK,
                 num_warps: int = NUM_WARPS, histograms: bool = True,
                 drift_threshold: float | None = None, changepoint: torch.Tensor | None = None,
                 changepoint_threshold: float | None = None) -> torch.Tensor:
    """The packet of :func:`rollout_guard.packet.reference_packet`, from one kernel launch (status 1, check
    flag 0). Needs Triton; runs on CUDA tensors (or on CPU tensors in Triton's interpreter). ``thresholds``: the
    calibration's thresholds, or their :func:`kernel_parameters` table (what the guard caches between updates).
    ``block``: tokens per block of a row (a power of two ≥ 16; tests use small blocks to cross block boundaries
    cheaply). ``histograms=False`` skips both histograms (a wrong packet: for timing the kernel's parts only).
    ``drift_threshold``: the calibrated drift threshold in use (nats; default ``config.drift_threshold``; ignored
    when ``thresholds`` is already a parameter table). ``changepoint``: (B,) each row's change-point score, for
    its column and the ``changepoint`` rule (``None``: NaN, not judged); ``changepoint_threshold``: that rule's
    threshold (ignored when ``thresholds`` is a parameter table, which holds it)."""
    mask = evidence.mask
    batch, length = mask.shape
    device = mask.device
    out = _empty_packet(batch, str(device)).clone()  # one copy instead of a fill and a write (host time)
    if batch == 0:
        out[0] = 1.0
        return out

    def rows(tensor: torch.Tensor | None) -> torch.Tensor:
        if tensor is None:
            return mask
        return tensor if tensor.stride(-1) == 1 else tensor.contiguous()

    mask = mask.view(torch.uint8) if mask.dtype == torch.bool else rows(mask)
    engine, trainer = rows(evidence.engine_logprobs), rows(evidence.trainer_logprobs)
    injected = evidence.injected.to(device) if evidence.injected is not None else mask  # the kernel reads it there
    injected = injected.view(torch.uint8) if injected.dtype == torch.bool else injected
    parameters = (thresholds if isinstance(thresholds, torch.Tensor)
                  else kernel_parameters(config, thresholds, device, drift_threshold,
                                         changepoint_threshold=changepoint_threshold))
    score = changepoint.contiguous() if changepoint is not None else parameters  # the kernel reads it there
    _kernel()[(batch,)](
        mask, engine, trainer, injected, score, parameters, out, length, batch, mask.stride(0), engine.stride(0),
        trainer.stride(0),
        HAS_ENGINE=evidence.has_engine, HAS_TRAINER=evidence.has_trainer, HAS_INJECTED=evidence.injected is not None,
        HAS_SCORE=changepoint is not None,
        SPIKE_RULE=config.spike_excess is not None, NUM_DELTA=NUM_DELTA_BINS, NUM_EXCESS=NUM_EXCESS_BINS,
        CAL_WIDTH=CALIBRATION_WIDTH, WIDTH=len(SAMPLE_COLUMNS), BLOCK=block, HISTOGRAMS=histograms, num_warps=num_warps,
    )
    return out
