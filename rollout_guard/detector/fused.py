"""The detector's step on a CUDA device in a few launches: Triton kernels that read each row's tokens once or twice
and CUDA graphs for the fixed-shape noise arithmetic.

What it computes equals the torch reference (:meth:`rollout_guard.detector.Detector.judge` on the CPU, then
:func:`rollout_guard.statistics.summarise`) to float32 rounding, checked by ``tests/test_fused_detector.py`` in
Triton's interpreter and by ``benchmarks/statistics_speed.py`` on the GPU:

* :func:`token_histograms` — one program per row: the read tokens' region × ``d`` histogram
  (:func:`rollout_guard.detector.noise.histogram`) and their |Δ| histogram (the statistics'), or the kept rows' alone;
* :func:`noise_tables` — the healthy noise of the run and this batch (:func:`~rollout_guard.detector.noise.healthy_noise`),
  the cumulative tables the tail caps read (:func:`~rollout_guard.detector.noise.tail_rarity`) and the noise's growth,
  replayed as one CUDA graph;
* :func:`judge_rows` — one program per row: its score, onset and excess (:func:`rollout_guard.detector.score.row_scores`),
  its verdict bits and every per-row statistic in :data:`ROW_COLUMNS` order.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from rollout_guard.detector.noise import EDGES, NUM_BINS, _cdf, healthy_noise, noise_of
from rollout_guard.detector.score import ENGINE_FAVOURING, LAGS, NUM_REGIONS, REGION_EDGES, _on

ROW_COLUMNS = ("tokens", "compared_tokens", "max_abs_delta", "mean_abs_delta", "seq_log_ratio", "kl_k3",
               "engine_max_logprob", "engine_mean_logprob", "trainer_max_logprob", "trainer_mean_logprob",
               "nonfinite_engine_tokens", "nonfinite_trainer_tokens", "injected", "score", "onset_token",
               "onset_engine_logprob", "onset_trainer_logprob", "noise_scale", "excess")
"""The per-row statistics :func:`judge_rows` writes, in its order (``statistics.SAMPLE_COLUMNS``, checked there)."""
COUNT_SLOTS = 1024  # a power of two above NUM_REGIONS · NUM_BINS: the region × d histogram's slots, one spare
DELTA_SLOTS = 128  # the same for the |Δ| histogram
ROW_BLOCK = 256  # tokens a program reads at a time
assert NUM_REGIONS == 4 and NUM_REGIONS * NUM_BINS < COUNT_SLOTS  # the kernels hold four regions


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


class Tables(NamedTuple):
    """What the row kernels read of the noise; on the device, float32."""

    noise: torch.Tensor  # (3, NUM_REGIONS) float64: centre, scale (nats) and growth over the early scale
    centre: torch.Tensor  # (NUM_REGIONS,) nats
    scale: torch.Tensor  # (NUM_REGIONS,) nats
    below: torch.Tensor  # (2, NUM_REGIONS, NUM_BINS + 1): cumulative counts of the run and batch's d, of the mirrored state's
    centre_mass: torch.Tensor  # (2, NUM_REGIONS): each table's counts at or below its centre


def _below(counts: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros_like(counts[:, :1]), counts.cumsum(1)], dim=1)


def growth_of(counts: torch.Tensor, early_scale: torch.Tensor) -> torch.Tensor:
    """(NUM_REGIONS,) the noise scale of ``counts`` over ``early_scale`` (NaN where none is recorded yet)."""
    now = noise_of(counts).scale
    return torch.where(early_scale > 0, now / early_scale.clamp(min=1e-30), torch.full_like(now, math.nan))


def noise_tables(state: torch.Tensor, batch: torch.Tensor, early_scale: torch.Tensor) -> Tables:
    """The tables one step is judged with, from the state's and this batch's (NUM_REGIONS, NUM_BINS) float64
    histograms (pass zeros for ``batch`` to judge against the state alone); fixed shapes, no host sync."""
    counts = state + batch
    noise = healthy_noise(counts)
    mirrored = state.flip(1)  # EDGES are symmetric: the engine-favouring side read as a trainer-favouring one
    centre = noise.centre.unsqueeze(1)
    centre_mass = torch.stack([_cdf(counts, centre).squeeze(1), _cdf(mirrored, -centre).squeeze(1)])
    below = torch.stack([_below(counts), _below(mirrored)])
    summary = torch.stack([noise.centre, noise.scale, growth_of(state, early_scale)])
    return Tables(summary, noise.centre.float(), noise.scale.float(), below.float(), centre_mass.float())


def learn(state: torch.Tensor, early_scale: torch.Tensor, kept: torch.Tensor,
          early_tokens: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The state after a step's kept histogram (summed over processes) and the early scale, recorded once a region
    has read ``early_tokens`` (:meth:`rollout_guard.detector.Detector.update`)."""
    before = state.sum(1)
    state = state + kept
    reached = (before < early_tokens) & (state.sum(1) >= early_tokens)
    return state, torch.where(reached, noise_of(state).scale, early_scale)


class Graphed:
    """``fn`` of fixed-shape CUDA tensors replayed as one CUDA graph: its inputs are copied into static buffers,
    its outputs are the graph's (overwritten by the next call). Falls back to calling ``fn`` where capture fails."""

    def __init__(self, fn: Callable, *examples: torch.Tensor) -> None:
        self.fn = fn
        self.inputs = [example.clone() for example in examples]
        self.graph = None
        if not examples[0].is_cuda:
            return
        try:
            stream = torch.cuda.Stream(device=examples[0].device)
            stream.wait_stream(torch.cuda.current_stream(examples[0].device))
            with torch.cuda.stream(stream):  # warm-up: constants copied to the device outside the capture
                for _ in range(2):
                    fn(*self.inputs)
            torch.cuda.current_stream(examples[0].device).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.outputs = fn(*self.inputs)
        except Exception:  # noqa: BLE001 - an op the capture refuses: run it as it is
            self.graph = None

    def __call__(self, *args: torch.Tensor):
        if self.graph is None:
            return self.fn(*args)
        for static, value in zip(self.inputs, args, strict=True):
            static.copy_(value)
        self.graph.replay()
        return self.outputs


def _kernels():
    from rollout_guard.detector import _kernels  # Triton, imported on first use

    return _kernels


def _common(device: torch.device) -> dict:
    edges = _on(EDGES, torch.float32, str(device))
    return {"edges_ptr": edges, "E0": REGION_EDGES[0], "E1": REGION_EDGES[1], "E2": REGION_EDGES[2],
            "N_EDGES": len(EDGES), "STEPS": _steps(len(EDGES))}


@functools.cache
def _delta_edges() -> tuple[float, ...]:
    from rollout_guard.statistics import DELTA_BIN_EDGES

    return tuple(DELTA_BIN_EDGES.tolist())


def token_histograms(engine: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor,
                     reasons: torch.Tensor | None = None, with_delta: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The read tokens' (NUM_REGIONS, NUM_BINS) float64 region × ``d`` histogram (of the rows whose ``reasons`` is
    0, when given) and, with ``with_delta``, their (NUM_DELTA_BINS,) int64 |Δ| histogram."""
    bins = len(_delta_edges())  # statistics.NUM_DELTA_BINS: its edges, the last bin open

    rows, length = engine.shape
    counts = torch.zeros(COUNT_SLOTS + DELTA_SLOTS, dtype=torch.float32, device=engine.device)
    delta_edges = _on(_delta_edges(), torch.float32, str(engine.device))
    if rows and length:
        _kernels().token_histograms[(rows,)](
            engine, trainer, mask, reasons if reasons is not None else counts, counts, counts[COUNT_SLOTS:], length,
            engine.stride(0), trainer.stride(0), mask.stride(0), delta_edges_ptr=delta_edges,
            N_DELTA_EDGES=bins, DELTA_STEPS=_steps(bins), COUNT_BINS=COUNT_SLOTS,
            DELTA_BINS=DELTA_SLOTS, KEPT_ONLY=reasons is not None, WITH_DELTA=with_delta, BLOCK=ROW_BLOCK,
            **_common(engine.device))
    region_counts = counts[: NUM_REGIONS * NUM_BINS].view(NUM_REGIONS, NUM_BINS).double()
    delta = counts[COUNT_SLOTS: COUNT_SLOTS + bins].long() if with_delta else None
    return region_counts, delta


class Rows(NamedTuple):
    samples: torch.Tensor  # (B, len(ROW_COLUMNS)) float32
    reasons: torch.Tensor  # (B,) int32 bitmask over detector.RULES
    score: torch.Tensor  # (B,) float32, −inf without a read token
    onset: torch.Tensor  # (B,) int64, −1 without a read token


def judge_rows(engine: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor, injected: torch.Tensor | None,
               tables: Tables, threshold: float, ceiling: float | None) -> Rows:
    """Every row's statistics, score and verdict bits (module docstring); one launch."""
    rows, length = engine.shape
    device = engine.device
    samples = torch.empty(rows, len(ROW_COLUMNS), dtype=torch.float32, device=device)
    reasons = torch.empty(rows, dtype=torch.int32, device=device)
    score = torch.empty(rows, dtype=torch.float32, device=device)
    onset = torch.empty(rows, dtype=torch.int64, device=device)
    if rows:
        lags = _on(LAGS, torch.float32, str(device))
        _kernels().judge_rows[(rows,)](
            engine, trainer, mask, injected if injected is not None else score, samples, reasons, score, onset,
            length, engine.stride(0), trainer.stride(0), mask.stride(0), tables.centre, tables.scale,
            tables.below, tables.centre_mass, lags, threshold=threshold,
            ceiling=ceiling if ceiling is not None else 0.0, ln_engine=math.log(ENGINE_FAVOURING),
            ln_trainer=math.log(1 - ENGINE_FAVOURING), NUM_LAGS=len(LAGS), LAG_BLOCK=8,
            HAS_CEILING=ceiling is not None, HAS_INJECTED=injected is not None, WIDTH=len(ROW_COLUMNS),
            BLOCK=ROW_BLOCK, **_common(device))
    return Rows(samples, reasons, score, onset)
