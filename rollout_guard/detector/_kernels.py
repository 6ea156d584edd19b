"""The Triton source of :mod:`rollout_guard.detector.fused` (imported on first use, so that ``TRITON_INTERPRET=1`` set
before then runs it in Triton's interpreter). One program per row; what each kernel computes, and the torch
reference it equals, is in :mod:`rollout_guard.detector.fused`."""

import triton
import triton.language as tl


@triton.jit
def _bucket(v, edges_ptr, N_EDGES: tl.constexpr, STEPS: tl.constexpr):
    """The number of edges ≤ v (``torch.bucketize(v, edges, right=True)``), by binary search over sorted edges."""
    lo = tl.zeros(v.shape, tl.int32)
    hi = tl.full(v.shape, N_EDGES, tl.int32)
    for _ in tl.static_range(STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        below = tl.load(edges_ptr + tl.minimum(mid, N_EDGES - 1)) <= v
        lo = tl.where(active & below, mid + 1, lo)
        hi = tl.where(active & ~below, mid, hi)
    return lo


@triton.jit
def _region(engine, E0, E1, E2):
    """The confidence region of an engine logprob (score.REGION_EDGES: E0 < E1 < E2)."""
    return (engine >= E0).to(tl.int32) + (engine >= E1).to(tl.int32) + (engine >= E2).to(tl.int32)


@triton.jit
def _load_row(engine_ptr, trainer_ptr, mask_ptr, row, offsets, length, stride_e, stride_t, stride_m):
    inside = offsets < length
    engine = tl.load(engine_ptr + row * stride_e + offsets, mask=inside, other=0.0).to(tl.float32)
    trainer = tl.load(trainer_ptr + row * stride_t + offsets, mask=inside, other=0.0).to(tl.float32)
    valid = (tl.load(mask_ptr + row * stride_m + offsets, mask=inside, other=0) != 0) & inside
    return engine, trainer, valid


@triton.jit
def token_histograms(engine_ptr, trainer_ptr, mask_ptr, reasons_ptr, counts_ptr, delta_ptr, length,
                     stride_e, stride_t, stride_m, edges_ptr, delta_edges_ptr, E0, E1, E2,
                     N_EDGES: tl.constexpr, STEPS: tl.constexpr, N_DELTA_EDGES: tl.constexpr,
                     DELTA_STEPS: tl.constexpr, COUNT_BINS: tl.constexpr, DELTA_BINS: tl.constexpr,
                     KEPT_ONLY: tl.constexpr, WITH_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    """Add one row's read tokens to the region × ``d`` histogram (``counts``, NUM_REGIONS·NUM_BINS, float32) and,
    with WITH_DELTA, their |Δ| to the statistics' histogram (``delta``, NUM_DELTA_BINS, float32); with KEPT_ONLY,
    only a row whose verdict (``reasons``) is 0."""
    row = tl.program_id(0).to(tl.int64)
    if KEPT_ONLY:  # a suspect row reads no token
        length = tl.where(tl.load(reasons_ptr + row) != 0, 0, length)
    n_bins = N_EDGES + 1
    local = tl.zeros((COUNT_BINS,), tl.float32)
    local_delta = tl.zeros((DELTA_BINS,), tl.float32)
    for start in range(0, length, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        engine, trainer, valid = _load_row(engine_ptr, trainer_ptr, mask_ptr, row, offsets, length,
                                           stride_e, stride_t, stride_m)
        read = valid & (tl.abs(engine) < float("inf")) & (tl.abs(trainer) < float("inf"))
        delta = tl.where(read, engine - trainer, 0.0)
        region = _region(tl.where(read, engine, 0.0), E0, E1, E2)
        index = tl.where(read, region * n_bins + _bucket(delta, edges_ptr, N_EDGES, STEPS), COUNT_BINS - 1)
        local += tl.histogram(index, COUNT_BINS).to(tl.float32)
        if WITH_DELTA:
            bins = tl.maximum(_bucket(tl.abs(delta), delta_edges_ptr, N_DELTA_EDGES, DELTA_STEPS) - 1, 0)
            local_delta += tl.histogram(tl.where(read, bins, DELTA_BINS - 1), DELTA_BINS).to(tl.float32)
    slots = tl.arange(0, COUNT_BINS)
    used = slots < 4 * n_bins  # the last slot collects the tokens that are not read
    tl.atomic_add(counts_ptr + slots, local, mask=used & (local > 0))
    if WITH_DELTA:
        delta_slots = tl.arange(0, DELTA_BINS)
        tl.atomic_add(delta_ptr + delta_slots, local_delta, mask=(delta_slots < N_DELTA_EDGES) & (local_delta > 0))


@triton.jit
def _cdf(at, region, side, below_ptr, edges_ptr, N_EDGES: tl.constexpr, STEPS: tl.constexpr):
    """Counts at or below ``at`` in region ``region`` of table ``side`` (noise._cdf: linear within a bin, an open
    bin's mass at its edge); ``below``: (2, NUM_REGIONS, NUM_BINS + 1) cumulative counts."""
    k = _bucket(at, edges_ptr, N_EDGES, STEPS)
    last = N_EDGES - 1
    lo = tl.load(edges_ptr + tl.minimum(tl.maximum(k - 1, 0), last))
    hi = tl.load(edges_ptr + tl.minimum(k, last))
    inner = (k > 0) & (k <= last)
    share = tl.where(inner, tl.minimum(tl.maximum((at - lo) / tl.where(inner, hi - lo, 1.0), 0.0), 1.0),
                     (k >= N_EDGES).to(tl.float32))
    base = below_ptr + (side * 4 + region) * (N_EDGES + 2) + k
    before = tl.load(base)
    return before + (tl.load(base + 1) - before) * share


@triton.jit
def _logaddexp(a, b):
    top = tl.maximum(a, b)
    safe = tl.where(top == -float("inf"), 0.0, top)
    return safe + tl.log(tl.exp(a - safe) + tl.exp(b - safe))


@triton.jit
def _token_terms(engine, trainer, valid, centre_ptr, scale_ptr, below_ptr, centre_mass_ptr, lags, lag_ok,
                 edges_ptr, E0, E1, E2, N_EDGES: tl.constexpr, STEPS: tl.constexpr):
    """Per token of a block: whether it is read, and the (BLOCK, LAG_BLOCK) capped engine-favouring and
    trainer-favouring lag log ratios and the later-token log ratio (score.py)."""
    read = valid & (tl.abs(engine) < float("inf")) & (tl.abs(trainer) < float("inf"))
    engine_read = tl.where(read, engine, 0.0)
    delta = tl.where(read, engine - trainer, 0.0)
    region = _region(engine_read, E0, E1, E2)
    centre = tl.load(centre_ptr + region)
    x = tl.where(read, delta - centre, 0.0)
    b = tl.where(read, tl.load(scale_ptr + region), 1.0)
    # the cap: how rare the other side shows the distance |x| (tail_rarity); engine-favouring: table 0 (the run's
    # and this batch's d), else table 1 (the kept state's d mirrored, its centre negated)
    up = x > 0
    side = tl.where(up, 0, 1)
    centre_side = tl.where(up, centre, -centre)
    beyond = _cdf(centre_side - tl.abs(x), region, side, below_ptr, edges_ptr, N_EDGES, STEPS)
    mass = tl.load(centre_mass_ptr + side * 4 + region)
    cap = tl.where(beyond > 0, tl.log(mass / tl.where(beyond > 0, beyond, 1.0)), float("inf"))
    xs = x[:, None]
    bs = b[:, None]
    caps = cap[:, None]
    first = tl.minimum((tl.abs(xs) - tl.abs(xs - lags)) / bs, caps)
    down = tl.minimum((tl.abs(xs) - tl.abs(xs + lags)) / bs, caps)
    inside = tl.minimum(tl.maximum(xs, 0.0), lags)
    edge = tl.log(1.0 - tl.exp(-lags / bs))
    middle = inside / bs + tl.log(tl.maximum(2.0 - tl.exp(-inside / bs) - tl.exp((inside - lags) / bs), 1e-30))
    body = tl.where(xs <= 0, edge, tl.where(xs >= lags, lags / bs + edge, middle))
    later = tl.log(bs / lags) + body
    counted = read[:, None] & lag_ok
    later = tl.where(counted, later, 0.0)
    first = tl.where(counted, first, -float("inf"))
    down = tl.where(counted, down, -float("inf"))
    return read, first, down, later


@triton.jit
def _lse_lags(values):
    """Per token, ln Σ_lags exp(values) (−inf where every value is −inf)."""
    top = tl.max(values, axis=1)
    safe = tl.where(top == -float("inf"), 0.0, top)
    return safe + tl.log(tl.sum(tl.exp(values - safe[:, None]), axis=1))


@triton.jit
def judge_rows(engine_ptr, trainer_ptr, mask_ptr, injected_ptr, samples_ptr, reasons_ptr, score_ptr, onset_ptr, length,
               stride_e, stride_t, stride_m, centre_ptr, scale_ptr, below_ptr, centre_mass_ptr, lags_ptr,
               edges_ptr, E0, E1, E2, threshold, ceiling, ln_engine, ln_trainer,
               N_EDGES: tl.constexpr, STEPS: tl.constexpr, NUM_LAGS: tl.constexpr, LAG_BLOCK: tl.constexpr,
               HAS_CEILING: tl.constexpr, HAS_INJECTED: tl.constexpr, WIDTH: tl.constexpr,
               BLOCK: tl.constexpr):
    """One row's score, onset, excess, verdict bits and statistics (fused.ROW_COLUMNS order, ``samples`` row of
    WIDTH float32): a forward pass for the counts, sums and maxima, a backward one for the onset mixture (each
    token's later-token sum is a suffix sum) and the sparse alternative."""
    row = tl.program_id(0).to(tl.int64)
    lag_index = tl.arange(0, LAG_BLOCK)
    lag_ok = (lag_index < NUM_LAGS)[None, :]
    lags = tl.load(lags_ptr + lag_index, mask=lag_index < NUM_LAGS, other=1.0)[None, :]
    inf = float("inf")
    # forward: counts, sums and maxima
    tokens = 0.0
    compared = 0.0
    abs_sum = 0.0
    abs_max = -inf
    ratio_sum = 0.0
    k3_sum = 0.0
    engine_max = -inf
    engine_sum = 0.0
    engine_count = 0.0
    trainer_max = -inf
    trainer_sum = 0.0
    trainer_count = 0.0
    excess = -inf
    over_ceiling = tl.full((), 0, tl.int32)
    for start in range(0, length, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        engine, trainer, valid = _load_row(engine_ptr, trainer_ptr, mask_ptr, row, offsets, length,
                                           stride_e, stride_t, stride_m)
        engine_ok = valid & (tl.abs(engine) < inf)
        trainer_ok = valid & (tl.abs(trainer) < inf)
        read = engine_ok & trainer_ok
        log_ratio = tl.where(read, trainer - engine, 0.0)
        capped = tl.minimum(log_ratio, 30.0)
        tokens += tl.sum(valid.to(tl.float32), axis=0)
        compared += tl.sum(read.to(tl.float32), axis=0)
        abs_sum += tl.sum(tl.abs(log_ratio), axis=0)
        abs_max = tl.maximum(abs_max, tl.max(tl.where(read, tl.abs(log_ratio), -inf), axis=0))
        ratio_sum += tl.sum(log_ratio, axis=0)
        k3_sum += tl.sum(tl.where(read, tl.exp(capped) - 1.0 - capped, 0.0), axis=0)
        engine_max = tl.maximum(engine_max, tl.max(tl.where(engine_ok, engine, -inf), axis=0))
        engine_sum += tl.sum(tl.where(engine_ok, engine, 0.0), axis=0)
        engine_count += tl.sum(engine_ok.to(tl.float32), axis=0)
        trainer_max = tl.maximum(trainer_max, tl.max(tl.where(trainer_ok, trainer, -inf), axis=0))
        trainer_sum += tl.sum(tl.where(trainer_ok, trainer, 0.0), axis=0)
        trainer_count += tl.sum(trainer_ok.to(tl.float32), axis=0)
        region = _region(tl.where(read, engine, 0.0), E0, E1, E2)
        x = tl.where(read, engine - trainer - tl.load(centre_ptr + region), 0.0)
        b = tl.load(scale_ptr + region)
        excess = tl.maximum(excess, tl.max(tl.where(read, x / b, -inf), axis=0))
        if HAS_CEILING:
            over_ceiling = tl.maximum(over_ceiling, tl.max((read & (tl.abs(log_ratio) > ceiling)).to(tl.int32), axis=0))
    n = tl.maximum(compared, 1.0)
    log_n = tl.log(n)
    pi = tl.minimum(1.0 / n, 1.0 - 1e-7)
    log_pi = -log_n
    log_rest = tl.where(pi < 0.01, -pi - pi * pi / 2 - pi * pi * pi / 3, tl.log(1.0 - pi))  # ln(1 − π), accurate
    # backward: the onset mixture's terms and the sparse alternative
    carry = tl.zeros((LAG_BLOCK,), tl.float32)  # Σ later-token log ratios of the read tokens after this block
    onset_top = -inf  # running log-sum-exp of every onset term: its max and the sum scaled by it
    onset_sum = 0.0
    best_onset = -inf
    best_onset_at = -1
    best_token = -inf
    best_token_at = -1
    sparse = 0.0
    last_start = ((length + BLOCK - 1) // BLOCK - 1) * BLOCK
    for back in range(0, length, BLOCK):
        start = last_start - back
        offsets = start + tl.arange(0, BLOCK)
        engine, trainer, valid = _load_row(engine_ptr, trainer_ptr, mask_ptr, row, offsets, length,
                                           stride_e, stride_t, stride_m)
        read, first, down, later = _token_terms(
            engine, trainer, valid, centre_ptr, scale_ptr, below_ptr, centre_mass_ptr, lags, lag_ok, edges_ptr,
            E0, E1, E2, N_EDGES, STEPS)
        after = carry[None, :] + tl.cumsum(later, axis=0, reverse=True) - later
        carry += tl.sum(later, axis=0)
        terms = tl.where(read[:, None] & lag_ok, first + after, -inf)
        per_token = _lse_lags(terms)  # (BLOCK,)
        top = tl.max(per_token, axis=0)
        new_top = tl.maximum(onset_top, top)
        safe = tl.where(new_top == -inf, 0.0, new_top)
        onset_sum = onset_sum * tl.exp(onset_top - safe) + tl.sum(tl.exp(per_token - safe), axis=0)
        onset_top = new_top
        better = (top >= best_onset) & (top > -inf)  # backwards, so ≥ keeps the earliest of equal tokens
        best_onset_at = tl.where(better, start + tl.argmax(per_token, axis=0), best_onset_at)
        best_onset = tl.where(better, top, best_onset)
        log_m = _logaddexp(_lse_lags(first) + ln_engine, _lse_lags(down) + ln_trainer) - tl.log(NUM_LAGS * 1.0)
        log_m = tl.where(read, log_m, -inf)
        top_m = tl.max(log_m, axis=0)
        better = (top_m >= best_token) & (top_m > -inf)
        best_token_at = tl.where(better, start + tl.argmax(log_m, axis=0), best_token_at)
        best_token = tl.where(better, top_m, best_token)
        sparse += tl.sum(tl.where(read, _logaddexp(log_rest + tl.zeros_like(log_m), log_pi + log_m), 0.0), axis=0)
    safe_top = tl.where(onset_top == -inf, 0.0, onset_top)
    log_onset = safe_top + tl.log(onset_sum) - log_n - tl.log(NUM_LAGS * 1.0)
    score = _logaddexp(log_onset, sparse) - 0.6931471805599453
    has = compared > 0
    onset = tl.where(sparse > log_onset, best_token_at, best_onset_at)
    onset = tl.where(has, onset, -1)
    nan = float("nan")
    at_onset = tl.maximum(onset, 0).to(tl.int64)
    onset_engine = tl.load(engine_ptr + row * stride_e + at_onset).to(tl.float32)
    onset_trainer = tl.load(trainer_ptr + row * stride_t + at_onset).to(tl.float32)
    onset_scale = tl.load(scale_ptr + _region(onset_engine, E0, E1, E2))
    engine_nonfinite = tokens - engine_count
    trainer_nonfinite = tokens - trainer_count
    reasons = ((engine_nonfinite > 0).to(tl.int32) | (trainer_nonfinite > 0).to(tl.int32) * 2
               | over_ceiling * 4 | (has & (score > threshold)).to(tl.int32) * 8)
    tl.store(reasons_ptr + row, reasons)
    tl.store(score_ptr + row, tl.where(has, score, -inf))
    tl.store(onset_ptr + row, onset.to(tl.int64))
    out = samples_ptr + row * WIDTH
    injected = nan
    if HAS_INJECTED:
        injected = tl.load(injected_ptr + row).to(tl.float32)
    tl.store(out + 0, tokens)
    tl.store(out + 1, compared)
    tl.store(out + 2, tl.where(has, abs_max, nan))
    tl.store(out + 3, tl.where(has, abs_sum / n, nan))
    tl.store(out + 4, tl.where(has, ratio_sum, nan))
    tl.store(out + 5, tl.where(has, k3_sum / n, nan))
    tl.store(out + 6, tl.where(engine_count > 0, engine_max, nan))
    tl.store(out + 7, tl.where(engine_count > 0, engine_sum / tl.maximum(engine_count, 1.0), nan))
    tl.store(out + 8, tl.where(trainer_count > 0, trainer_max, nan))
    tl.store(out + 9, tl.where(trainer_count > 0, trainer_sum / tl.maximum(trainer_count, 1.0), nan))
    tl.store(out + 10, engine_nonfinite)
    tl.store(out + 11, trainer_nonfinite)
    tl.store(out + 12, injected)
    tl.store(out + 13, tl.where(has, score, nan))
    tl.store(out + 14, onset.to(tl.float32))
    tl.store(out + 15, tl.where(has, onset_engine, nan))
    tl.store(out + 16, tl.where(has, onset_trainer, nan))
    tl.store(out + 17, tl.where(has, onset_scale, nan))
    tl.store(out + 18, tl.where(has, excess, nan))
