"""The Triton source of :func:`rollout_guard.changepoint.changepoint_score` on CUDA (imported on first use, so that
``TRITON_INTERPRET=1`` set before then runs it in Triton's interpreter). One program per (row, chunk of
``chunk_tokens``) walks its tokens once in blocks of ``BLOCK``; where a row has more than one chunk, a second launch
combines each row's partial sums. The score's ~40 torch kernels (each a launch and a pass over a B × T × 12 tensor)
become one or two launches that read each token once.

The torch form sums each lag's later-token ratios after every onset with a reversed cumulative sum. Here the walk
is forward: with ``P_D(τ)`` the sum over read tokens up to and including ``τ`` and ``P_D`` the row's total,
``Σ_{t>τ} ℓ_{t,D} = P_D − P_D(τ)``, so each lag keeps a running log-sum-exp of ``ℓ^first_{τ,D} − P_D(τ)`` and adds
``P_D`` at the row's end (float32 sums in another order: on an H200 the two forms agreed to 1.4e-5 relative at
512 × 16,384 tokens). A chunk's running sums start at 0; its values are the row's less ``P_D`` of the chunks before
it, which the combining pass adds back.
"""

import triton
import triton.language as tl


@triton.jit
def _log_ndtr_lower(x):
    # ln Φ(x) for x ≤ 0, from a Chebyshev fit of erfc in log space (Numerical Recipes' erfcc, fractional error
    # < 1.2e-7 for every argument), so the far lower tail does not underflow: ln Φ(x) = ln ½ erfc(−x/√2)
    z = -x * 0.7071067811865476
    t = tl.fdiv(1.0, 1.0 + 0.5 * z, ieee_rounding=False)
    fit = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    return tl.log(t) - z * z + fit - 0.6931471805599453


@triton.jit
def _log_ndtr(x):
    # ln Φ(x) for any x: ln(1 − Φ(−x)) above 0
    lower = _log_ndtr_lower(-tl.abs(x))
    return tl.where(x < 0, lower, tl.log(1.0 - tl.exp(lower)))


@triton.jit
def _score(total, best, summed, count, used, NUM_LAGS: tl.constexpr):
    # ln Λ = ln Σ_D exp(P_D + ln Σ_τ exp(ℓ^first_{τ,D} − P_D(τ))) − ln(12 n); −inf where nothing was read
    inf = float("inf")
    per_lag = tl.where(used & (summed > 0), total + best + tl.log(summed), -inf)
    top = tl.max(per_lag, axis=0)
    anchor = tl.where(top == -inf, 0.0, top)
    score = anchor + tl.log(tl.sum(tl.exp(per_lag - anchor), axis=0)) - tl.log(count.to(tl.float32) * NUM_LAGS)
    return tl.where(count > 0, score, -inf)


@triton.jit
def changepoint_chunks(
    engine_ptr, trainer_ptr, mask_ptr, centre_ptr, spread_ptr, lags_ptr, partial_ptr, out_ptr,
    length, chunk_tokens, engine_stride, trainer_stride, mask_stride, edge0, edge1, edge2, min_gap, token_cap,
    NUM_LAGS: tl.constexpr, LAG_SLOTS: tl.constexpr, BLOCK: tl.constexpr, WHOLE_ROW: tl.constexpr,
):
    # program (row, chunk): the chunk's tokens [chunk · chunk_tokens, …); with WHOLE_ROW (one chunk a row) it
    # writes the row's score, else its partial sums (Σ ℓ^later per lag, the running log-sum-exp's maximum and sum,
    # the read tokens) for changepoint_combine
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    begin = chunk * chunk_tokens
    end = tl.minimum(begin + chunk_tokens, length)
    offsets = tl.arange(0, BLOCK)
    slots = tl.arange(0, LAG_SLOTS)
    used = slots < NUM_LAGS
    lag = tl.load(lags_ptr + slots, mask=used, other=2.0)[None, :]  # (1, LAG_SLOTS): a padded slot is never read
    log_width = tl.log(lag - min_gap)
    centre0 = tl.load(centre_ptr + 0)
    centre1 = tl.load(centre_ptr + 1)
    centre2 = tl.load(centre_ptr + 2)
    centre3 = tl.load(centre_ptr + 3)
    spread0 = tl.load(spread_ptr + 0)
    spread1 = tl.load(spread_ptr + 1)
    spread2 = tl.load(spread_ptr + 2)
    spread3 = tl.load(spread_ptr + 3)
    inf = float("inf")

    carry = tl.zeros([LAG_SLOTS], dtype=tl.float32)  # P_D of the chunk's tokens before this block
    best = tl.zeros([LAG_SLOTS], dtype=tl.float32) - inf  # the running log-sum-exp's maximum
    summed = tl.zeros([LAG_SLOTS], dtype=tl.float32)  # and its Σ exp(· − maximum)
    count = tl.zeros([], dtype=tl.int32)
    for start in range(begin, end, BLOCK):
        position = start + offsets
        inside = position < end
        valid = tl.load(mask_ptr + row * mask_stride + position, mask=inside, other=0) != 0
        engine = tl.load(engine_ptr + row * engine_stride + position, mask=inside, other=-1.0).to(tl.float32)
        trainer = tl.load(trainer_ptr + row * trainer_stride + position, mask=inside, other=-1.0).to(tl.float32)
        finite = (engine == engine) & (tl.abs(engine) != inf) & (trainer == trainer) & (tl.abs(trainer) != inf)
        # torch.bucketize(right=True) over the edges: the number of edges at or below the engine logprob
        bucket = (engine >= edge0).to(tl.int32) + (engine >= edge1).to(tl.int32) + (engine >= edge2).to(tl.int32)
        centre = tl.where(bucket == 3, centre3, tl.where(bucket == 2, centre2, tl.where(bucket == 1, centre1,
                                                                                        centre0)))
        spread = tl.where(bucket == 3, spread3, tl.where(bucket == 2, spread2, tl.where(bucket == 1, spread1,
                                                                                        spread0)))
        read = valid & finite & (bucket > 0) & (spread > 0)
        spread = tl.where(read, spread, 1.0)
        inverse = 1.0 / spread
        z = tl.where(read, (engine - trainer - centre) * inverse, 0.0)
        # per token: ln Φ(a) and ln Φ(−a) at the upper end a = z − 0.1/σ, and what the log density ratio adds
        upper_end = z - min_gap * inverse
        log_upper = _log_ndtr(upper_end)[:, None]
        log_upper_tail = _log_ndtr(-upper_end)[:, None]
        healthy = (0.5 * z * z)[:, None]
        offset = (tl.log(spread) + 0.9189385332046727)[:, None] + healthy - log_width  # ln(σ√(2π)) + z²/2 − ln(D − 0.1)
        # per token and lag: the lower end b = z − D/σ; ln(Φ(a) − Φ(b)) from the side of the smaller tail, as
        # rollout_guard.changepoint._log_ndtr_difference computes it (one ln Φ per element, at −|b| ≤ 0)
        shifted = z[:, None] - lag * inverse[:, None]  # (BLOCK, LAG_SLOTS)
        tail = _log_ndtr_lower(-tl.abs(shifted))
        beyond = shifted > 0
        high = tl.where(beyond, tail, log_upper)
        low = tl.where(beyond, log_upper_tail, tail)
        # each token's ratio held to at most e^token_cap (rollout_guard.changepoint.TOKEN_CAP)
        later = tl.minimum(high + tl.log(1.0 - tl.minimum(tl.exp(low - high), 1.0 - 1e-7)) + offset, token_cap)
        first = tl.minimum(healthy - 0.5 * shifted * shifted, token_cap)
        counted = read[:, None] & used[None, :]
        later = tl.where(counted, later, 0.0)
        through = tl.cumsum(later, axis=0) + carry[None, :]  # P_D(τ)
        value = tl.where(counted, first - through, -inf)
        top = tl.maximum(best, tl.max(value, axis=0))
        anchor = tl.where(top == -inf, 0.0, top)
        summed = summed * tl.exp(best - anchor) + tl.sum(tl.exp(value - anchor[None, :]), axis=0)
        best = top
        carry += tl.sum(later, axis=0)
        count += tl.sum(read.to(tl.int32), axis=0)

    if WHOLE_ROW:
        tl.store(out_ptr + row, _score(carry, best, summed, count, used, NUM_LAGS))
    else:
        at = partial_ptr + (row * chunks + chunk) * (4 * LAG_SLOTS) + slots
        tl.store(at, carry)
        tl.store(at + LAG_SLOTS, best)
        tl.store(at + 2 * LAG_SLOTS, summed)
        tl.store(at + 3 * LAG_SLOTS, count.to(tl.float32) + 0.0 * carry)


@triton.jit
def changepoint_combine(partial_ptr, out_ptr, chunks, NUM_LAGS: tl.constexpr, LAG_SLOTS: tl.constexpr):
    # one program per row: a chunk's values are the row's less P_D of the chunks before it, so each lag's
    # log-sum-exp takes the chunk's (maximum − that offset, sum); the offsets add up to the row's P_D
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, LAG_SLOTS)
    used = slots < NUM_LAGS
    inf = float("inf")
    before = tl.zeros([LAG_SLOTS], dtype=tl.float32)
    best = tl.zeros([LAG_SLOTS], dtype=tl.float32) - inf
    summed = tl.zeros([LAG_SLOTS], dtype=tl.float32)
    count = tl.zeros([], dtype=tl.int32)
    for chunk in range(0, chunks):
        at = partial_ptr + (row * chunks + chunk) * (4 * LAG_SLOTS) + slots
        shifted = tl.load(at + LAG_SLOTS) - before
        part = tl.load(at + 2 * LAG_SLOTS)
        top = tl.maximum(best, shifted)
        anchor = tl.where(top == -inf, 0.0, top)
        summed = summed * tl.exp(best - anchor) + part * tl.exp(shifted - anchor)
        best = top
        before += tl.load(at)
        count += tl.max(tl.load(at + 3 * LAG_SLOTS), axis=0).to(tl.int32)
    tl.store(out_ptr + row, _score(before, best, summed, count, used, NUM_LAGS))
