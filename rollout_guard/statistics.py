"""Statistics: pure, vectorised tensor functions from evidence to per-sample and per-step numbers.

Per sample, one row of :data:`SAMPLE_COLUMNS`; padding never counts, and a statistic with no token to stand on
is NaN (never a pad's 0.0). Per step, aggregates over all valid tokens of the (gathered) batch. Token-level
|Δ| is summarised by a histogram with fixed, log-spaced edges so that steps and processes can be added up.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
import math
from typing import NamedTuple

import torch

from rollout_guard.config import GuardConfig
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
    "confident_wrong_tokens",  # tokens: engine logprob ≥ confident_logprob and trainer ≤ doubtful_logprob
    "first_divergent_token",  # index in the completion of the first |Δ| > divergence_delta, −1 if none
    "nonfinite_engine_tokens",  # tokens whose engine logprob is NaN/±inf
    "nonfinite_trainer_tokens",  # tokens whose trainer logprob is NaN/±inf
    "injected",  # 1/0 ground truth from a fault injector, NaN without one
    "spike_margin",  # nats: max over tokens of (|x| − the token's spike threshold); > 0 fires, NaN if none can
    "drift_cusum",  # nats: max over the sequence of the CUSUM of (clip(x) − allowance)
    "drift_start",  # index in the completion where that CUSUM run starts, −1 without a compared token
    "changepoint_score",  # ln Λ of rollout_guard.changepoint.changepoint_score; NaN where not computed
)
COLUMN = {name: index for index, name in enumerate(SAMPLE_COLUMNS)}

# |Δ| histogram: [0, 1e-6) then 8 bins per decade up to 100 nats, then [100, inf).
DELTA_BIN_EDGES = torch.cat([torch.zeros(1, dtype=torch.float64),
                             torch.logspace(-6, 2, 8 * 8 + 1, dtype=torch.float64)])
NUM_DELTA_BINS = DELTA_BIN_EDGES.numel()  # the last bin is the overflow bin [100, inf)

# Engine-logprob buckets (nats): (<−3), [−3, −1.5), [−1.5, −0.5), [−0.5, 0]. Healthy mismatch grows with a
# token's surprise, and corruption lives in the upper buckets (the engine liked the token).
ENGINE_BUCKET_EDGES = (-3.0, -1.5, -0.5)
NUM_ENGINE_BUCKETS = len(ENGINE_BUCKET_EDGES) + 1
# Positive excess x (nats) histogram per bucket, for the calibrated spike thresholds: 2^(k/4), 0.25 … 64 nats;
# the last bin is [64, inf). Values below 0.25 count only in the bucket's token count.
EXCESS_EDGES = tuple(2.0 ** (k / 4) for k in range(-8, 25))
NUM_EXCESS_BINS = len(EXCESS_EDGES)
# per bucket: tokens, Σ clip(x), Σ clip(x)², spike candidates, their |x| histogram, the other tokens' |x| histogram
CALIBRATION_WIDTH = 4 + 2 * NUM_EXCESS_BINS
UNLIKELY_HISTOGRAM = 4 + NUM_EXCESS_BINS  # where the histogram of the tokens no side found likely starts
EXCESS_CLIP = (-2.0, 4.0)  # nats: one token moves the CUSUM by at most this much (before the allowance)
# nats: the most a token that neither side found likely adds to the drift CUSUM (before the allowance). Healthy
# large-model runs put their 10–18-nat tails on such tokens, corruption puts tokens one side found likely; one such
# token then adds at most 1 nat past the allowance, so GuardConfig.calibrated_drift_floor can sit at 2.5. Measured
# on the fidelity benchmark (1,000 faults per condition): at 4 (as the others) with the floor at 3.5, 12 false of
# 91,776 unique clean rows and 61-70 of 888,995 resampled judgements, 387 late-onset and 126 moderate missed; at
# 1.5 with the floor at 2.5, 8, 28, 280 and 102 (real context swaps 7 -> 10 missed of 4,096).
UNLIKELY_STEP_CLIP = 1.5

_K3_LOG_RATIO_CAP = 30.0  # exp(30) ≈ 1e13 stays finite in float32; larger ratios add nothing to a verdict


def _masked_max(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    filled = torch.where(where, values, torch.full_like(values, -math.inf)).amax(dim=-1)
    return torch.where(where.any(dim=-1), filled, torch.full_like(filled, math.nan))


def _masked_mean(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    count = where.sum(dim=-1)
    total = torch.where(where, values, torch.zeros_like(values)).sum(dim=-1)
    return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, math.nan))


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device`` without a host sync: on CUDA through pinned memory and a non-blocking copy
    (PyTorch's caching host allocator keeps the pinned block until the copy is done); a plain copy elsewhere. A
    blocking host→device copy waits for the stream, a second host sync in the guard's step."""
    device = torch.device(device)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


@functools.cache
def _edges_on(which: str, dtype: torch.dtype, device: str) -> torch.Tensor:
    """The bucket and histogram edges on a device, copied once (a copy per step would be a host sync each), and
    each engine bucket's surprise at its lower logprob edge (``"surprise"``: 3, 3, 1.5, 0.5 nats)."""
    engine = torch.tensor(ENGINE_BUCKET_EDGES, dtype=torch.float64)
    values = {"engine": engine, "delta": DELTA_BIN_EDGES, "excess": torch.tensor(EXCESS_EDGES, dtype=torch.float64),
              "surprise": torch.cat([engine[:1], engine]).neg()}[which]
    return to_device(values.to(dtype), device)


def engine_bucket(engine: torch.Tensor) -> torch.Tensor:
    """Bucket index (0 … NUM_ENGINE_BUCKETS − 1) of each engine logprob, by :data:`ENGINE_BUCKET_EDGES`.

    >>> engine_bucket(torch.tensor([-7.0, -3.0, -1.0, -0.1])).tolist()
    [0, 1, 2, 3]
    """
    edges = _edges_on("engine", engine.dtype, str(engine.device))
    return torch.bucketize(engine.contiguous(), edges, right=True)


def surprise_weight(engine: torch.Tensor, bucket: torch.Tensor) -> torch.Tensor:
    """How much a token's ``|x|`` counts against its engine bucket's calibrated spike threshold (a factor ≥ 1):
    healthy mismatch grows with a token's surprise ``s = −engine logprob``, so within a bucket the tokens the engine
    found likelier are held to a tighter threshold, as if each were as surprising as the bucket's least likely one:

    .. math:: w = \\frac{1 + s_k}{1 + \\min(s,\\ s_0)}

    with ``s_k`` the surprise at bucket ``k``'s lower logprob edge (:data:`ENGINE_BUCKET_EDGES`: 3, 3, 1.5 and 0.5
    nats) and ``s_0`` = 3 nats, so that the lowest bucket (engine logprob < −3 nats, where the heavy healthy tails
    live) is not scaled. Within a bucket ``w`` spans at most 1.67: the spread of healthy mismatch grows about as
    much across each upper bucket under ``σ ∝ 1 + s`` (the hybrid-7B noise model fitted to open-instruct's published
    figures). A token without a finite engine logprob has ``w = 1``.

    The spike histograms always read ``w · |x|``, so a bucket's calibrated spike thresholds are read on it, and the
    spike rules read ``w · |x|`` in the buckets whose threshold is calibrated (:attr:`Thresholds.weighted`) and
    ``|x|`` in the others, whose thresholds are in nats (``spike_excess``, the batch's own reading). The drift CUSUM
    and the centres read ``x``. Measured on the fidelity benchmark (1,000 faults per condition, on the engine's
    support; ``benchmarks/DETECTOR_RECORD.md``, twenty-fourth and twenty-fifth entries): told the settings, late
    onset missed 14 → 12 of 27,000, flagged judgements of resampled healthy rows 51 → 27 of 888,995, false
    quarantines 6 → 6 of 122,368; never told them, late onset 158 → 20, moderate 29 → 3, false 5 → 4. Applied to
    every bucket (the fixed 4 nats judging ``w · |x|`` too), false quarantines rose 7 → 22 with the trainer's
    logprobs not renormalised over the engine's top-k support: a renormalisation offset does not grow with
    surprise.

    Args:
        engine: (B, T) engine logprobs (nats).
        bucket: (B, T) their :func:`engine_bucket`.
    Returns:
        (B, T) float32.

    >>> engine = torch.tensor([[-7.0, -3.0, -1.6, -1.5, -0.5, -0.01, float("nan")]])
    >>> bucket = engine_bucket(torch.nan_to_num(engine, nan=0.0))
    >>> [round(v, 3) for v in surprise_weight(engine, bucket)[0].tolist()]
    [1.0, 1.0, 1.538, 1.0, 1.0, 1.485, 1.0]
    """
    lower = _edges_on("surprise", torch.float32, str(engine.device))  # each bucket's highest surprise
    surprise = engine.float().neg().clamp(min=0.0, max=float(-ENGINE_BUCKET_EDGES[0]))
    weight = (1.0 + lower[bucket]) / (1.0 + surprise)
    return torch.where(torch.isfinite(engine), weight, torch.ones_like(weight))


def cusum_drawup(increments: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One-sided CUSUM over each row: the largest rise of the running sum, and where that rise starts.

    .. math:: C_t = \\sum_{i \\le t} v_i\\,u_i, \\qquad
              S = \\max_t \\big(C_t - \\min(0, \\min_{j \\le t} C_j)\\big)

    with ``u`` the increments and ``v`` the valid flags (invalid tokens add nothing). Equal to the classic
    recursion ``S_t = max(0, S_{t−1} + u_t)``, ``S = max_t S_t``, computed without a loop over t.

    Args:
        increments: (B, T) float.
        valid: (B, T) bool.
    Returns:
        (B,) drawup ≥ 0, and (B,) long index of the first token of the rise (0 if it starts at the beginning).

    >>> s, start = cusum_drawup(torch.tensor([[1., 1., -5., 2., 2., 2.]]), torch.ones(1, 6, dtype=torch.bool))
    >>> s.tolist(), start.tolist()
    ([6.0], [3])
    """
    running = torch.where(valid, increments, torch.zeros_like(increments)).cumsum(dim=-1)
    lows, where = torch.cummin(running, dim=-1)
    floor = lows.clamp(max=0.0)
    rise = running - floor
    best = rise.argmax(dim=-1, keepdim=True)
    start = torch.where(floor.gather(-1, best) < 0, where.gather(-1, best) + 1, torch.zeros_like(best)).squeeze(-1)
    return rise.amax(dim=-1).clamp(min=0.0), start


class Thresholds(NamedTuple):
    """Per engine-logprob bucket (NUM_ENGINE_BUCKETS,) tensors the detector statistics need: the centre of
    healthy ``d`` (nats), the CUSUM allowance (nats per token), the spike threshold on ``|x|`` of spike candidates
    (nats; for the mean row: each row's own comes from :func:`spike_per_row`), the one on ``|x|`` of the other
    tokens, which neither side found likely (nats; +inf: not judged), and whether the spike rules read
    :func:`surprise_weight` · ``|x|`` against them (1.0: thresholds read from the calibration's histograms, which
    hold that) or ``|x|`` (0.0: thresholds in nats)."""

    centre: torch.Tensor
    allowance: torch.Tensor
    spike: torch.Tensor
    unlikely_spike: torch.Tensor
    weighted: torch.Tensor

    @classmethod
    def fixed(cls, config: GuardConfig, device: torch.device | str = "cpu") -> Thresholds:
        """Before calibration: centre 0, the warm-up allowance, the uncalibrated spike threshold ``spike_excess``;
        tokens no side found likely are not judged (that is where healthy large-model runs put their 10–18-nat
        tails)."""
        full = functools.partial(torch.full, (NUM_ENGINE_BUCKETS,), dtype=torch.float32, device=device)
        spike = config.spike_excess if config.spike_excess is not None else math.inf
        return cls(full(0.0), full(config.warmup_drift_allowance), full(spike), full(math.inf), full(0.0))


class RowScaling(NamedTuple):
    """How a calibrated spike threshold moves with a row's own number of spike candidates (:func:`spike_per_row`):
    ``slope`` (K,) nats per e-fold (0: the same threshold for every row), ``floor`` nats, ``candidates`` the mean
    row's spike candidates the thresholds were read for."""

    slope: torch.Tensor
    floor: float
    candidates: float


def spike_per_row(spike: torch.Tensor, scaling: RowScaling | None, candidates: torch.Tensor) -> torch.Tensor:
    """Each row's spike threshold per bucket (nats), for a false-alarm budget per *row* rather than per mean row:

    .. math:: t_{r,k} = \\max\\big(\\textit{floor},\\ t_k + s_k \\ln(\\max(n_r, 1) / \\bar n)\\big)

    with ``t_k`` the bucket's threshold read at ``α = β / 1000 / n̄`` (``n̄`` the mean row's spike candidates), ``s_k``
    the slope of that reading in ``ln(1/α)`` (:func:`rollout_guard.calibration.extrapolated_quantile` is linear
    there) and ``n_r`` the row's candidates: a row of ``n_r`` candidates is read at ``β / 1000 / n_r``, so every row
    has the same expected false firings, and a short row (few tokens to fire by chance) is judged closer to its
    noise. With ``s_k = 0`` (``scaling`` ``None``, or a bucket not calibrated) ``t_k`` itself.

    Args:
        spike: (K,) thresholds for the mean row.
        scaling: the calibration's :class:`RowScaling`, or ``None``.
        candidates: (B,) spike candidates per row.
    Returns:
        (B, K) float32.

    >>> t = spike_per_row(torch.tensor([4.0, 2.0]), RowScaling(torch.tensor([0.0, 0.3]), 1.5, 100.0),
    ...                   torch.tensor([10.0, 100.0, 1000.0]))
    >>> [[round(v, 3) for v in row] for row in t.tolist()]
    [[4.0, 1.5], [4.0, 2.0], [4.0, 2.691]]
    """
    spike = spike.float().unsqueeze(0)
    if scaling is None:
        return spike.expand(candidates.shape[0], -1)
    factor = torch.log(candidates.float().clamp(min=1.0) / scaling.candidates).unsqueeze(1)
    scaled = (spike + scaling.slope.to(spike).unsqueeze(0) * factor).clamp(min=scaling.floor)
    return torch.where(scaling.slope.to(spike.device).unsqueeze(0) > 0, scaled, spike)


BATCH_CENTRE_MIN_TOKENS = 200.0
"""tokens of a bucket in this process's batch that its own centre needs (:func:`batch_thresholds`); a bucket with
fewer keeps the warm-up thresholds (centre 0). With a healthy spread up to 1.5 nats the median's standard error is
then ≤ 0.14 nats."""

BATCH_CENTRE_GRID = 600
"""cells of the grid over the clip range (−2 … 4 nats) on which :func:`batch_thresholds` reads its medians: 0.01
nats each."""

UNCALIBRATED_ROW_TOKENS = 256.0
"""compared tokens per row of the rows on which ``GuardConfig.spike_excess`` was measured (the fidelity benchmark's,
at most 256 tokens). A batch whose rows are longer gives each of them more chances to cross a fixed threshold:
:func:`batch_thresholds` raises it by :data:`UNCALIBRATED_SPIKE_SLOPE` per e-fold of length beyond this, and so does
the calibration where it caps a bucket with too few candidates at it
(:class:`~rollout_guard.calibration.Calibration`, with the mean kept row's tokens)."""

UNCALIBRATED_SPIKE_SLOPE = 0.9
"""nats per e-fold of a batch's compared tokens per row beyond :data:`UNCALIBRATED_ROW_TOKENS`: how far
:func:`batch_thresholds` raises the uncalibrated spike threshold (``spike_excess``) of a bucket not calibrated yet,
so that a row ``n`` times as long keeps about the same chance of a false firing (under an exponential tail of scale
s the per-token threshold for ``1/n`` the rate lies ``s · ln n`` higher). The steepest slope the calibration reads
on the fidelity benchmark (:func:`rollout_guard.calibration.extrapolated_quantile` per e-fold of α, the bucket
below −3 nats under the hybrid-7B tail model: 0.47–0.89). Measured with rows 8 times as long (``fidelity.py
--stitch 8``, ~2,000 tokens): without it, 7 false quarantines of 15,296 clean rows (0.21 % and 0.30 % in the two
hybrid-7B-tail streams; five in the first two steps, two in a bucket with too few candidates), with it none, for 5
more isolated spikes missed of 27,000; see ``benchmarks/DETECTOR_RECORD.md``."""


def length_raised_spike(spike_excess: float, tokens_per_row: float | torch.Tensor) -> float | torch.Tensor:
    """The uncalibrated spike threshold for rows of ``tokens_per_row`` compared tokens (nats): ``spike_excess``,
    measured on rows of up to :data:`UNCALIBRATED_ROW_TOKENS`, raised by :data:`UNCALIBRATED_SPIKE_SLOPE` per
    e-fold of length beyond that.

    .. math:: s(L) = s_0 + a \\cdot \\ln \\max(L / L_0,\\ 1)

    Args:
        spike_excess: ``s_0`` (nats; ``math.inf`` stays ``inf``).
        tokens_per_row: ``L``, a float (the calibration's mean kept row, on the host) or a tensor of any shape
            (the batch's, on its device: no host sync).
    Returns: a float, or a tensor of ``tokens_per_row``'s shape.

    >>> length_raised_spike(4.0, 200.0), round(length_raised_spike(4.0, 256.0 * math.e ** 2), 6)
    (4.0, 5.8)
    >>> length_raised_spike(4.0, torch.tensor([100.0, 256.0 * math.e])).tolist()
    [4.0, 4.900000095367432]
    """
    if isinstance(tokens_per_row, torch.Tensor):
        longer = (tokens_per_row / UNCALIBRATED_ROW_TOKENS).clamp(min=1.0)
        return spike_excess + UNCALIBRATED_SPIKE_SLOPE * torch.log(longer)
    return spike_excess + UNCALIBRATED_SPIKE_SLOPE * math.log(max(tokens_per_row / UNCALIBRATED_ROW_TOKENS, 1.0))


def batch_thresholds(evidence: RolloutEvidence, config: GuardConfig, thresholds: Thresholds,
                     own: torch.Tensor | None, follow: float | None = None, spiky: torch.Tensor | None = None,
                     spike_floor: float | None = None) -> tuple[Thresholds, torch.Tensor, torch.Tensor]:
    """The thresholds a batch is judged with when some buckets' centres are not known yet (the first step of a
    run, or after a change of the sampling settings): for those buckets (``own``), the batch's own centre and drift
    allowance, where the batch holds enough of their tokens (:data:`BATCH_CENTRE_MIN_TOKENS`):

    .. math:: c_k = \\operatorname{median}_{i \\in k} \\operatorname{clip}(d_i),\\qquad
              a_k = \\min\\Big(a_w,\\ \\max\\Big(\\textit{drift\\_allowance},
              \\ \\frac{\\sigma_k^2\\,\\ln(1000\\,L/\\beta)}{2h}\\Big)\\Big)

    with ``d = engine − trainer`` over this process's compared tokens of bucket ``k``, clipped to
    :data:`EXCESS_CLIP` and rounded to a grid of :data:`BATCH_CENTRE_GRID` cells (one histogram gives all three);
    σ² the variance of clip(d) there, ``L`` compared tokens per row, β ``false_alarm_budget`` and ``h``
    ``drift_threshold``: the allowance :class:`~rollout_guard.calibration.Calibration` gives a centred bucket, never
    above ``a_w`` (``warmup_drift_allowance``, what the bucket had without a centre of its own).

    All rows count (their verdicts are not known yet), hence the median: corrupted rows move it only by the
    quantile they displace, and a batch must be mostly corrupted in a bucket to carry it off; their spread does
    raise σ², hence the cap (a run broken from step 1 in half its rows, 4 nats per token, is judged around the
    healthy half with ``a_w``, as before). Without a centre of its own, such a step was judged around 0 with
    ``a_w``: corruption averaging less than ``a_w`` per token went unseen (measured on the fidelity benchmark: most
    truncated gibberish and a third of the moderate-confidence faults it missed).

    With ``follow`` (nats), a bucket whose centre is set is judged around the batch's median where that lies more
    than ``follow`` and at most ``a_w`` from it (its allowance and spike threshold stay): a guard that is not told
    the sampling settings (:data:`rollout_guard.calibration.UNANNOUNCED_FOLLOW`) cannot restart its calibration
    where they change, and a change moves every token's offset at once. A median further out is no offset a change
    of the settings makes but a bucket mostly corrupted (half the rows at 4 nats per token, in the tests), which
    must not carry the centre off.

    With ``spiky``, a bucket whose spike threshold is not calibrated yet (its histograms fill for
    ``calibration_warmup_tokens``) is judged with the lower of its threshold and the batch's own reading
    (:func:`batch_spike_thresholds`, around the centre it is judged with, never below ``spike_floor``), where the
    batch holds enough of its tokens; only above the lowest bucket (engine logprob ≥ −3 nats), where every token is
    a spike candidate at the default ``spike_min_engine_logprob`` (−3 nats; a higher cut would let this reading
    count some non-candidates), so the histogram of all its tokens is the candidates'. Until then such a bucket was
    judged by the fixed ``spike_excess`` (4 nats): a 3-nat spike in a quiet run went unseen in the first steps of a run
    and after each change of the sampling settings (measured on the fidelity benchmark: single spikes missed 46 → 32 of
    27,000, no more false quarantines). The reading leaves out the rows the thresholds in use already flag (a token
    of a bucket above the lowest at least its spike threshold, the mean row's, from its centre; a second histogram
    of the rows left): a corrupted row's many moderately-off tokens lifted the batch's 1 % point and the reading with
    it, so that a step with a few corrupted rows kept the fixed 4 nats (measured on the fidelity benchmark, 1,000 faults
    per condition: single spikes missed 20 → 8, late onset 116 → 102, isolated spikes 354 → 347 of 27,000; false
    quarantines 7 → 7, flagged resampled judgements 19 → 20). Before that reading, the uncalibrated threshold of such
    a bucket rises with the batch's compared tokens per row ``L`` beyond :data:`UNCALIBRATED_ROW_TOKENS`, to at
    least ``spike_excess + s · ln(L / 256)`` (``s`` :data:`UNCALIBRATED_SPIKE_SLOPE`): a fixed threshold gives a
    long row more chances to be crossed by its healthy tail.

    Everything stays on the device (no host sync). Also returns each bucket's centre shift for
    :func:`rollout_guard.packet.reanchor` (the calibration learns around the centres it sets, not these), and, where
    the batch set a bucket's centre, σ_k: the spread the ``changepoint`` rule reads there
    (:meth:`rollout_guard.guard.RolloutGuard._changepoint_score`).

    Args:
        evidence: the batch (engine and trainer logprobs).
        config: the guard's settings.
        thresholds: (K,) thresholds from the calibration.
        own: (K,) bool on the evidence's device: the buckets whose centre is not known (``None``: none).
        follow: nats, or ``None``: calibrated centres are kept whatever the batch's median.
        spiky: (K,) bool: the buckets whose spike threshold is not calibrated yet (``None``: none).
        spike_floor: nats, the lowest spike threshold (default ``calibrated_spike_floor``).
    Returns:
        the thresholds to judge with, (K,) float32 shifts (0 where unchanged), and (K,) float32 σ_k where the
        batch set the centre (0 elsewhere).

    >>> engine = torch.full((4, 100), -0.1); trainer = engine - 1.5  # a top-k offset of 1.5 nats on every token
    >>> trainer[0] = engine[0] - 4.0  # one corrupted row: the median stays, the spread (allowance) grows
    >>> t, shift, spread = batch_thresholds(RolloutEvidence(torch.ones(4, 100, dtype=torch.bool), engine,
    ...                                     trainer), GuardConfig(), Thresholds.fixed(GuardConfig()),
    ...                                     torch.ones(4, dtype=torch.bool))
    >>> [round(v, 3) for v in t.centre.tolist()], [round(v, 3) for v in t.allowance.tolist()]
    ([0.0, 0.0, 0.0, 1.5], [2.0, 2.0, 2.0, 1.192])
    >>> [round(v, 3) for v in spread.tolist()]  # the sd of clip(d) there: 300 tokens at 1.5, 100 at 4
    [0.0, 0.0, 0.0, 1.083]
    """
    device = evidence.mask.device
    if not (evidence.has_engine and evidence.has_trainer):  # nothing to centre: no d
        nothing = torch.zeros(NUM_ENGINE_BUCKETS, device=device)
        return thresholds, nothing, nothing
    valid = evidence.mask.bool()
    engine, trainer = evidence.engine_logprobs.float(), evidence.trainer_logprobs.float()
    both = valid & torch.isfinite(engine) & torch.isfinite(trainer)
    low, high = EXCESS_CLIP
    cells = BATCH_CENTRE_GRID + 1
    # one histogram of (bucket, clip(d) on the grid) for everything: torch.histc bins in shared memory on CUDA and
    # never syncs with the host (scatter atomics onto a few hot cells cost 2-38 ms per step on an H200)
    d = engine - trainer
    cell = (d.clamp(low, high) - low) * (BATCH_CENTRE_GRID / (high - low))
    bucket = engine_bucket(torch.where(both, engine, torch.zeros_like(engine)))
    key = bucket * cells + cell.round()
    key = torch.where(both, key.float(), torch.full_like(engine, -1.0))  # not compared: outside the range, not counted

    def counts(keys: torch.Tensor) -> torch.Tensor:  # (K, cells) tokens per bucket and grid cell
        return torch.histc(keys, bins=NUM_ENGINE_BUCKETS * cells, min=-0.5,
                           max=NUM_ENGINE_BUCKETS * cells - 0.5).view(NUM_ENGINE_BUCKETS, cells)

    histogram = counts(key)
    grid = torch.linspace(low, high, cells, device=device)
    count = histogram.sum(dim=1)
    mean = histogram @ grid / count.clamp(min=1)
    variance = (histogram @ (grid * grid) / count.clamp(min=1) - mean * mean).clamp(min=0)
    middle = torch.searchsorted(histogram.cumsum(dim=1), (count / 2).unsqueeze(1).contiguous()).squeeze(1)
    median = grid[middle.clamp(max=cells - 1)]
    per_row = (both.sum() / both.any(dim=-1).sum().clamp(min=1)).clamp(min=1.0)
    horizon = config.drift_threshold if config.drift_threshold is not None else math.inf
    allowance = (variance * torch.log(1000.0 * per_row / config.false_alarm_budget) / (2 * horizon)).clamp(
        min=config.drift_allowance, max=max(config.warmup_drift_allowance, config.drift_allowance))
    own = own.to(device) if own is not None else torch.zeros(NUM_ENGINE_BUCKETS, dtype=torch.bool, device=device)
    enough = count >= BATCH_CENTRE_MIN_TOKENS
    use = own & enough
    calibrated = thresholds.centre.to(device=device, dtype=torch.float32)
    centre = torch.where(use, median, calibrated)
    if follow is not None:  # a centre that is set, but the batch's median has moved away from it (not too far)
        distance = (median - calibrated).abs()
        moved = (distance > follow) & (distance <= config.warmup_drift_allowance)
        centre = torch.where(~own & enough & moved, median, centre)
    allowance = torch.where(use, allowance, thresholds.allowance.to(device=device, dtype=torch.float32))
    spike = thresholds.spike.to(device=device, dtype=torch.float32)
    if spiky is not None:
        spiky = spiky.to(device)
        if config.spike_excess is not None:  # longer rows than spike_excess was measured on: more chances to cross it
            spike = torch.where(spiky, torch.maximum(spike, length_raised_spike(config.spike_excess, per_row)), spike)
        floor = config.calibrated_spike_floor if spike_floor is None else spike_floor
        likely = torch.arange(NUM_ENGINE_BUCKETS, device=device) > 0  # every token of these is a spike candidate
        x = d - centre[bucket]  # rows the thresholds in use flag feed no reading
        fired = (both & likely[bucket] & (x.abs() >= spike[bucket])).any(dim=-1, keepdim=True)
        kept = counts(torch.where(fired, -1.0, key))
        kept_count = kept.sum(dim=1)
        read = batch_spike_thresholds(kept, centre, kept_count, per_row, config.false_alarm_budget, floor)
        spike = torch.where(spiky & (kept_count >= BATCH_CENTRE_MIN_TOKENS) & likely,
                            torch.minimum(spike, read), spike)
    judged = Thresholds(centre, allowance, spike, thresholds.unlikely_spike.to(device), thresholds.weighted.to(device))
    return judged, centre - calibrated, torch.where(use, variance.sqrt(), torch.zeros_like(variance))


def batch_spike_thresholds(histogram: torch.Tensor, centre: torch.Tensor, count: torch.Tensor, per_row: torch.Tensor,
                           budget: float, floor: float) -> torch.Tensor:
    """Per bucket, the spike threshold read from one batch (nats; +inf where it cannot be read): the
    :func:`~rollout_guard.calibration.extrapolated_quantile` of ``|clip(d) − c|`` at ``1 − α``,
    ``α = β / 1000 / L``, from the batch's histogram of clip(d) on the grid of :func:`batch_thresholds`, never below
    ``floor``:

    .. math:: p_1 = \\min(\\max(0.01,\\ 10\\alpha,\\ 20/n),\\ 0.1),\\quad p_0 = \\min(10\\,p_1, 1),\\quad
              t = \\max\\Big(\\textit{floor},\\ q(p_1)
                  + \\big(q(p_1) - q(p_0)\\big)^+ \\frac{\\ln(p_1/\\alpha)}{\\ln(p_0/p_1)}\\Big)

    with ``q(p)`` the distance from the centre ``c`` beyond which at most ``p · n`` of the bucket's ``n`` tokens lie
    (to the grid's half cell), ``L`` compared tokens per row (all of them counted as spike candidates: a smaller α),
    and β ``false_alarm_budget``. +inf where ``q(p_1)`` reaches the clip's nearer edge (−2 or 4 nats): a token
    clipped there is at least that far out, so below the edge it counts as beyond every distance, exactly, and at
    the edge its distance is not known. (Counting the edge tokens instead, +inf past ``p_1 / 2`` of them, one
    corrupted row 5 nats off cost a quiet step its reading: measured on the fidelity benchmark, 1,000 faults per
    condition, single spikes missed 23 → 20 and isolated ones 355 → 354 of 27,000, false quarantines unchanged.)
    Read in the body, like the calibrated threshold, but from the batch, whose corrupted rows below the thresholds
    in use stay in it (:func:`batch_thresholds` leaves out the others), hence its upper anchor at 1 % rather than the
    calibration's 0.1 % (:data:`rollout_guard.calibration.TAIL_ANCHOR`): a batch's own single spikes (a few tokens
    in thousands) sit in its 0.1 % tail and lifted the reading (measured on the fidelity benchmark: single spikes
    missed 24 → 35 of 27,000 with the anchor at 0.1 %).

    Args:
        histogram: (K, G) counts of clip(d) on the grid's G cells.
        centre: (K,) nats, the centre each bucket is judged around.
        count: (K,) tokens per bucket; per_row: () compared tokens per row.
        budget: ``false_alarm_budget``; floor: nats.

    >>> grid = torch.zeros(1, BATCH_CENTRE_GRID + 1); grid[0, 200] = 900.0; grid[0, 220] = 90.0; grid[0, 260] = 10.0
    >>> # 1,000 tokens at d = 0, 0.2 and 0.6 nats around 0; α = 5e-6: q(20 %) = 0.005, q(2 %) = 0.205, 3.6 decades on
    >>> [round(v, 2) for v in batch_spike_thresholds(grid, torch.zeros(1), torch.tensor([1000.0]), torch.tensor(100.0),
    ...                                               0.5, 0.0).tolist()]
    [0.93]
    """
    _, cells = histogram.shape
    low, high = EXCESS_CLIP
    step = (high - low) / BATCH_CENTRE_GRID
    index = torch.arange(cells, device=histogram.device)
    middle = ((centre.float() - low) / step).round().long().clamp(0, cells - 1)
    distance = (index.unsqueeze(0) - middle.unsqueeze(1)).abs()
    folded = torch.zeros_like(histogram).scatter_add_(1, distance, histogram)  # tokens per distance from the centre
    beyond = folded.flip(1).cumsum(1).flip(1) - folded  # tokens further than each distance
    n = count.clamp(min=1.0)
    alpha = budget / 1000.0 / per_row.float().clamp(min=1.0)
    p1 = torch.clamp(torch.maximum(torch.maximum(torch.full_like(n, 0.01), 10 * alpha), 20.0 / n), max=0.1)
    p0 = (10 * p1).clamp(max=1.0)

    def first(p: torch.Tensor) -> torch.Tensor:  # the first distance (cells) beyond which at most p · n tokens lie
        return (beyond <= (p * n).unsqueeze(1)).float().argmax(dim=1)  # the last distance always qualifies

    inner1, inner0 = first(p1), first(p0)
    q1, q0 = (inner1.float() + 0.5) * step, (inner0.float() + 0.5) * step
    read = q1 + (q1 - q0).clamp(min=0) * torch.log(p1 / alpha) / torch.log(p0 / p1)
    nearer_edge = torch.minimum(middle, cells - 1 - middle)  # distance (cells) of the nearer clip edge
    return torch.where(inner1 < nearer_edge, read.clamp(min=floor), torch.full_like(read, math.inf))


def _at_least_one_column(evidence: RolloutEvidence) -> RolloutEvidence:
    """Empty completions (T = 0) become one masked-out column, so reductions have something to reduce."""
    if evidence.mask.shape[-1] > 0:
        return evidence

    def pad(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else torch.nn.functional.pad(tensor, (0, 1))

    return RolloutEvidence(pad(evidence.mask), pad(evidence.engine_logprobs), pad(evidence.trainer_logprobs),
                           evidence.injected)


def summarise(evidence: RolloutEvidence, config: GuardConfig, thresholds: Thresholds | None = None,
              scaling: RowScaling | None = None,
              changepoint: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample statistics, (B, len(SAMPLE_COLUMNS)) float32, the |Δ| histogram of the compared tokens,
    (NUM_DELTA_BINS,) int64 counts (exact at any size), and each sample's calibration contribution,
    (B, NUM_ENGINE_BUCKETS, CALIBRATION_WIDTH) float32 (tokens, Σ clip(x), spike candidates and their
    :func:`surprise_weight` · |x| histogram per bucket, and the other tokens' w · |x| histogram), from one pass over
    the token tensors; all stay on the evidence's device.
    ``thresholds``: the calibrated detector thresholds (default: :meth:`Thresholds.fixed`); ``scaling``: how the
    calibrated spike thresholds move with a row's spike candidates (:func:`spike_per_row`; ``None``: they do not);
    ``changepoint``: (B,) each row's :func:`rollout_guard.changepoint.changepoint_score`, for its column (``None``:
    NaN, not computed)."""
    evidence = _at_least_one_column(evidence)
    thresholds = thresholds if thresholds is not None else Thresholds.fixed(config, evidence.device)
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
    confident_wrong = both & (engine >= config.confident_logprob) & (trainer <= config.doubtful_logprob)
    divergent = both & (abs_delta > config.divergence_delta)
    first_divergent = torch.where(
        divergent.any(dim=-1), divergent.int().argmax(dim=-1), torch.full((batch,), -1, device=valid.device)
    )
    compared = both.sum(dim=-1)

    # direction-aware detector: x = d − centre of the token's engine bucket
    bucket = engine_bucket(torch.where(engine_ok, engine, torch.zeros_like(engine)))
    centre, allowance, unlikely_spike = (t.to(device=valid.device, dtype=torch.float32)[bucket]
                                         for t in (thresholds.centre, thresholds.allowance, thresholds.unlikely_spike))
    excess = torch.where(both, (engine - trainer) - centre, torch.zeros_like(engine))
    weighted = excess * surprise_weight(engine, bucket)  # what the spike histograms read
    judged = torch.where(thresholds.weighted.to(device=valid.device)[bucket] > 0, weighted, excess)  # the rules
    likely = both & ((engine >= config.spike_min_engine_logprob) | (trainer >= config.spike_min_trainer_logprob))
    spike_table = thresholds.spike.to(device=valid.device, dtype=torch.float32)
    if scaling is not None:  # each row's own threshold per bucket
        spike = spike_per_row(spike_table, scaling, likely.sum(dim=-1)).gather(1, bucket)
    else:
        spike = spike_table[bucket]
    over = _masked_max(judged.abs() - torch.where(likely, spike, unlikely_spike), both)
    spike_margin = torch.where(over == -math.inf, nan_row, over)  # no token that can fire (all thresholds +inf)
    clipped = excess.clamp(*EXCESS_CLIP)
    steps = torch.where(likely, clipped, clipped.clamp(max=UNLIKELY_STEP_CLIP))
    drift, drift_start = cusum_drawup(steps - allowance, both)
    contribution = calibration_contribution(bucket, weighted, clipped, both, likely)
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
        "confident_wrong_tokens": confident_wrong.sum(dim=-1),
        "first_divergent_token": first_divergent,
        "nonfinite_engine_tokens": (valid & ~torch.isfinite(engine)).sum(dim=-1) if evidence.has_engine
                                   else zeros[:, 0],
        "nonfinite_trainer_tokens": (valid & ~torch.isfinite(trainer)).sum(dim=-1) if evidence.has_trainer
                                    else zeros[:, 0],
        "injected": evidence.injected.float() if evidence.injected is not None else nan_row,
        "spike_margin": spike_margin,
        "drift_cusum": torch.where(compared > 0, drift, nan_row),
        "drift_start": torch.where(compared > 0, drift_start, torch.full_like(drift_start, -1)),
        "changepoint_score": changepoint if changepoint is not None else nan_row,
    }
    samples = torch.stack([columns[name].to(torch.float32) for name in SAMPLE_COLUMNS], dim=-1)
    bins = torch.bucketize(abs_delta, _edges_on("delta", abs_delta.dtype, str(valid.device)), right=True) - 1
    histogram = torch.zeros(NUM_DELTA_BINS, dtype=torch.int64, device=valid.device)
    histogram.scatter_add_(0, bins.flatten(), both.flatten().long())  # no boolean indexing: no host sync
    return samples, histogram, contribution


def calibration_contribution(bucket: torch.Tensor, excess: torch.Tensor, clipped: torch.Tensor,
                             compared: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """Per sample and engine bucket: compared tokens, Σ clip(x), Σ clip(x)², spike-candidate tokens, the
    histogram of their |x| over :data:`EXCESS_EDGES` and that of the other compared tokens' |x| (from
    :data:`UNLIKELY_HISTOGRAM`); (B, NUM_ENGINE_BUCKETS, CALIBRATION_WIDTH) float32, by scatter (no host sync).
    ``excess``: the x whose magnitudes are binned (:func:`summarise` passes :func:`surprise_weight` · x, what the
    calibrated spike rules read); ``clipped``: clip(x) of the sums.

    >>> c = calibration_contribution(torch.tensor([[3, 3, 0]]), torch.tensor([[0.1, -1.0, -2.0]]),
    ...                              torch.tensor([[0.1, -1.0, -1.0]]), torch.tensor([[True, True, False]]),
    ...                              torch.tensor([[True, True, False]]))
    >>> [round(v, 4) for v in c[0, 3, :4].tolist()], int(c[0, 3, 4:].sum()), float(c[0, 0].sum())
    ([2.0, -0.9, 1.01, 2.0], 1, 0.0)
    >>> c = calibration_contribution(torch.tensor([[0]]), torch.tensor([[-9.0]]), torch.tensor([[-2.0]]),
    ...                              torch.tensor([[True]]), torch.tensor([[False]]))  # a token no side liked
    >>> float(c[0, 0, 3]), int(c[0, 0, 4:UNLIKELY_HISTOGRAM].sum()), int(c[0, 0, UNLIKELY_HISTOGRAM:].sum())
    (0.0, 0, 1)
    """
    batch, width = bucket.shape
    weight = compared.float()
    rows = torch.arange(batch, device=bucket.device).unsqueeze(1).expand(batch, width)
    base = (rows * NUM_ENGINE_BUCKETS + bucket) * CALIBRATION_WIDTH
    out = torch.zeros(batch * NUM_ENGINE_BUCKETS * CALIBRATION_WIDTH, dtype=torch.float32, device=bucket.device)
    out.scatter_add_(0, base.flatten(), weight.flatten())
    out.scatter_add_(0, (base + 1).flatten(), (clipped * weight).flatten())
    out.scatter_add_(0, (base + 2).flatten(), (clipped * clipped * weight).flatten())
    candidates = (compared & candidate).float()
    out.scatter_add_(0, (base + 3).flatten(), candidates.flatten())
    edges = _edges_on("excess", excess.dtype, str(excess.device))
    index = torch.bucketize(excess.abs().contiguous(), edges, right=True) - 1  # −1 below the first edge
    binned = (index >= 0).float()
    out.scatter_add_(0, (base + 4 + index.clamp(min=0)).flatten(), (candidates * binned).flatten())
    others = (compared & ~candidate).float()
    out.scatter_add_(0, (base + UNLIKELY_HISTOGRAM + index.clamp(min=0)).flatten(), (others * binned).flatten())
    return out.view(batch, NUM_ENGINE_BUCKETS, CALIBRATION_WIDTH)


def sample_statistics(evidence: RolloutEvidence, config: GuardConfig) -> torch.Tensor:
    """(B, len(SAMPLE_COLUMNS)) float32 tensor of per-sample statistics, on the evidence's device."""
    return summarise(evidence, config)[0]


def delta_histogram(evidence: RolloutEvidence, config: GuardConfig | None = None) -> torch.Tensor:
    """(NUM_DELTA_BINS,) int64 counts of compared tokens' |Δ| over DELTA_BIN_EDGES."""
    return summarise(evidence, config or GuardConfig())[1]


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
_MAX_COLUMNS = ("max_abs_delta", "engine_max_logprob", "trainer_max_logprob")
_MEAN_COLUMNS = ("mean_abs_delta", "kl_k3", "engine_mean_logprob", "trainer_mean_logprob")
_SUM_COLUMNS = ("tokens", "compared_tokens", "confident_wrong_tokens", "nonfinite_engine_tokens",
                "nonfinite_trainer_tokens")


def step_aggregates(samples: torch.Tensor, histogram: torch.Tensor) -> dict[str, float]:
    """Per-step numbers over all valid tokens of the batch, from per-sample rows (host tensors): maxima over
    samples (NaN skipped), token-weighted means (a sample's mean weighs by the tokens it stands on), sums.
    A few column-wise tensor ops for the whole table, so the cost does not grow with the number of numbers."""
    table = samples.double()
    column = [COLUMN[name] for name in _MAX_COLUMNS]
    if table.shape[0]:
        maxima = table[:, column].nan_to_num(nan=-math.inf, posinf=math.inf, neginf=-math.inf).amax(dim=0).tolist()
    else:
        maxima = [-math.inf] * len(column)
    maxima = [value if value != -math.inf else math.nan for value in maxima]
    values = table[:, [COLUMN[name] for name in _MEAN_COLUMNS]]
    compared = table[:, COLUMN["compared_tokens"]]
    tokens = table[:, COLUMN["tokens"]]
    weights = torch.stack([compared, compared, tokens - table[:, COLUMN["nonfinite_engine_tokens"]],
                           tokens - table[:, COLUMN["nonfinite_trainer_tokens"]]], dim=1)
    keep = ~torch.isnan(values) & (weights > 0)
    numerators = torch.where(keep, values * weights, 0.0).sum(dim=0).tolist()
    denominators = torch.where(keep, weights, 0.0).sum(dim=0).tolist()
    means = [n / d if d > 0 else math.nan for n, d in zip(numerators, denominators, strict=True)]
    sums = table[:, [COLUMN[name] for name in _SUM_COLUMNS]].sum(dim=0).tolist()
    injected = table[:, COLUMN["injected"]]
    labelled = ~torch.isnan(injected)
    metrics = {"samples": float(table.shape[0])}
    metrics.update(zip(_SUM_COLUMNS, sums, strict=True))
    metrics.update(zip(_MAX_COLUMNS, maxima, strict=True))
    metrics.update(zip(_MEAN_COLUMNS, means, strict=True))
    metrics["p99_abs_delta"] = min(histogram_quantile(histogram, 0.99), metrics["max_abs_delta"])
    metrics["injected"] = float(torch.where(labelled, injected, 0.0).sum()) if bool(labelled.any()) else math.nan
    return metrics
