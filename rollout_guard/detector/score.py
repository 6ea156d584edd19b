"""The row score: how much likelier a row's per-token disagreements are if the engine is off than under healthy noise.

Pure, vectorised tensor functions; the design and the evidence for each choice are in ``docs/detector.md``.

Per token, ``x = d − μ_r`` with ``d = engine − trainer`` logprob (nats; positive: the engine found the token likelier
than the trainer, the corruption's signature) and ``μ_r``, ``b_r`` the centre and scale of the healthy noise of the
token's confidence region ``r`` (:data:`REGION_EDGES`), a Laplace density ``exp(−|x|/b)/2b``. An engine that is off
by a lag ``D > 0`` moves ``x`` to ``x − D`` on the tokens it affects. Two alternatives, each a mixture over the lag
(:data:`LAGS`) and over where it acts, weighed against healthy noise:

* **from some token on** (``Λ_onset``): the onset token lags by ``D``, every later read token by ``g ~ U(0, D)``;
  the onset is uniform over the row's read tokens.
* **at a few tokens** (``Λ_sparse``): each read token lags independently with probability ``π = 1/n`` (one expected
  per row of ``n`` read tokens), by ``D``, towards the engine with probability :data:`ENGINE_FAVOURING`, else by
  ``−D`` (a garbage engine logprob below the trainer's).

The score is ``ln Λ`` with ``Λ = ½ Λ_onset + ½ Λ_sparse``. Under the healthy noise the test assumes, ``E[Λ] = 1``, so
``ln Λ > ln(1/α)`` fires on at most a share ``α`` of healthy rows (Markov's inequality): one threshold from one
false-alarm budget, whatever the row's length or confidence.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

REGION_EDGES = (-3.0, -1.5, -0.5)
"""nats: the engine-logprob edges of the confidence regions (< −3, [−3, −1.5), [−1.5, −0.5), [−0.5, 0]): healthy
noise grows with a token's surprise, so each region learns its own scale."""
NUM_REGIONS = len(REGION_EDGES) + 1
LAGS = (1.0, 2.0, 4.0, 8.0, 16.0)
"""nats: the lags ``D`` an engine that is off may add, log-spaced (the same weight per octave) from 1 nat to a token
the trainer finds 10⁷ times less likely. Below 1 nat a sustained shift is within the healthy variation of a top-p
cut's offset along a row (docs/detector.md)."""
ENGINE_FAVOURING = 0.75
"""The share of the sparse alternative's lags that favour the engine: its signature, while a garbage logprob the
engine reports (a kernel overflow) can fall on either side."""
CHUNK_ELEMENTS = 1 << 24  # rows × tokens × lags a chunk of rows is scored in (each float32 intermediate ≤ 64 MiB)


class RowScores(NamedTuple):
    score: torch.Tensor
    """(B,) float32 ln Λ; −inf for a row without a read token."""
    onset: torch.Tensor
    """(B,) int64: the read token where the disagreement most likely starts (the mode of the onset mixture, or the
    sparse alternative's strongest token where that dominates); −1 without a read token."""
    excess: torch.Tensor
    """(B,) float32: the largest engine-favouring ``x / b`` of the row, how many healthy-noise scales beyond its
    region's centre its most engine-favouring token lies; NaN without a read token."""


def region_of(engine: torch.Tensor) -> torch.Tensor:
    """Confidence region (0 … NUM_REGIONS − 1) of each engine logprob, by :data:`REGION_EDGES`.

    >>> region_of(torch.tensor([-7.0, -3.0, -1.0, -0.1])).tolist()
    [0, 1, 2, 3]
    """
    edges = _on(REGION_EDGES, engine.dtype, str(engine.device))
    return torch.bucketize(engine.contiguous(), edges, right=True)


@functools.cache
def _on(values: tuple[float, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A tuple of constants on a device, copied once (a copy per step would be a host sync each)."""
    return torch.tensor(values, dtype=dtype).to(device)


def onset_log_ratio(x: torch.Tensor, b: torch.Tensor, lag: torch.Tensor) -> torch.Tensor:
    """``ℓ = (|x| − |x − D|) / b``: the log density ratio of one token under a lag ``D`` against healthy Laplace noise
    of scale ``b``; between ``−D/b`` (trainer-favouring) and ``+D/b`` (engine-favouring by ``D`` or more).

    >>> onset_log_ratio(torch.tensor([9.0, 0.0, -1.0]), torch.tensor(0.25), torch.tensor(4.0)).tolist()
    [16.0, -16.0, -16.0]
    """
    return (x.abs() - (x - lag).abs()) / b


def later_log_ratio(x: torch.Tensor, b: torch.Tensor, lag: torch.Tensor) -> torch.Tensor:
    """The log density ratio of one token under a lag ``g ~ U(0, D)`` against healthy Laplace noise of scale ``b``:
    ``ln (1/D) ∫₀ᴰ exp((|x| − |x − g|)/b) dg``, in closed form

    .. math::
        \\ln\\tfrac{b}{D} + \\begin{cases}
            \\ln(1 - e^{-D/b}) & x \\le 0 \\\\
            x/b + \\ln(2 - e^{-x/b} - e^{(x - D)/b}) & 0 < x < D \\\\
            D/b + \\ln(1 - e^{-D/b}) & x \\ge D
        \\end{cases}

    >>> [round(v, 3) for v in later_log_ratio(torch.tensor([-5.0, 0.5, 9.0]), torch.tensor(0.5), torch.tensor(1.0)).tolist()]
    [-0.839, 0.541, 1.161]
    """
    inside = x.clamp(min=0.0).minimum(lag)  # x held to [0, D]: the three cases in one expression
    edge = torch.log(-torch.expm1(-lag / b))  # ln(1 − e^{−D/b})
    middle = inside / b + torch.log((2.0 - torch.exp(-inside / b) - torch.exp((inside - lag) / b)).clamp(min=1e-30))
    body = torch.where(x <= 0, edge, torch.where(x >= lag, lag / b + edge, middle))
    return torch.log(b / lag) + body


def row_scores(x: torch.Tensor, scale: torch.Tensor, read: torch.Tensor, cap: torch.Tensor | None = None) -> RowScores:
    """Each row's ``ln Λ`` (module docstring), its onset and its largest excess.

    Args:
        x: (B, T) float: ``engine − trainer − centre`` per token (nats).
        scale: (B, T) float > 0: the healthy-noise scale ``b`` of each token's region (nats).
        read: (B, T) bool: the tokens that count (in the loss mask, both logprobs finite).
        cap: (B, T) float, optional: the most a token's log ratio may count for (a lag at that token; the run's own
            tail rarity, :func:`rollout_guard.detector.noise.tail_rarity`); capping from above keeps ``E[Λ] ≤ 1``.
    Returns:
        :class:`RowScores`, on ``x``'s device; rows are scored in chunks of at most :data:`CHUNK_ELEMENTS`
        rows × tokens × lags, so that the intermediates stay small.

    >>> b = torch.full((3, 40), 0.25); read = torch.ones(3, 40, dtype=torch.bool)
    >>> _ = torch.manual_seed(0); x = 0.25 * torch.distributions.Laplace(0.0, 1.0).sample((3, 40))  # healthy noise
    >>> x[1, 12] = 9.2  # one token the engine favours by 9.2 nats
    >>> x[2, 25:] += 1.0  # the engine off by a nat from token 25 on
    >>> s = row_scores(x, b, read)
    >>> bool(s.score[0] < math.log(1000)), bool(s.score[1] > 20), bool(s.score[2] > math.log(1000))
    (True, True, True)
    >>> s.onset[1].item(), round(s.excess[1].item(), 1)
    (12, 36.8)
    """
    if x.shape[-1] == 0 or x.shape[0] == 0:
        none = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
        return RowScores(none - math.inf, none.long() - 1, none + math.nan)
    rows = max(1, CHUNK_ELEMENTS // max(x.shape[-1] * len(LAGS), 1))
    cap = torch.full_like(x, math.inf) if cap is None else cap
    parts = [_chunk_scores(x[i: i + rows], scale[i: i + rows], read[i: i + rows], cap[i: i + rows])
             for i in range(0, x.shape[0], rows)]
    if len(parts) == 1:
        return parts[0]
    return RowScores(*(torch.cat(column) for column in zip(*parts, strict=True)))


def _chunk_scores(x: torch.Tensor, scale: torch.Tensor, read: torch.Tensor, cap: torch.Tensor) -> RowScores:
    x, scale, read, cap = x.float(), scale.float(), read.bool(), cap.float().unsqueeze(-1)
    x = torch.where(read, x, torch.zeros_like(x))
    b = torch.where(read, scale, torch.ones_like(scale)).unsqueeze(-1)  # (B, T, 1)
    lags = _on(LAGS, torch.float32, str(x.device))  # (L,)
    xs = x.unsqueeze(-1)
    first = onset_log_ratio(xs, b, lags).minimum(cap)  # (B, T, L)
    later = later_log_ratio(xs, b, lags)
    mask = read.unsqueeze(-1)
    later = torch.where(mask, later, torch.zeros_like(later))
    after = later.flip(1).cumsum(1).flip(1) - later  # Σ over the read tokens after each one
    onset_terms = torch.where(mask, first + after, torch.full_like(first, -math.inf))  # (B, T, L)
    n = read.sum(-1).float()
    log_n = torch.log(n.clamp(min=1.0))
    log_onset = torch.logsumexp(onset_terms.flatten(1), dim=-1) - log_n - math.log(len(LAGS))
    # the sparse alternative: Π_t (1 − π + π·m_t) with π = 1/n and m_t the mean over signed lags of exp(ℓ)
    down = onset_log_ratio(-xs, b, lags).minimum(cap)  # a lag of the trainer-favouring sign
    log_m = torch.logaddexp(torch.logsumexp(first, dim=-1) + math.log(ENGINE_FAVOURING),
                            torch.logsumexp(down, dim=-1) + math.log(1 - ENGINE_FAVOURING)) - math.log(len(LAGS))
    log_pi = -log_n.unsqueeze(-1)
    log_rest = torch.log1p(-torch.exp(log_pi).clamp(max=1 - 1e-7))
    per_token = torch.logaddexp(log_rest, log_pi + log_m)
    log_sparse = torch.where(read, per_token, torch.zeros_like(per_token)).sum(-1)
    score = torch.logaddexp(log_onset, log_sparse) - math.log(2.0)
    has = n > 0
    score = torch.where(has, score, torch.full_like(score, -math.inf))
    # where it starts: the onset mixture's mode, or the sparse alternative's strongest token where that dominates
    by_onset = torch.logsumexp(onset_terms, dim=-1).argmax(-1)
    by_token = torch.where(read, log_m, torch.full_like(log_m, -math.inf)).argmax(-1)
    onset = torch.where(log_sparse > log_onset, by_token, by_onset)
    onset = torch.where(has, onset, torch.full_like(onset, -1))
    ratio = torch.where(read, x / b.squeeze(-1), torch.full_like(x, -math.inf)).amax(-1)
    excess = torch.where(has, ratio, torch.full_like(ratio, math.nan))
    return RowScores(score, onset, excess)
