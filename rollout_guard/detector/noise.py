"""The run's healthy noise: per confidence region, the centre and Laplace scale of ``d = engine − trainer``.

Read from a signed histogram of ``d`` per region (:data:`EDGES`) that grows by the tokens of kept rows, the scale
shrunk towards a prior (:data:`PRIOR_SCALE`) that weighs as :data:`PRIOR_TOKENS` tokens. Histograms add up, so steps
and processes combine by summation; the scale is read from the **trainer-favouring** side alone (``d`` below the
centre), which corruption (mostly engine-favouring) does not reach, so the current batch's own tokens, corrupted rows
included, can join the reading from the first step. Design: ``docs/detector.md``.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from rollout_guard.detector.score import NUM_REGIONS, region_of

_POSITIVE = ([0.01 * k for k in range(1, 51)] + [0.5 + 0.05 * k for k in range(1, 31)]
             + [2.0 * 2.0 ** (k / 4) for k in range(1, 21)])
EDGES = tuple([-v for v in reversed(_POSITIVE)] + [0.0] + _POSITIVE)
"""nats: the edges of the ``d`` histogram, symmetric about 0: 0.01 apart up to 0.5, 0.05 apart up to 2, then a
quarter-octave apart up to 64; the outermost bins are open."""
NUM_BINS = len(EDGES) + 1
PRIOR_SCALE = 0.25
"""nats: the healthy-noise scale assumed before a region has tokens of its own. The published healthy mismatch of
current stacks lies well inside it (mean |Δ log p| 0.064, a long response's max 0.32 nats); see docs/detector.md."""
PRIOR_TOKENS = 1000.0
"""tokens: the weight of the prior in each region's histogram (a region's own noise dominates after a few thousand)."""
CENTRE_TOKENS = 50.0
"""tokens: the weight of the centre of all regions' tokens in a region's centre."""
CENTRE_WINDOW = 0.5
"""nats: the half-width of the window whose densest position gives the centre (:func:`centre_of`): wider than healthy
bf16 noise and a top-k offset's spread about its mode, narrower than the nats a corrupted engine spreads over."""
CENTRE_RANGE = 16.0  # nats: where the centre may lie
CENTRE_PRIOR = 2.0
"""nats: the scale of the centre's prior about 0 (:func:`centre_of`): a window ``c`` nats out must hold ``e^{|c|/2}``
times the tokens of one at 0 to be the centre. A top-p cut moves healthy processed logprobs by at most ``−ln top_p``
(0.1 nats at 0.9), healthy noise by hundredths of a nat, while a broken engine's disagreements sit nats out: a run
broken on every row from its first step is still judged about 0. A top-k cut's offset (about 1.3 nats for a barely
trained policy at top-k 5) is learned, a little low; the TRL adapter removes it (``compare_on_engine_support``)."""
MIN_TAIL = 10.0
"""tokens: the scale is fitted to the trainer-favouring tail only at depths where at least this many lie beyond."""
SCALE_FLOOR = 0.01  # nats: the least scale read (bitwise-identical stacks have none; bf16 rounding is ~0.004)


class Noise(NamedTuple):
    centre: torch.Tensor  # (NUM_REGIONS,) nats: the centre of d (centre_of)
    scale: torch.Tensor  # (NUM_REGIONS,) nats: the Laplace scale that bounds the trainer-favouring tail
    tokens: torch.Tensor  # (NUM_REGIONS,) tokens read


@functools.cache
def _edges(dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.tensor(EDGES, dtype=dtype).to(device)


def histogram(delta: torch.Tensor, region: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """(NUM_REGIONS, NUM_BINS) float64 counts of the read tokens' ``d`` per region; one ``index_add_`` (a
    ``bincount`` would read its input's maximum on the host).

    >>> counts = histogram(torch.tensor([[0.005, -0.3, 2.0]]), torch.tensor([[3, 3, 0]]), torch.ones(1, 3, dtype=torch.bool))
    >>> counts.sum(1).tolist(), counts[3, EDGES.index(0.0) + 1].item()  # the bin [0, 0.01) holds 0.005
    ([1.0, 0.0, 0.0, 2.0], 1.0)
    """
    bins = torch.bucketize(delta.float().contiguous(), _edges(torch.float32, str(delta.device)), right=True)
    index = torch.where(read, region * NUM_BINS + bins, torch.zeros_like(bins))
    counts = torch.zeros(NUM_REGIONS * NUM_BINS, dtype=torch.float64, device=delta.device)
    return counts.index_add_(0, index.flatten(), read.flatten().double()).view(NUM_REGIONS, NUM_BINS)


def token_histogram(engine: torch.Tensor, trainer: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """:func:`histogram` of ``engine − trainer`` by the engine's confidence region."""
    return histogram(engine - trainer, region_of(engine), read)


def _bounds(k: torch.Tensor, edges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lower and upper edge of each bin index ``k`` (an open bin's one edge twice), and whether it is closed."""
    last = len(EDGES) - 1
    return edges[(k - 1).clamp(min=0, max=last)], edges[k.clamp(max=last)], (k > 0) & (k <= last)


def _cdf(counts: torch.Tensor, at: torch.Tensor, row: torch.Tensor | None = None) -> torch.Tensor:
    """Counts at or below each point of ``at``, linear within a bin (an open bin's mass at its edge): of region
    ``row`` (an index tensor that broadcasts against ``at``), or, without it, of each row of ``at`` (R, K)."""
    edges = _edges(counts.dtype, str(counts.device))
    below = torch.cat([torch.zeros_like(counts[:, :1]), counts.cumsum(1)], dim=1)  # (R, NUM_BINS + 1)
    k = torch.bucketize(at.contiguous(), edges, right=True)  # the bin of each point
    lo, hi, inner = _bounds(k, edges)
    share = torch.where(inner, ((at - lo) / (hi - lo)).clamp(0, 1), (k >= len(EDGES)).to(at.dtype))
    row = torch.arange(counts.shape[0], device=counts.device).unsqueeze(1) if row is None else row
    return below[row, k] + counts[row, k] * share


def noise_of(counts: torch.Tensor) -> Noise:
    """The healthy noise a histogram shows, per region.

    The centre ``μ`` is :func:`centre_of` the histogram. The scale is the least Laplace scale whose tail covers the
    trainer-favouring tail at every depth ``u`` where at least :data:`MIN_TAIL` tokens, and at most a share ``1/e``
    of that side, lie beyond it (the tail, where a small shift of the median moves little):

    .. math:: b = \\max_u \\frac{u}{\\ln\\big(N_-/S(u)\\big)},\\quad S(u) = \\#\\{d \\le \\mu - u\\},\\ N_- = S(0)

    (a Laplace tail has ``S(u) = N_- e^{-u/b}`` at every depth; a heavier tail raises ``b``), at least
    :data:`SCALE_FLOOR`.

    >>> _ = torch.manual_seed(0); d = 0.1 * torch.distributions.Laplace(0.0, 1.0).sample((1, 100_000))
    >>> noise = noise_of(histogram(d + 0.3, torch.full(d.shape, 2), torch.ones(d.shape, dtype=torch.bool)))
    >>> round(noise.centre[2].item(), 2), round(noise.scale[2].item(), 1), noise.scale[0].item()  # region 0: no data
    (0.3, 0.1, 0.01)
    """
    counts = counts.double()
    centre = centre_of(counts)
    return Noise(centre=centre, scale=tail_scale(counts, centre, MIN_TAIL), tokens=counts.sum(1))


def tail_scale(counts: torch.Tensor, centre: torch.Tensor, min_tail: float) -> torch.Tensor:
    """(R,) the least Laplace scale whose tail covers each region's trainer-favouring tail (``d`` below ``centre``)
    at every depth with at least ``min_tail`` and at most a share ``1/e`` of that side's tokens beyond it
    (:func:`noise_of`'s formula), at least :data:`SCALE_FLOOR`."""
    counts = counts.double()
    depths = _depths(counts.dtype, str(counts.device))
    centre = centre.to(counts.dtype).unsqueeze(1)
    beyond = _cdf(counts, centre - depths)  # (R, U)
    below = _cdf(counts, centre)  # (R, 1)
    usable = (beyond >= min_tail) & (beyond <= below / math.e)  # the tail: a scale or more below the centre
    fitted = depths / torch.log(below / beyond.clamp(min=1e-300))
    return torch.where(usable, fitted, torch.zeros_like(fitted)).amax(1).clamp(min=SCALE_FLOOR)


def _inverse_cdf(counts: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """(R,) the point of each region's histogram with ``mass`` (R,) tokens at or below it, linear within its bin."""
    edges = _edges(counts.dtype, str(counts.device))
    cum = counts.cumsum(1)
    mass = mass.unsqueeze(1)
    k = (cum < mass).sum(1, keepdim=True).clamp(max=NUM_BINS - 1)  # the bin holding that mass
    before = torch.where(k > 0, cum.gather(1, (k - 1).clamp(min=0)), torch.zeros_like(mass))
    inside = counts.gather(1, k)
    lo, hi, inner = _bounds(k, edges)
    share = ((mass - before) / inside.clamp(min=1e-300)).clamp(0, 1)
    value = torch.where(inner, lo + share * (hi - lo), torch.where(k == 0, hi, lo))
    return value.squeeze(1)


@functools.cache
def _depths(dtype: torch.dtype, device: str) -> torch.Tensor:
    """The positive edges on a device, copied once (a copy per step would be a host sync each)."""
    return torch.tensor([v for v in EDGES if v > 0], dtype=dtype).to(device)


@functools.cache
def _candidates(dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.tensor([v for v in EDGES if abs(v) <= CENTRE_RANGE], dtype=dtype).to(device)


def centre_of(counts: torch.Tensor) -> torch.Tensor:
    """(R,) the centre of each region's healthy noise: the median of the tokens in the densest window of
    ``±``:data:`CENTRE_WINDOW` nats, its density weighed by a Laplace prior of scale :data:`CENTRE_PRIOR` about 0
    (0 for an empty region).

    Healthy tokens crowd about the centre (bf16 noise is a few hundredths of a nat; a top-k cut's offset varies by a
    few tenths), while a corrupted engine's disagreements spread over nats. So the densest window stays on the
    healthy tokens even where corrupted tokens outnumber them, which a plain median does not: a run whose engine is
    broken on most rows from its first step is still judged about its healthy centre.

    >>> _ = torch.manual_seed(0)
    >>> d = torch.cat([0.3 + 0.02 * torch.randn(1, 300), 2.0 + 10.0 * torch.rand(1, 700)], dim=1)  # 70 % spread far
    >>> counts = histogram(d, torch.zeros_like(d, dtype=torch.long), torch.ones_like(d, dtype=torch.bool))
    >>> round(centre_of(counts)[0].item(), 1), round(_inverse_cdf(counts, 0.5 * counts.sum(1))[0].item())  # the median
    (0.3, 5)
    """
    counts = counts.double()
    at = _candidates(counts.dtype, str(counts.device)).expand(counts.shape[0], -1)  # (R, K)
    low, high = _cdf(counts, at - CENTRE_WINDOW), _cdf(counts, at + CENTRE_WINDOW)
    # the densest window, a window c nats out needing e^{|c|/CENTRE_PRIOR} times the tokens of one at 0
    best = (torch.log((high - low).clamp(min=1e-30)) - at.abs() / CENTRE_PRIOR).argmax(1, keepdim=True)
    low, high = low.gather(1, best).squeeze(1), high.gather(1, best).squeeze(1)
    centre = _inverse_cdf(counts, 0.5 * (low + high))
    return torch.where(counts.sum(1) > 0, centre, torch.zeros_like(centre))


def healthy_noise(counts: torch.Tensor, prior_scale: float = PRIOR_SCALE, prior_tokens: float = PRIOR_TOKENS) -> Noise:
    """:func:`noise_of` the run's histogram, its scale an upper bound: a reading narrower than the prior is shrunk
    towards it by weight, a wider one is taken as it is, ``b = max((n₀ b₀ + n b̂) / (n + n₀), b̂)`` with ``n`` tokens
    in the region. A region with few quiet tokens is judged at about the prior's scale, one whose tokens show wider
    noise at that width from its first step; after a few thousand quiet tokens their own reading dominates. The
    centre has no prior (a top-p or top-k cut moves it by up to a few nats): it is the region's own
    (:func:`centre_of`) shrunk towards that of every region's tokens, ``μ = (n μ̂ + n_c μ̂_all) / (n + n_c)`` with
    ``n_c`` = :data:`CENTRE_TOKENS`, so that a region's few tokens never centre themselves (a single corrupted token
    would be its own centre).

    >>> empty = torch.zeros(NUM_REGIONS, NUM_BINS, dtype=torch.float64)
    >>> healthy_noise(empty).scale.tolist() == [PRIOR_SCALE] * NUM_REGIONS
    True
    """
    own = noise_of(counts)
    weight = own.tokens / (own.tokens + prior_tokens)
    pooled = counts.sum(0, keepdim=True)
    everywhere = centre_of(pooled)
    centre = (own.tokens * own.centre + CENTRE_TOKENS * everywhere) / (own.tokens + CENTRE_TOKENS)
    shrunk = weight * own.scale + (1 - weight) * prior_scale
    return Noise(centre=centre, scale=torch.maximum(shrunk, own.scale), tokens=own.tokens)


def tail_rarity(counts: torch.Tensor, noise: Noise, region: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(B, T) ``−ln(S_r(|x|) / N₋)``: how rare the trainer-favouring side of ``counts`` has shown a distance ``|x|``
    from its region's centre to be; +inf where no token there lies as deep (the engine-favouring side: ``counts``
    flipped, the centre negated; :data:`EDGES` are symmetric). No token's evidence may exceed the other side's
    rarity (a heavy healthy tail a run shows on one side cannot be read as a lag on the other), and a quiet run caps
    nothing.

    >>> counts = torch.zeros(NUM_REGIONS, NUM_BINS, dtype=torch.float64)
    >>> counts[0, EDGES.index(-8.0)] = 1.0; counts[0, EDGES.index(0.0)] = 999.0  # one token 8 nats deep of 1000
    >>> noise = Noise(torch.zeros(NUM_REGIONS), torch.full((NUM_REGIONS,), 0.1), counts.sum(1))
    >>> [round(v, 2) for v in tail_rarity(counts, noise, torch.tensor([0, 0, 1]), torch.tensor([5.0, 10.0, 5.0])).tolist()]
    [6.91, inf, inf]
    """
    centre = noise.centre.to(counts.dtype)[region].unsqueeze(-1)
    at = torch.cat([centre - x.abs().to(counts.dtype).unsqueeze(-1), centre], dim=-1)  # (B, T, 2): depth, centre
    beyond = _cdf(counts, at, region.unsqueeze(-1))  # (B, T, 2): tokens at or below each point
    rarity = torch.log(beyond[..., 1] / beyond[..., 0])
    return torch.where(beyond[..., 0] > 0, rarity, torch.full_like(rarity, math.inf)).to(x.dtype)


def engine_favouring_cap(counts: torch.Tensor, noise: Noise, region: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(B, T) the most an engine-favouring token's log ratio may count for: the smaller of :func:`tail_rarity` on
    the trainer-favouring side of ``counts`` and ``|x| / b_tail``, with ``b_tail`` the least Laplace scale that
    covers every token of that side (:func:`tail_scale` down to one token). The rarity alone caps nothing beyond the
    side's deepest token; ``b_tail`` carries a heavy tail the run shows on past it, while a quiet run's ``b_tail``
    is about its noise scale and caps nothing a lag can reach (``|x| / b ≥ ℓ``).

    >>> counts = torch.zeros(NUM_REGIONS, NUM_BINS, dtype=torch.float64)
    >>> counts[0, EDGES.index(-8.0)] = 1.0; counts[0, EDGES.index(0.0)] = 999.0  # one token 8 nats deep of 1000
    >>> noise = Noise(torch.zeros(NUM_REGIONS), torch.full((NUM_REGIONS,), 0.1), counts.sum(1))
    >>> [round(v, 2) for v in engine_favouring_cap(counts, noise, torch.tensor([0, 0, 1]), torch.tensor([5.0, 10.0, 5.0])).tolist()]
    [4.32, 8.63, 500.0]
    """
    scale = tail_scale(counts, noise.centre, 1.0).to(x.dtype)[region]
    return torch.minimum(tail_rarity(counts, noise, region, x), x.abs() / scale)
