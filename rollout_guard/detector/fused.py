"""The detector's step on a CUDA device: three Triton kernels, and one for the learning.

What it computes equals the torch reference (:meth:`rollout_guard.detector.Detector.judge` on the CPU, then
:func:`rollout_guard.statistics.summarise`, then :meth:`~rollout_guard.detector.Detector.update`) to float32
rounding, and the noise to float64 rounding; checked by ``tests/test_fused_detector.py`` (in Triton's interpreter,
and on a CUDA device) and by ``benchmarks/statistics_speed.py`` on the GPU.

Each row is cut into chunks of :data:`CHUNK` tokens, one program per (row, chunk) in each pass over the tokens; a
block with no token in the loss mask (a row's padding, a stretch the loss leaves out) is read but not computed, since
its terms add nothing:

1. ``token_pass``: the read tokens' region × ``d`` histogram (:func:`rollout_guard.detector.noise.histogram`) and
   their |Δ| histogram (the statistics'), each chunk's counts, sums and maxima;
2. ``noise_tables`` (one program, float64): the healthy noise of the run and this batch
   (:func:`~rollout_guard.detector.noise.healthy_noise`), the tables the tail caps read
   (:func:`~rollout_guard.detector.noise.tail_rarity`) and the noise's growth (:func:`growth_of`);
3. ``score_pass``: per chunk, backwards, the terms of the score (:func:`~.score.row_scores`): per lag the sum of the
   later-token log ratios, and of the onset terms (within the chunk) the maximum and the scaled sum of exp; the
   chunk's share of the sparse alternative, its strongest token, its largest excess. The last chunk of a row to
   finish combines the row: the later chunks' sums complete each chunk's onset terms (a suffix sum over chunks), so
   the onset mixture's log-sum-exp is exact; its mode is found by scanning again only the chunks whose bound can
   reach it. Then the verdict bits and every statistic in :data:`ROW_COLUMNS` order; a suspect row's tokens go into
   a second histogram, and the last row to finish writes the kept rows' histogram, the batch's less the suspect
   rows'.

``learn`` (one program) adds a step's kept histogram, summed over processes, to the state and records the early
scale. The outputs the guard sends are written as one float64 record in :mod:`rollout_guard.packet`'s order.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from rollout_guard.detector.noise import (CENTRE_PRIOR, CENTRE_RANGE, CENTRE_TOKENS, CENTRE_WINDOW, EDGES, MIN_TAIL,
                                          NUM_BINS, PRIOR_SCALE, PRIOR_TOKENS, SCALE_FLOOR, noise_of)
from rollout_guard.detector.score import ENGINE_FAVOURING, LAGS, NUM_REGIONS, REGION_EDGES

ROW_COLUMNS = ("tokens", "compared_tokens", "max_abs_delta", "mean_abs_delta", "seq_log_ratio", "kl_k3",
               "engine_max_logprob", "engine_mean_logprob", "trainer_max_logprob", "trainer_mean_logprob",
               "nonfinite_engine_tokens", "nonfinite_trainer_tokens", "injected", "score", "onset_token",
               "onset_engine_logprob", "onset_trainer_logprob", "noise_scale", "excess")
"""The per-row statistics the score pass writes, in its order (``statistics.SAMPLE_COLUMNS``, checked there)."""
WIDTH = len(ROW_COLUMNS)
MAX_ROWS = 65_535  # rows a fused step takes: the score pass's grid holds them in CUDA's second dimension
CHUNK = 512  # tokens: one program of each pass reads a chunk of a row (the histogram pass: at once)
LAG_ROW_BLOCK = 128  # tokens the score pass reads at a time, each × LAG_BLOCK lags
HIST_BLOCK = 1024  # tokens a suspect row's histogram reads at a time (one program per row)
LAG_BLOCK = 8  # a power of two at or above len(LAGS)
CHUNK_BLOCK = 64  # chunks a row's partials are read in at a time
SCORE_REGISTERS = 128
"""Registers per thread the score pass is compiled to: four blocks of four warps fit an SM. On an H100 the pass took
8 % less time at 256 rows × 4,096 tokens and 21 % less at 512 × 8,192 than at the compiler's own choice, and 2–8 %
less than at 168 (docs/detector.md, "Implementation and speed")."""
COUNT_SLOTS = 1024  # a power of two above NUM_REGIONS · NUM_BINS: the region × d histogram's slots, one spare
DELTA_SLOTS = 128  # the same for the |Δ| histogram
BINS = 256  # a power of two above NUM_BINS + 1: the noise arithmetic's block
PART = 32  # floats per (row, chunk) partial of each pass over the tokens
AGGREGATES = 27  # the batch's aggregates the last row writes (packet.AGGREGATES, checked there)
ROW_TILE = 64  # rows the aggregates are read in at a time
ACC_FIXED = 2 * COUNT_SLOTS + DELTA_SLOTS + 2  # int32: batch and suspect histograms, |Δ| histogram, a spare slot,
# the rows' ticket; then one ticket per row
TABLES = 16 + 2 * NUM_REGIONS * (NUM_BINS + 1) + 2 * NUM_REGIONS * LAG_BLOCK + NUM_REGIONS
"""float32 values the score pass reads: centre (NUM_REGIONS), scale, each side's mass at or below its centre
(2 · NUM_REGIONS), each side's cumulative counts (2 · NUM_REGIONS · (NUM_BINS + 1)), ln(1 − e^{−D/b}) and ln(b/D) per
region and lag (2 · NUM_REGIONS · LAG_BLOCK), the scale covering every trainer-favouring token (NUM_REGIONS)."""
SCRATCH = 14 * 2 * BINS  # float64: 13 histogram rows and their cumulative counts (what the noise arithmetic gathers
# from), then its results
ZERO = EDGES.index(0.0)  # the positive edges (the tail fit's depths) follow it
CANDIDATES = [i for i, v in enumerate(EDGES) if abs(v) <= CENTRE_RANGE]  # noise._candidates: contiguous
assert NUM_REGIONS == 4 and NUM_REGIONS * NUM_BINS < COUNT_SLOTS and NUM_BINS + 1 <= BINS and len(LAGS) <= LAG_BLOCK
assert CANDIDATES == list(range(CANDIDATES[0], CANDIDATES[-1] + 1))
assert EDGES[ZERO + 1:] == tuple([0.01 * k for k in range(1, 51)] + [0.5 + 0.05 * k for k in range(1, 31)]
                                 + [2.0 * 2.0 ** (k / 4) for k in range(1, 21)]) and ZERO == 100  # _edge_bucket's spacing
CONSTANTS = (math.e, 1e-300, 1e-30, SCALE_FLOOR, PRIOR_SCALE, PRIOR_TOKENS, CENTRE_TOKENS, MIN_TAIL, CENTRE_WINDOW,
             CENTRE_PRIOR)
"""float64 constants of the noise arithmetic (a Python float in a Triton kernel is float32), then EARLY_TOKENS."""


def _steps(edges: int) -> int:
    """Binary-search steps over ``edges`` sorted edges."""
    return max(1, math.ceil(math.log2(edges + 1)))


def available(device: torch.device) -> bool:
    """Whether the fused step runs on ``device`` (CUDA with Triton)."""
    return device.type == "cuda" and _has_triton()


@functools.cache
def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def growth_of(counts: torch.Tensor, early_scale: torch.Tensor) -> torch.Tensor:
    """(NUM_REGIONS,) the noise scale of ``counts`` over ``early_scale`` (NaN where none is recorded yet)."""
    now = noise_of(counts).scale
    return torch.where(early_scale > 0, now / early_scale.clamp(min=1e-30), torch.full_like(now, math.nan))


def learn(state: torch.Tensor, early_scale: torch.Tensor, kept: torch.Tensor,
          early_tokens: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The state after a step's kept histogram (summed over processes) and the early scale, recorded once a region
    has read ``early_tokens`` (:meth:`rollout_guard.detector.Detector.update`); torch, the reference."""
    before = state.sum(1)
    state = state + kept
    reached = (before < early_tokens) & (state.sum(1) >= early_tokens)
    return state, torch.where(reached, noise_of(state).scale, early_scale)


def _kernels():
    from rollout_guard.detector import _kernels  # Triton, imported on first use

    return _kernels


@functools.cache
def _delta_edges() -> tuple[float, ...]:
    from rollout_guard.statistics import DELTA_BIN_EDGES

    return tuple(DELTA_BIN_EDGES.tolist())


class _Constants(NamedTuple):
    edges: torch.Tensor  # float32 EDGES
    edges64: torch.Tensor  # float64 EDGES, then CONSTANTS and EARLY_TOKENS
    delta_edges: torch.Tensor  # float32 |Δ| histogram edges
    lags: torch.Tensor  # float32 LAGS


@functools.cache
def _constants(device: torch.device, early_tokens: float) -> _Constants:
    """The kernels' constant tables on ``device``, copied once (a copy per step would be a host sync each)."""
    def on(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device)

    return _Constants(on(EDGES, torch.float32), on(EDGES + CONSTANTS + (early_tokens,), torch.float64),
                      on(_delta_edges(), torch.float32), on(LAGS, torch.float32))


def _common(device: torch.device, early_tokens: float) -> dict:
    constants = _constants(device, early_tokens)
    return {"edges_ptr": constants.edges, "E0": REGION_EDGES[0], "E1": REGION_EDGES[1], "E2": REGION_EDGES[2],
            "N_EDGES": len(EDGES)}


def record_size(rows: int) -> int:
    """float64 values of a batch's record: per-row statistics (rows · WIDTH), verdict bits (rows), the |Δ| histogram,
    the kept rows' region × ``d`` histogram, the noise (centre, scale, growth per region) and the batch's aggregates
    (``packet.partial_aggregates``): :mod:`rollout_guard.packet`'s layout after its head."""
    return rows * (WIDTH + 1) + len(_delta_edges()) + NUM_REGIONS * NUM_BINS + 3 * NUM_REGIONS + AGGREGATES


class Step(NamedTuple):
    """One fused judgement, on the device."""

    record: torch.Tensor  # (record_size(B),) float64: statistics, verdict bits, histograms, noise (record_size)
    samples: torch.Tensor  # (B, WIDTH) float64 view of the record: ROW_COLUMNS
    reasons: torch.Tensor  # (B,) int32 bitmask over detector.RULES
    score: torch.Tensor  # (B,) float32, −inf without a read token
    onset: torch.Tensor  # (B,) int64, −1 without a read token
    delta_histogram: torch.Tensor  # (NUM_DELTA_BINS,) int64 |Δ| histogram of the read tokens
    kept: torch.Tensor  # (NUM_REGIONS, NUM_BINS) float64 view of the record: the kept rows' d histogram
    summary: torch.Tensor  # (3, NUM_REGIONS) float64 view of the record: the noise's centre, scale (nats), growth
    tokens: torch.Tensor  # (NUM_REGIONS,) float64: the tokens of the histogram the noise was read from


def judge(engine: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor, injected: torch.Tensor | None,
          state: torch.Tensor, early_scale: torch.Tensor, threshold: float, ceiling: float | None,
          tolerance: float | None, batch_noise: bool, early_tokens: float) -> Step:
    """Judge (B, T) contiguous logprobs (B, T ≥ 1) over the (B, T) mask against the (NUM_REGIONS, NUM_BINS) float64
    ``state`` plus, with ``batch_noise``, this batch's tokens; three launches, no host sync."""
    rows, length = engine.shape
    assert length < 1 << 24  # token positions travel as float32
    device = engine.device
    chunks = -(-length // CHUNK)
    kernels = _kernels()
    constants = _constants(device, early_tokens)
    common = _common(device, early_tokens)
    # four allocations, each region 16-byte aligned: int32 (zeroed: histograms, tickets; then the verdict bits),
    # float32 (the passes' partials, the tables, the scores), float64 (the record, the noise's scratch, its tokens),
    # int64 (the |Δ| histogram, the onsets)
    tickets = -(-(ACC_FIXED + rows) // 4) * 4
    acc = torch.zeros(tickets + rows, dtype=torch.int32, device=device)
    parts = 2 * rows * chunks * PART
    work = torch.empty(parts + TABLES + rows, dtype=torch.float32, device=device)
    size = record_size(rows)
    wide = torch.empty(size + SCRATCH + NUM_REGIONS, dtype=torch.float64, device=device)
    bins = len(_delta_edges())
    ints = torch.empty(bins + rows, dtype=torch.int64, device=device)
    reasons, tables, score = acc[tickets:], work[parts: parts + TABLES], work[parts + TABLES:]
    record, scratch, tokens = wide[:size], wide[size: size + SCRATCH], wide[size + SCRATCH:]
    delta, onset = ints[:bins], ints[bins:]
    kept_at = rows * (WIDTH + 1) + bins
    summary = record[kept_at + NUM_REGIONS * NUM_BINS: kept_at + NUM_REGIONS * NUM_BINS + 3 * NUM_REGIONS]
    strides = (engine.stride(0), trainer.stride(0), mask.stride(0))
    grid = (rows, chunks)
    kernels.token_pass[grid](
        engine, trainer, mask, length, *strides, acc, work, ceiling if ceiling is not None else math.inf,
        tolerance if tolerance is not None else math.inf, delta_edges_ptr=constants.delta_edges,
        N_DELTA_EDGES=bins, DELTA_STEPS=_steps(bins), COUNT_BINS=COUNT_SLOTS, DELTA_BINS=DELTA_SLOTS, PART=PART,
        CHUNK=CHUNK, BLOCK=CHUNK, enable_fp_fusion=False, **common)
    kernels.noise_tables[(1,)](
        acc, int(batch_noise), state, early_scale, scratch, summary, tokens, tables, constants.lags,
        constants.edges64, ZERO=ZERO, CAND_LO=CANDIDATES[0], N_CAND=len(CANDIDATES), N_EDGES=len(EDGES),
        STEPS=_steps(len(EDGES)), BINS=BINS, LAG_BLOCK=LAG_BLOCK, NUM_LAGS=len(LAGS), enable_fp_fusion=False,
        num_warps=8)
    kernels.score_pass[(chunks, rows)](
        engine, trainer, mask, injected if injected is not None else score, length, *strides, acc, work, tables,
        constants.lags, record, reasons, score, onset, delta, rows, threshold=threshold,
        ln_engine=math.log(ENGINE_FAVOURING), ln_trainer=math.log(1 - ENGINE_FAVOURING), NUM_LAGS=len(LAGS),
        LAG_BLOCK=LAG_BLOCK, COUNT_BINS=COUNT_SLOTS, DELTA_BINS=DELTA_SLOTS, N_DELTA_EDGES=bins,
        HAS_CEILING=ceiling is not None, HAS_TOLERANCE=tolerance is not None, HAS_INJECTED=injected is not None,
        WIDTH=WIDTH, PART=PART, CHUNK_BLOCK=CHUNK_BLOCK, CHUNK=CHUNK, BLOCK=LAG_ROW_BLOCK, HIST_BLOCK=HIST_BLOCK,
        ROW_TILE=ROW_TILE, enable_fp_fusion=False, maxnreg=SCORE_REGISTERS, **common)
    return Step(record, record[: rows * WIDTH].view(rows, WIDTH), reasons, score, onset, delta,
                record[kept_at: kept_at + NUM_REGIONS * NUM_BINS].view(NUM_REGIONS, NUM_BINS),
                summary.view(3, NUM_REGIONS), tokens)


def learn_on_device(state: torch.Tensor, early_scale: torch.Tensor, kept: torch.Tensor,
                    early_tokens: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`learn` in one launch: ``kept`` (NUM_REGIONS, NUM_BINS), or (P, NUM_REGIONS, NUM_BINS) summed over its
    first dimension (one per process; each process's histogram contiguous), float64; new tensors, no host sync."""
    kept = kept.to(device=state.device, dtype=torch.float64)
    processes = kept.shape[0] if kept.dim() == 3 else 1
    out = torch.empty(NUM_REGIONS * NUM_BINS + NUM_REGIONS + NUM_REGIONS * 2 * BINS, dtype=torch.float64,
                      device=state.device)
    _kernels().learn[(1,)](state, early_scale, kept, processes, kept.stride(0) if kept.dim() == 3 else 0, out,
                           _constants(state.device, early_tokens).edges64, ZERO=ZERO, CAND_LO=CANDIDATES[0],
                           N_CAND=len(CANDIDATES), N_EDGES=len(EDGES), STEPS=_steps(len(EDGES)), BINS=BINS,
                           enable_fp_fusion=False)
    counts = NUM_REGIONS * NUM_BINS
    return out[:counts].view(NUM_REGIONS, NUM_BINS), out[counts: counts + NUM_REGIONS]
