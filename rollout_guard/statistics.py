"""Per-rollout statistics: pure, vectorised tensor functions from evidence and the detector's judgement.

Per rollout, one row of :data:`SAMPLE_COLUMNS`; padding never counts, and a statistic with no token to stand on is
NaN (never a pad's 0.0). Token-level |Δ| is summarised by a histogram with fixed, log-spaced edges so that steps and
processes add up.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from rollout_guard.detector import Judgement
from rollout_guard.detector.fused import ROW_COLUMNS
from rollout_guard.detector.score import region_of
from rollout_guard.evidence import RolloutEvidence

SAMPLE_COLUMNS = (
    "tokens",  # tokens in the loss mask
    "compared_tokens",  # tokens where both logprobs are finite
    "max_abs_delta",  # nats
    "mean_abs_delta",  # nats per compared token
    "seq_log_ratio",  # nats: sum of (trainer − engine) logprob, log π_trainer(y|x) / π_engine(y|x)
    "kl_k3",  # nats per token: k3 estimate of KL(engine ‖ trainer) from the engine's own samples
    "engine_max_logprob",  # nats
    "engine_mean_logprob",  # nats
    "trainer_max_logprob",  # nats
    "trainer_mean_logprob",  # nats
    "nonfinite_engine_tokens",  # tokens whose engine logprob is NaN/±inf
    "nonfinite_trainer_tokens",  # tokens whose trainer logprob is NaN/±inf
    "injected",  # 1/0 ground truth from a fault injector, NaN without one
    "score",  # ln Λ, the detector's score (rollout_guard.detector.score); NaN without a compared token
    "onset_token",  # index in the completion where the disagreement most likely starts, −1 without one
    "onset_engine_logprob",  # nats: the engine's logprob of the onset token
    "onset_trainer_logprob",  # nats: the trainer's logprob of the onset token
    "noise_scale",  # nats: the healthy-noise scale of the onset token's confidence region
    "excess",  # healthy-noise scales: the most engine-favouring token's distance from its region's centre
)
COLUMN = {name: index for index, name in enumerate(SAMPLE_COLUMNS)}
assert SAMPLE_COLUMNS == ROW_COLUMNS  # the fused kernel writes them in this order

# |Δ| histogram: [0, 1e-6) then 8 bins per decade up to 100 nats, then [100, inf).
DELTA_BIN_EDGES = torch.cat([torch.zeros(1, dtype=torch.float64),
                             torch.logspace(-6, 2, 8 * 8 + 1, dtype=torch.float64)])
NUM_DELTA_BINS = DELTA_BIN_EDGES.numel()  # the last bin is the overflow bin [100, inf)

_K3_LOG_RATIO_CAP = 30.0  # exp(30) ≈ 1e13 stays finite in float32; larger ratios add nothing to a verdict


def _masked_max(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    filled = torch.where(where, values, torch.full_like(values, -math.inf)).amax(dim=-1)
    return torch.where(where.any(dim=-1), filled, torch.full_like(filled, math.nan))


def _masked_mean(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    count = where.sum(dim=-1)
    total = torch.where(where, values, torch.zeros_like(values)).sum(dim=-1)
    return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, math.nan))


@functools.cache
def _delta_edges(dtype: torch.dtype, device: str) -> torch.Tensor:
    """The |Δ| histogram's edges on a device, copied once (a copy per step would be a host sync each)."""
    return DELTA_BIN_EDGES.to(dtype).to(device)


def _at_least_one_column(evidence: RolloutEvidence) -> RolloutEvidence:
    """Empty completions (T = 0) become one masked-out column, so reductions have something to reduce."""
    if evidence.mask.shape[-1] > 0:
        return evidence

    def pad(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else torch.nn.functional.pad(tensor, (0, 1))

    return RolloutEvidence(pad(evidence.mask), pad(evidence.engine_logprobs), pad(evidence.trainer_logprobs),
                           evidence.injected)


def summarise(evidence: RolloutEvidence, judgement: Judgement) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-rollout statistics, (B, len(SAMPLE_COLUMNS)) float32 (float64 from the fused step on CUDA), and the |Δ|
    histogram of the compared tokens, (NUM_DELTA_BINS,) int64 counts; on the evidence's device, no host sync.

    >>> from rollout_guard.detector import Detector
    >>> engine = torch.full((2, 4), -0.2); trainer = engine.clone(); trainer[1, 2] = -9.0
    >>> evidence = RolloutEvidence(torch.ones(2, 4, dtype=torch.bool), engine, trainer)
    >>> samples, histogram = summarise(evidence, Detector().judge(engine, trainer, evidence.mask))
    >>> samples[:, COLUMN["max_abs_delta"]].tolist(), samples[1, COLUMN["onset_token"]].item(), int(histogram.sum())
    ([0.0, 8.800000190734863], 2.0, 8)
    """
    if judgement.samples is not None:  # the fused step computed them with the judgement
        return judgement.samples, judgement.delta_histogram
    evidence = _at_least_one_column(evidence)
    valid = evidence.mask.bool()
    batch = valid.shape[0]
    nan_row = torch.full((batch,), math.nan, device=valid.device, dtype=torch.float32)
    zeros = torch.zeros_like(valid, dtype=torch.float32)
    engine = evidence.engine_logprobs.float() if evidence.has_engine else zeros
    trainer = evidence.trainer_logprobs.float() if evidence.has_trainer else zeros
    engine_ok = valid & torch.isfinite(engine) if evidence.has_engine else torch.zeros_like(valid)
    trainer_ok = valid & torch.isfinite(trainer) if evidence.has_trainer else torch.zeros_like(valid)
    both = engine_ok & trainer_ok
    log_ratio = torch.where(both, trainer - engine, torch.zeros_like(engine))
    abs_delta = log_ratio.abs()
    capped = log_ratio.clamp(max=_K3_LOG_RATIO_CAP)
    k3 = torch.expm1(capped) - capped
    compared = both.sum(dim=-1)
    onset = judgement.onset.to(valid.device)
    has_onset = onset >= 0
    at = onset.clamp(min=0).unsqueeze(-1)
    onset_engine = engine.gather(1, at).squeeze(1)
    onset_trainer = trainer.gather(1, at).squeeze(1)
    onset_scale = judgement.noise.scale.to(valid.device, torch.float32)[region_of(onset_engine)]
    columns = {
        "tokens": valid.sum(dim=-1),
        "compared_tokens": compared,
        "max_abs_delta": _masked_max(abs_delta, both),
        "mean_abs_delta": _masked_mean(abs_delta, both),
        "seq_log_ratio": torch.where(compared > 0, log_ratio.sum(dim=-1), nan_row),
        "kl_k3": _masked_mean(k3, both),
        "engine_max_logprob": _masked_max(engine, engine_ok),
        "engine_mean_logprob": _masked_mean(engine, engine_ok),
        "trainer_max_logprob": _masked_max(trainer, trainer_ok),
        "trainer_mean_logprob": _masked_mean(trainer, trainer_ok),
        "nonfinite_engine_tokens": (valid & ~torch.isfinite(engine)).sum(dim=-1) if evidence.has_engine
                                   else zeros.sum(dim=-1),
        "nonfinite_trainer_tokens": (valid & ~torch.isfinite(trainer)).sum(dim=-1) if evidence.has_trainer
                                    else zeros.sum(dim=-1),
        "injected": evidence.injected.float() if evidence.injected is not None else nan_row,
        "score": torch.where(compared > 0, judgement.score.float(), nan_row),
        "onset_token": torch.where(has_onset, onset, torch.full_like(onset, -1)),
        "onset_engine_logprob": torch.where(has_onset, onset_engine, nan_row),
        "onset_trainer_logprob": torch.where(has_onset, onset_trainer, nan_row),
        "noise_scale": torch.where(has_onset, onset_scale, nan_row),
        "excess": judgement.excess.float(),
    }
    samples = torch.stack([columns[name].to(torch.float32) for name in SAMPLE_COLUMNS], dim=-1)
    bins = torch.bucketize(abs_delta, _delta_edges(abs_delta.dtype, str(valid.device)), right=True) - 1
    histogram = torch.zeros(NUM_DELTA_BINS, dtype=torch.int64, device=valid.device)
    histogram.scatter_add_(0, bins.flatten().clamp(min=0), both.flatten().long())  # no boolean indexing: no sync
    return samples, histogram


def histogram_quantile(counts: torch.Tensor | Sequence[float], q: float) -> float:
    """The q-quantile of |Δ| from histogram counts (a tensor or a list), log-interpolated inside its bin (NaN when
    empty).

    Accurate to the bin width, 1/8 decade (a factor of 1.33); the overflow bin reports its lower edge. Callers
    that know the exact maximum clip the estimate to it.

    >>> counts = torch.zeros(NUM_DELTA_BINS); counts[41] = 100  # all in [0.1, 0.133)
    >>> round(histogram_quantile(counts, 0.5), 4)
    0.1155
    """
    # a few dozen bins: plain Python beats small tensor ops
    values = counts.tolist() if isinstance(counts, torch.Tensor) else counts
    total = sum(values)
    if total <= 0:
        return math.nan
    target, before, index = q * total, 0.0, len(values) - 1
    for bin_index, count in enumerate(values):
        if before + count >= target:
            index = bin_index
            break
        before += count
    lower = _EDGES[index]
    if index + 1 >= len(_EDGES):
        return lower
    upper = _EDGES[index + 1]
    fraction = (target - before) / max(values[index], 1e-12)
    if lower == 0.0:
        return upper * fraction
    return lower * (upper / lower) ** min(max(fraction, 0.0), 1.0)


_EDGES = DELTA_BIN_EDGES.tolist()
