"""Evidence → statistics: the change-point likelihood ratio of a row, for corruption that starts late.

Late-onset stale-state corruption leaves a row's first tokens healthy and then makes every later token lag: the
trainer finds it less likely than the engine did, by a few nats. Per-token rarity (the spike rules) misses the rows
whose lagging tokens stay inside the healthy tail, and a CUSUM (the drift rule) needs its allowance per token. This
statistic weighs the whole row against the run's own per-bucket noise instead: the log of the likelihood ratio of
"the tokens from some onset on lag" against "every token is healthy noise", with the onset and the lag's size not
known (averaged over), and the noise the calibration's (a Gaussian per engine bucket, with the centre and spread
read from kept tokens).

Measured on the fidelity benchmark (``benchmarks/results-2026-12-03-twentyeighth/`` to
``…-2026-12-04-thirtysecond/``): under the hybrid-7B tail model, where the guard's own rules miss 3–12 of 4,000
late-onset rows, the test read at 0.1 % of clean rows catches 99.78–100 % of them with per-bucket noise read from the
guard's four engine buckets (99.88–100 % with 13 0.25-nat bins).
"""

from __future__ import annotations

import functools
import math

import torch

from rollout_guard import fused_statistics
from rollout_guard.statistics import ENGINE_BUCKET_EDGES, engine_bucket, to_device

# nats: the lag D that a corrupted row's onset token has, D ~ U(1, 10), as 12 midpoints (the average over D is
# taken over these); after the onset, every token lags by a gap uniform on [MIN_GAP, D]
LAGS = tuple(1.0 + 0.75 * (k + 0.5) for k in range(12))
MIN_GAP = 0.1  # nats
TOKEN_CAP = 10.0
"""nats of log likelihood ratio: the most one read token adds for the lag (each token's ℓ^first and ℓ^later, per
lag D, is held to at most this). A bucket's Gaussian describes its body; a token whose own spread is several times
the bucket's sits 8–10 σ out while healthy, and alone made a healthy row's ln Λ 13–43. The repository's measured
mismatch spreads 35-fold across the engine-surest bucket (−0.5 … 0 nats: ~0 on sure tokens, most near −0.5;
``benchmarks/noise_shape.py``), and under the hybrid-7B tail in that measured shape (``fidelity.py --noise-shape
softmax``) the rule flagged 0.14–0.36 % of a condition's healthy rows (its budget 0.02 %; the ceiling ln 1000 holds
until the kept rows are read). Capping each token's ratio from above keeps E[Λ] ≤ 1 under the assumed noise, so the
Markov reading of the ceiling stands; a lag over several tokens still adds up. Chosen on one replay (thirty-seventh
session, cap 6, 8, 10 and a clip of each z at 4.5 σ instead, which made the test blind where the noise is small:
0 % of late onset over ln 1000 in the llama T1 run); measured in ``benchmarks/results-2026-12-05-thirtyseventh/``."""
# (rows × tokens × lags) elements a chunk of rows is scored in: each B × T × 12 float32 intermediate stays ≤ 64 MiB
# (a 512 × 16,384-token step would otherwise hold ~400 MiB per intermediate on the device, a few at a time)
CHUNK_ELEMENTS = 1 << 24
_HALF_LOG_TWO_PI = 0.5 * math.log(2 * math.pi)


@functools.cache
def _lags_on(dtype: torch.dtype, device: str) -> torch.Tensor:
    """:data:`LAGS` on a device, copied once (a copy per step would be a host sync each)."""
    return to_device(torch.tensor(LAGS, dtype=dtype), device)


def _log_ndtr_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """ln(Φ(a) − Φ(b)) for a > b, from the side of the smaller tail (no cancellation far out): with
    ``c = −|b|``, ``ln Φ(a) + ln(1 − Φ(b)/Φ(a))`` where ``b ≤ 0`` and ``ln Φ(−b) + ln(1 − Φ(−a)/Φ(−b))`` where
    ``b > 0``, both from one ``ln Φ(c)`` on ``b``'s shape (``a`` may broadcast: its two logs are on its own).

    >>> round(float(_log_ndtr_difference(torch.tensor(0.0), torch.tensor(-40.0))), 6)  # ln ½
    -0.693147
    >>> round(float(_log_ndtr_difference(torch.tensor(41.0), torch.tensor(40.0))), 1)  # far out: no −inf
    -804.6
    """
    ln = torch.special.log_ndtr
    tail = ln(-b.abs())  # ln Φ(b) where b ≤ 0, ln Φ(−b) where b > 0
    upper = b > 0
    high = torch.where(upper, tail, ln(a))
    low = torch.where(upper, ln(-a), tail)
    return high + torch.log1p(-torch.exp(low - high).clamp(max=1 - 1e-7))


def changepoint_score(engine: torch.Tensor, trainer: torch.Tensor, valid: torch.Tensor, centre: torch.Tensor,
                      spread: torch.Tensor, kernel: bool | None = None) -> torch.Tensor:
    """Each row's ln Λ, the log likelihood ratio of a lag that starts at some token against healthy noise.

    With ``d = engine − trainer`` and ``z = (d − μ_k)/σ_k`` on a read token of engine bucket ``k`` (healthy noise
    N(μ_k, σ_k²): ``centre`` and ``spread``), an onset at token ``τ`` with lag ``D`` gives the onset token the
    density of ``d − D`` and every later token that of ``d − g``, ``g ~ U(0.1, D)``. Each token's log density
    ratio against healthy noise:

    .. math::
        \\ell^{\\text{first}}_{t,D} = \\tfrac12 z_t^2 - \\tfrac12 (z_t - D/\\sigma_t)^2, \\qquad
        \\ell^{\\text{later}}_{t,D} = \\ln\\frac{\\Phi(z_t - 0.1/\\sigma_t) - \\Phi(z_t - D/\\sigma_t)}{D - 0.1}
            + \\ln(\\sigma_t\\sqrt{2\\pi}) + \\tfrac12 z_t^2

    and, averaging over the ``n`` read tokens as onsets and the 12 lags of :data:`LAGS`, each token's term held to at
    most ``c`` = :data:`TOKEN_CAP` (``⌊ℓ⌋ = min(ℓ, c)``),

    .. math:: \\ln\\Lambda = \\ln \\frac{1}{12\\,n} \\sum_{\\tau, D}
              \\exp\\Big(\\lfloor\\ell^{\\text{first}}_{\\tau,D}\\rfloor + \\sum_{t > \\tau}
              \\lfloor\\ell^{\\text{later}}_{t,D}\\rfloor\\Big)

    A token is read where it is in ``valid``, both logprobs are finite, the engine put it at −3 nats or above
    (below, healthy large-model tails live: :data:`ENGINE_BUCKET_EDGES`) and its bucket's ``spread`` is > 0 (0:
    not known yet). Under the noise the test assumes, E[Λ] ≤ 1 on healthy rows (1 without the cap), so
    ln Λ > ln(1/α) fires on at most α of them (Markov); the guard reads its threshold from the kept rows' scores
    instead (:func:`rollout_guard.calibration.changepoint_threshold`).

    Args:
        engine, trainer: (B, T) logprobs (nats).
        valid: (B, T) bool: tokens in the loss.
        centre, spread: (NUM_ENGINE_BUCKETS,) μ_k and σ_k (nats), on the tokens' device.
        kernel: one Triton launch (:mod:`rollout_guard._changepoint_kernel`) instead of ~40 torch kernels. Default:
            on CUDA where Triton is installed. ``True`` on the CPU only under ``TRITON_INTERPRET=1``, as the tests
            run it.
    Returns:
        (B,) float32 ln Λ; −inf for a row with no read token. In torch, scored in chunks of rows of at most
        :data:`CHUNK_ELEMENTS` rows × tokens × lags, so that its intermediates stay small on the device; the kernel
        holds a block of tokens at a time and 256 bytes of partial sums per :data:`KERNEL_CHUNK` tokens.

    >>> centre, spread = torch.zeros(4), torch.tensor([0.0, 0.3, 0.3, 0.3])
    >>> engine = torch.full((3, 40), -0.2); valid = torch.ones(3, 40, dtype=torch.bool)
    >>> healthy = engine - 0.3 * torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    >>> late = healthy.clone(); late[1, 25:] -= 0.6  # the trainer finds the last 15 tokens 0.6 nats less likely
    >>> late[2] = -9.0; late[2, 25:] = engine[2, 25:] - 0.6; engine[2, :25] = -5.0  # the same, first part unread
    >>> [round(v, 1) for v in changepoint_score(engine, late, valid, centre, spread).tolist()]
    [-14.0, 25.3, 13.6]
    >>> one = healthy[:1].clone(); one[0, 39] -= 5.0  # only the last token 5 nats off (z ≈ 17): a spike's business
    >>> round(float(changepoint_score(engine[:1], one, valid[:1], centre, spread)), 1)  # 140.2 without the cap
    6.3
    >>> changepoint_score(engine, late, valid, centre, torch.zeros(4)).tolist()  # no bucket known: nothing read
    [-inf, -inf, -inf]
    """
    if kernel is None:
        kernel = engine.is_cuda and fused_statistics.available()
    if kernel:
        return _kernel_score(engine, trainer, valid, centre, spread)
    rows = max(1, CHUNK_ELEMENTS // max(engine.shape[-1] * len(LAGS), 1))
    if engine.shape[0] <= rows:
        return _rows_score(engine, trainer, valid, centre, spread)
    return torch.cat([_rows_score(engine[i: i + rows], trainer[i: i + rows], valid[i: i + rows], centre, spread)
                      for i in range(0, engine.shape[0], rows)])


@functools.cache
def _kernels():
    """Imported on first use (so that ``TRITON_INTERPRET=1`` set before the first call is honoured)."""
    from rollout_guard._changepoint_kernel import changepoint_chunks, changepoint_combine

    return changepoint_chunks, changepoint_combine


KERNEL_BLOCK = 128  # tokens per block of a row in the kernel (× LAG_SLOTS: 2,048 values per step)
KERNEL_WARPS = 4
KERNEL_CHUNK = 1024  # tokens per program: a longer row is split over programs, their partial sums combined after
LAG_SLOTS = 16  # the kernel's lag axis: a power of two ≥ len(LAGS)
assert len(LAGS) <= LAG_SLOTS and len(ENGINE_BUCKET_EDGES) == 3, "update rollout_guard/_changepoint_kernel.py"


def _kernel_score(engine: torch.Tensor, trainer: torch.Tensor, valid: torch.Tensor, centre: torch.Tensor,
                  spread: torch.Tensor) -> torch.Tensor:
    """:func:`changepoint_score` from :mod:`rollout_guard._changepoint_kernel`: one launch where a row fits in
    :data:`KERNEL_CHUNK` tokens, else one over (row, chunk) and one that combines each row's chunks."""
    batch, length = engine.shape
    out = torch.empty(batch, dtype=torch.float32, device=engine.device)
    if batch == 0:
        return out
    if length == 0:
        return out.fill_(-math.inf)

    def rows(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.stride(-1) == 1 else tensor.contiguous()

    engine, trainer = rows(engine), rows(trainer)
    valid = rows(valid.view(torch.uint8) if valid.dtype == torch.bool else valid)
    chunk = max(KERNEL_CHUNK // KERNEL_BLOCK, 1) * KERNEL_BLOCK
    chunks = -(-length // chunk)
    partial = out if chunks == 1 else torch.empty(batch, chunks, 4, LAG_SLOTS, dtype=torch.float32,
                                                  device=engine.device)
    scores, combine = _kernels()
    scores[(batch, chunks)](
        engine, trainer, valid, centre.float().contiguous(), spread.float().contiguous(),
        _lags_on(torch.float32, str(engine.device)), partial, out, length, chunk, engine.stride(0),
        trainer.stride(0), valid.stride(0), *ENGINE_BUCKET_EDGES, MIN_GAP, TOKEN_CAP,
        NUM_LAGS=len(LAGS), LAG_SLOTS=LAG_SLOTS, BLOCK=KERNEL_BLOCK, WHOLE_ROW=chunks == 1, num_warps=KERNEL_WARPS,
    )
    if chunks > 1:
        combine[(batch,)](partial, out, chunks, NUM_LAGS=len(LAGS), LAG_SLOTS=LAG_SLOTS, num_warps=1)
    return out


def _rows_score(engine: torch.Tensor, trainer: torch.Tensor, valid: torch.Tensor, centre: torch.Tensor,
                spread: torch.Tensor) -> torch.Tensor:
    """:func:`changepoint_score` of a chunk of rows."""
    engine, trainer = engine.float(), trainer.float()
    read = valid.bool() & torch.isfinite(engine) & torch.isfinite(trainer) & (engine >= ENGINE_BUCKET_EDGES[0])
    engine = torch.where(read, engine, torch.full_like(engine, -1.0))
    trainer = torch.where(read, trainer, torch.full_like(trainer, -1.0))
    bucket = engine_bucket(engine)
    sd = spread.to(engine)[bucket]
    read &= sd > 0
    sd = torch.where(read, sd, torch.ones_like(sd))
    z = ((engine - trainer - centre.to(engine)[bucket]) / sd).unsqueeze(-1)  # (B, T, 1)
    s = sd.unsqueeze(-1)
    lags = _lags_on(engine.dtype, str(engine.device))  # (L,)
    healthy = 0.5 * z * z
    shifted = z - lags / s  # (B, T, L)
    later = (_log_ndtr_difference(z - MIN_GAP / s, shifted) - torch.log(lags - MIN_GAP) + torch.log(s)
             + _HALF_LOG_TWO_PI + healthy)
    first = (healthy - 0.5 * shifted * shifted).clamp(max=TOKEN_CAP)
    later = later.clamp(max=TOKEN_CAP)
    later = torch.where(read.unsqueeze(-1), later, torch.zeros_like(later))
    after = later.flip(1).cumsum(1).flip(1) - later  # Σ over the read tokens after each one
    total = torch.where(read.unsqueeze(-1), first + after, torch.full_like(first, -math.inf))
    count = read.sum(-1).float() * len(LAGS)
    score = torch.logsumexp(total.flatten(1), dim=-1) - torch.log(count.clamp(min=1.0))
    return torch.where(count > 0, score, torch.full_like(score, -math.inf))
