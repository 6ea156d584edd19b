"""The Triton source of :mod:`rollout_guard.detector.fused` (imported on first use, so that ``TRITON_INTERPRET=1`` set
before then runs it in Triton's interpreter). What each kernel computes, and the torch reference it equals, is in
:mod:`rollout_guard.detector.fused`.

Two passes over the tokens, each a grid of (row, chunk) programs, with one small program between them:
:func:`token_pass` (the histograms and each chunk's counts, sums and maxima), :func:`noise_tables` (the noise, one
program) and :func:`score_pass` (each chunk's score terms; the last chunk of a row to finish combines the row, the last
row the batch). :func:`learn` is one program. "The last program" is found with an atomic ticket taken after a
barrier; what it reads of the other programs' results it loads from L2 (``.cg``), where their atomics and stores
land."""

import triton
import triton.language as tl

# fp64 constants (fused.CONSTANTS order, then EARLY_TOKENS): a Python float in a kernel is a float32 constant
C_E, C_TINY300, C_TINY30, C_FLOOR, C_PRIOR_SCALE, C_PRIOR_TOKENS, C_CENTRE_TOKENS, C_MIN_TAIL, C_WINDOW, \
    C_CENTRE_PRIOR, C_EARLY_TOKENS = (tl.constexpr(i) for i in range(11))
# per-(row, chunk) partials, PART floats each: token_pass's (A_*), then score_pass's (S_*: three blocks of LAG_BLOCK
# lanes, the later-token sums, the onset terms' maxima and their sums of exp scaled by the maxima; single values)
A_TOKENS, A_COMPARED, A_ABS_SUM, A_ABS_MAX, A_RATIO_SUM, A_K3_SUM, A_ENGINE_MAX, A_ENGINE_SUM, A_ENGINE_COUNT, \
    A_TRAINER_MAX, A_TRAINER_SUM, A_TRAINER_COUNT, A_CEILING, A_TOLERANCE = (tl.constexpr(i) for i in range(14))
S_LATER, S_TOP, S_SCALED, S_EXCESS, S_SPARSE, S_BEST, S_BEST_AT = (tl.constexpr(i) for i in (0, 8, 16, 24, 25, 26, 27))


# --- shared helpers ---------------------------------------------------------------------------------------------

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
def _edge_bucket(v, edges_ptr):
    """``torch.bucketize(v, noise.EDGES, right=True)`` without a search: the count of positive edges at or below
    ``|v|`` read off their spacing (0.01 apart up to 0.5, 0.05 apart up to 2, four per octave up to 64; asserted in
    fused), then corrected by one comparison each way (float rounding moves the guess by at most one)."""
    a = tl.abs(v)
    octaves = tl.log2(tl.maximum(a, 2.0) * 0.5)
    guess = tl.where(a < 0.5, a * 100.0, tl.where(a < 2.0, 50.0 + (a - 0.5) * 20.0, 80.0 + 4.0 * octaves))
    at_most = tl.minimum(tl.maximum(tl.floor(guess), 0.0), 100.0).to(tl.int32)  # positive edge j: edges[101 + j]
    at_most = tl.where((at_most < 100) & (tl.load(edges_ptr + 101 + tl.minimum(at_most, 99)) <= a),
                       at_most + 1, at_most)
    at_most = tl.where((at_most > 0) & (tl.load(edges_ptr + 100 + at_most) > a), at_most - 1, at_most)
    below = at_most - ((at_most > 0) & (tl.load(edges_ptr + 100 + at_most) == a)).to(tl.int32)  # edges < |v|
    return tl.where(v < 0, 100 - below, 101 + at_most)


@triton.jit
def _region(engine, E0, E1, E2):
    """The confidence region of an engine logprob (score.REGION_EDGES: E0 < E1 < E2)."""
    return (engine >= E0).to(tl.int32) + (engine >= E1).to(tl.int32) + (engine >= E2).to(tl.int32)


@triton.jit
def _load_row(engine_ptr, trainer_ptr, mask_ptr, row, offsets, end, stride_e, stride_t, stride_m):
    inside = offsets < end
    engine = tl.load(engine_ptr + row * stride_e + offsets, mask=inside, other=0.0).to(tl.float32)
    trainer = tl.load(trainer_ptr + row * stride_t + offsets, mask=inside, other=0.0).to(tl.float32)
    valid = (tl.load(mask_ptr + row * stride_m + offsets, mask=inside, other=0) != 0) & inside
    return engine, trainer, valid


@triton.jit
def _read(engine, trainer, valid):
    return valid & (tl.abs(engine) < float("inf")) & (tl.abs(trainer) < float("inf"))


@triton.jit
def _region_bins(engine, trainer, read, edges_ptr, E0, E1, E2, N_EDGES: tl.constexpr,
                 COUNT_BINS: tl.constexpr):
    """Each read token's slot of the region × ``d`` histogram (region · NUM_BINS + bin), the spare last slot else."""
    delta = tl.where(read, engine - trainer, 0.0)
    region = _region(tl.where(read, engine, 0.0), E0, E1, E2)
    return tl.where(read, region * (N_EDGES + 1) + _edge_bucket(delta, edges_ptr), COUNT_BINS - 1)


# --- the noise: fp64 arithmetic on the (NUM_REGIONS, NUM_BINS) histograms (noise.py) -----------------------------
# Histogram rows live in an fp64 scratch, one slot of 2 · BINS values each: the counts, then the cumulative counts
# with a leading 0. The functions below analyse several slots at once: ``slot`` is a (ROWS, 1) tensor of slots.

@triton.jit
def _cdf64(scratch_ptr, slot, at, edges64_ptr, N_EDGES: tl.constexpr, STEPS: tl.constexpr, BINS: tl.constexpr):
    """noise._cdf of each slot's histogram at its row of ``at`` (fp64, (ROWS, K)): counts at or below each point,
    linear within a bin, an open bin's mass at its edge."""
    k = _bucket(at, edges64_ptr, N_EDGES, STEPS)
    last = N_EDGES - 1
    lo = tl.load(edges64_ptr + tl.minimum(tl.maximum(k - 1, 0), last))
    hi = tl.load(edges64_ptr + tl.minimum(k, last))
    inner = (k > 0) & (k <= last)
    share = tl.where(inner, tl.minimum(tl.maximum((at - lo) / tl.where(inner, hi - lo, 1.0), 0.0), 1.0),
                     (k >= N_EDGES).to(tl.float64))
    base = scratch_ptr + slot * 2 * BINS
    return tl.load(base + BINS + k) + tl.load(base + k) * share


@triton.jit
def _inverse_cdf64(scratch_ptr, slot, mass, edges64_ptr, N_EDGES: tl.constexpr, BINS: tl.constexpr):
    """noise._inverse_cdf of each slot's histogram: (ROWS,) the point with ``mass`` (ROWS,) counts at or below it."""
    n_bins = N_EDGES + 1
    last = N_EDGES - 1
    j = tl.arange(0, BINS)[None, :]
    base = scratch_ptr + slot * 2 * BINS  # (ROWS, 1)
    cum = tl.load(base + BINS + 1 + j, mask=j < n_bins, other=0.0)
    k = tl.minimum(tl.sum(((cum < mass[:, None]) & (j < n_bins)).to(tl.int32), axis=1), n_bins - 1)  # (ROWS,)
    base = scratch_ptr + tl.sum(slot, axis=1) * 2 * BINS  # (ROWS,)
    before = tl.load(base + BINS + k)
    inside = tl.load(base + k)
    lo = tl.load(edges64_ptr + tl.minimum(tl.maximum(k - 1, 0), last))
    hi = tl.load(edges64_ptr + tl.minimum(k, last))
    inner = (k > 0) & (k <= last)
    tiny = tl.load(edges64_ptr + N_EDGES + C_TINY300)
    share = tl.minimum(tl.maximum((mass - before) / tl.maximum(inside, tiny), 0.0), 1.0)
    return tl.where(inner, lo + share * (hi - lo), tl.where(k == 0, hi, lo))


@triton.jit
def _total64(scratch_ptr, slot, N_EDGES: tl.constexpr, BINS: tl.constexpr):
    j = tl.arange(0, BINS)[None, :]
    return tl.sum(tl.load(scratch_ptr + slot * 2 * BINS + j, mask=j < N_EDGES + 1, other=0.0), axis=1)


@triton.jit
def _centre64(scratch_ptr, slot, edges64_ptr, CAND_LO: tl.constexpr, N_CAND: tl.constexpr, N_EDGES: tl.constexpr,
              STEPS: tl.constexpr, BINS: tl.constexpr):
    """noise.centre_of each slot's histogram, (ROWS,)."""
    consts = edges64_ptr + N_EDGES
    i = tl.arange(0, BINS)[None, :]
    ok = i < N_CAND
    at = tl.load(edges64_ptr + CAND_LO + i, mask=ok, other=0.0) + tl.zeros(slot.shape, tl.float64)  # (ROWS, BINS)
    window = tl.load(consts + C_WINDOW)
    low = _cdf64(scratch_ptr, slot, at - window, edges64_ptr, N_EDGES, STEPS, BINS)
    high = _cdf64(scratch_ptr, slot, at + window, edges64_ptr, N_EDGES, STEPS, BINS)
    value = tl.log(tl.maximum(high - low, tl.load(consts + C_TINY30))) - tl.abs(at) / tl.load(consts + C_CENTRE_PRIOR)
    best = tl.argmax(tl.where(ok, value, -float("inf")), axis=1)[:, None]
    low = tl.sum(tl.where(i == best, low, 0.0), axis=1)
    high = tl.sum(tl.where(i == best, high, 0.0), axis=1)
    centre = _inverse_cdf64(scratch_ptr, slot, 0.5 * (low + high), edges64_ptr, N_EDGES, BINS)
    return tl.where(_total64(scratch_ptr, slot, N_EDGES, BINS) > 0, centre, 0.0)


@triton.jit
def _scale64(scratch_ptr, slot, centre, min_tail, edges64_ptr, ZERO: tl.constexpr, N_EDGES: tl.constexpr,
             STEPS: tl.constexpr, BINS: tl.constexpr):
    """noise.tail_scale of each slot's histogram about its ``centre`` (ROWS,): the tail fit over the positive edges'
    depths with at least ``min_tail`` tokens beyond."""
    consts = edges64_ptr + N_EDGES
    i = tl.arange(0, BINS)[None, :]
    ok = i < N_EDGES - 1 - ZERO
    depths = tl.load(edges64_ptr + ZERO + 1 + i, mask=ok, other=1.0)
    beyond = _cdf64(scratch_ptr, slot, centre[:, None] - depths, edges64_ptr, N_EDGES, STEPS, BINS)
    pair = centre[:, None] + tl.zeros((1, 2), tl.float64)
    below = tl.max(_cdf64(scratch_ptr, slot, pair, edges64_ptr, N_EDGES, STEPS, BINS), axis=1)[:, None]
    usable = ok & (beyond >= min_tail) & (beyond <= below / tl.load(consts + C_E))
    fitted = depths / tl.log(below / tl.maximum(beyond, tl.load(consts + C_TINY300)))
    return tl.maximum(tl.max(tl.where(usable, fitted, 0.0), axis=1), tl.load(consts + C_FLOOR))


@triton.jit
def _put_rows(scratch_ptr, slot, values, BINS: tl.constexpr, N_EDGES: tl.constexpr):
    """Store histogram rows (ROWS, BINS) and their cumulative counts (a leading 0) in scratch slots ``slot``."""
    j = tl.arange(0, BINS)[None, :]
    inside = (j < N_EDGES + 1) & (slot >= 0)
    base = scratch_ptr + slot * 2 * BINS
    tl.store(base + j, values, mask=inside)
    tl.store(base + BINS + 1 + j, tl.cumsum(values, axis=1), mask=inside)
    tl.store(base + BINS + j, tl.zeros(values.shape, tl.float64), mask=(j == 0) & (slot >= 0))


@triton.jit
def noise_tables(counts_ptr, use_batch, state_ptr, early_ptr, scratch_ptr, summary_ptr, tokens_ptr, tables_ptr,
                  lags_ptr, edges64_ptr, ZERO: tl.constexpr, CAND_LO: tl.constexpr, N_CAND: tl.constexpr,
                  N_EDGES: tl.constexpr, STEPS: tl.constexpr, BINS: tl.constexpr, LAG_BLOCK: tl.constexpr,
                  NUM_LAGS: tl.constexpr):
    """The noise in one program: the healthy noise of the state plus this batch (``counts``, int32
    NUM_REGIONS · NUM_BINS; ``use_batch`` 0 judges the state alone), its summary (centre, scale, growth; fp64) and
    the float32 tables the row passes read (fused.TABLES layout). Scratch slots: 0–3 the counts, 4–7 the state, 8–11
    the state (or the batch) mirrored, 12 the counts pooled over regions, 13 the analyses' results."""
    n_bins = N_EDGES + 1
    r = tl.arange(0, 4)[:, None]
    j = tl.arange(0, BINS)[None, :]
    inside = j < n_bins
    state = tl.load(state_ptr + r * n_bins + j, mask=inside, other=0.0)
    batch = tl.load(counts_ptr + r * n_bins + j, mask=inside, other=0, cache_modifier=".cg").to(tl.float64)
    counts = state + tl.where(use_batch != 0, batch, 0.0)
    _put_rows(scratch_ptr, r, counts, BINS, N_EDGES)
    _put_rows(scratch_ptr, 4 + r, state, BINS, N_EDGES)
    # per region the state, or the batch while the state holds no token there, mirrored (Detector.down_reference)
    flipped = r * n_bins + (n_bins - 1 - j)
    cold = ((tl.sum(state, axis=1) == 0) & (use_batch != 0))[:, None]
    mirrored = tl.where(cold, tl.load(counts_ptr + flipped, mask=inside, other=0, cache_modifier=".cg").to(tl.float64),
                        tl.load(state_ptr + flipped, mask=inside, other=0.0))
    _put_rows(scratch_ptr, 8 + r, mirrored, BINS, N_EDGES)
    pair = tl.arange(0, 2)[:, None]
    pooled = tl.sum(counts, axis=0)[None, :] + tl.zeros((2, BINS), tl.float64)
    _put_rows(scratch_ptr, tl.where(pair == 0, 12, -1), pooled, BINS, N_EDGES)
    tl.debug_barrier()
    # the counts' and the state's own centre and scale (slots 0–7), and the pooled counts' centre
    eight = tl.arange(0, 8)[:, None]
    own_centre = _centre64(scratch_ptr, eight, edges64_ptr, CAND_LO, N_CAND, N_EDGES, STEPS, BINS)
    own_scale = _scale64(scratch_ptr, eight, own_centre, tl.load(edges64_ptr + N_EDGES + C_MIN_TAIL), edges64_ptr,
                         ZERO, N_EDGES, STEPS, BINS)
    everywhere = tl.max(_centre64(scratch_ptr, pair * 0 + 12, edges64_ptr, CAND_LO, N_CAND, N_EDGES, STEPS, BINS),
                        axis=0)
    results = scratch_ptr + 13 * 2 * BINS
    tl.store(results + tl.arange(0, 8), own_centre)
    tl.store(results + 8 + tl.arange(0, 8), own_scale)
    tl.debug_barrier()
    consts = edges64_ptr + N_EDGES
    region = tl.arange(0, 4)
    total = _total64(scratch_ptr, r, N_EDGES, BINS)
    centre_r = tl.load(results + region)
    scale_r = tl.load(results + 8 + region)
    weight = total / (total + tl.load(consts + C_PRIOR_TOKENS))
    centre_tokens = tl.load(consts + C_CENTRE_TOKENS)
    centre = (total * centre_r + centre_tokens * everywhere) / (total + centre_tokens)
    shrunk = weight * scale_r + (1 - weight) * tl.load(consts + C_PRIOR_SCALE)
    scale = tl.maximum(shrunk, scale_r)
    early = tl.load(early_ptr + region)
    now = tl.load(results + 12 + region)  # the state's own scale over its early level (fused.growth_of)
    growth = tl.where(early > 0, now / tl.maximum(early, tl.load(consts + C_TINY30)), float("nan"))
    tl.store(summary_ptr + region, centre)
    tl.store(summary_ptr + 4 + region, scale)
    tl.store(summary_ptr + 8 + region, growth)
    tl.store(tokens_ptr + region, total)
    # the float32 tables: centre, scale, each side's mass at or below its centre, cumulative counts, lag terms
    tl.store(tables_ptr + region, centre.to(tl.float32))
    tl.store(tables_ptr + 4 + region, scale.to(tl.float32))
    at = centre[:, None] + tl.zeros((1, 2), tl.float64)
    tl.store(tables_ptr + 8 + region, tl.max(_cdf64(scratch_ptr, r, at, edges64_ptr, N_EDGES, STEPS, BINS),
                                             axis=1).to(tl.float32))
    tl.store(tables_ptr + 12 + region, tl.max(_cdf64(scratch_ptr, 8 + r, -at, edges64_ptr, N_EDGES, STEPS, BINS),
                                              axis=1).to(tl.float32))
    below_table = tables_ptr + 16
    side_slot = tl.where(eight < 4, eight, eight + 4)  # table rows 0–3: the counts, 4–7: slots 8–11
    tl.store(below_table + eight * (n_bins + 1) + j,
             tl.load(scratch_ptr + side_slot * 2 * BINS + BINS + j).to(tl.float32), mask=j <= n_bins)
    lag_index = tl.arange(0, LAG_BLOCK)[None, :]
    lags = tl.load(lags_ptr + lag_index, mask=lag_index < NUM_LAGS, other=1.0)
    b = scale.to(tl.float32)[:, None]
    edge_table = below_table + 8 * (n_bins + 1)
    tl.store(edge_table + r * LAG_BLOCK + lag_index, tl.log(1.0 - tl.exp(-lags / b)))
    tl.store(edge_table + (4 + r) * LAG_BLOCK + lag_index, tl.log(b / lags))
    # the scale that covers every trainer-favouring token of the counts (noise.engine_favouring_cap)
    tail = _scale64(scratch_ptr, r, centre, 1.0, edges64_ptr, ZERO, N_EDGES, STEPS, BINS)
    tl.store(edge_table + 8 * LAG_BLOCK + region, tail.to(tl.float32))


@triton.jit
def learn(state_ptr, early_ptr, kept_ptr, processes, stride_p, out_ptr, edges64_ptr, ZERO: tl.constexpr,
          CAND_LO: tl.constexpr, N_CAND: tl.constexpr, N_EDGES: tl.constexpr, STEPS: tl.constexpr,
          BINS: tl.constexpr):
    """fused.learn in one program: the state plus the kept counts summed over ``processes`` (rows ``stride_p``
    apart), and the early scale recorded where a region reaches EARLY_TOKENS. ``out``: fp64 scratch whose first
    NUM_REGIONS · NUM_BINS values become the new state, the next NUM_REGIONS the new early scale."""
    n_bins = N_EDGES + 1
    r = tl.arange(0, 4)[:, None]
    j = tl.arange(0, BINS)[None, :]
    inside = j < n_bins
    state = tl.load(state_ptr + r * n_bins + j, mask=inside, other=0.0)
    kept = tl.zeros((4, BINS), tl.float64)
    for p in range(processes):
        kept += tl.load(kept_ptr + p * stride_p + r * n_bins + j, mask=inside, other=0.0)
    counts = state + kept
    tl.store(out_ptr + r * n_bins + j, counts, mask=inside)
    work = out_ptr + 4 * n_bins + 4
    _put_rows(work, r, counts, BINS, N_EDGES)
    tl.debug_barrier()
    centre = _centre64(work, r, edges64_ptr, CAND_LO, N_CAND, N_EDGES, STEPS, BINS)
    scale = _scale64(work, r, centre, tl.load(edges64_ptr + N_EDGES + C_MIN_TAIL), edges64_ptr, ZERO, N_EDGES,
                     STEPS, BINS)
    early_tokens = tl.load(edges64_ptr + N_EDGES + C_EARLY_TOKENS)
    region = tl.arange(0, 4)
    reached = (tl.sum(state, axis=1) < early_tokens) & (tl.sum(counts, axis=1) >= early_tokens)
    tl.store(out_ptr + 4 * n_bins + region, tl.where(reached, scale, tl.load(early_ptr + region)))


# --- pass 1: histograms, counts, sums and maxima -----------------------------------------------------------------

@triton.jit
def token_pass(engine_ptr, trainer_ptr, mask_ptr, length, stride_e, stride_t, stride_m, acc_ptr, part_ptr,
               ceiling, tolerance, edges_ptr, delta_edges_ptr, E0, E1, E2,
               N_EDGES: tl.constexpr, N_DELTA_EDGES: tl.constexpr, DELTA_STEPS: tl.constexpr,
               COUNT_BINS: tl.constexpr, DELTA_BINS: tl.constexpr, PART: tl.constexpr, CHUNK: tl.constexpr,
               BLOCK: tl.constexpr):
    """One chunk of a row: its read tokens added to the region × ``d`` histogram and their |Δ| to the statistics'
    (int32 atomics into ``acc``, fused.ACC layout), its counts, sums and maxima (``part``, A_* order)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    first = chunk * CHUNK
    end = tl.minimum(first + CHUNK, length)
    inf = float("inf")
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
    over_ceiling = 0.0
    over_tolerance = 0.0
    local = tl.zeros((COUNT_BINS,), tl.int32)
    local_delta = tl.zeros((DELTA_BINS,), tl.int32)
    for start in range(first, end, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        engine, trainer, valid = _load_row(engine_ptr, trainer_ptr, mask_ptr, row, offsets, end,
                                           stride_e, stride_t, stride_m)
        if tl.max(valid.to(tl.int32), axis=0) > 0:  # a block of padding adds nothing
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
            over_ceiling = tl.maximum(over_ceiling, tl.max((read & (tl.abs(log_ratio) > ceiling)).to(tl.float32),
                                                           axis=0))
            over_tolerance = tl.maximum(over_tolerance, tl.max((read & (tl.abs(engine - trainer) > tolerance))
                                                               .to(tl.float32), axis=0))
            local += tl.histogram(_region_bins(engine, trainer, read, edges_ptr, E0, E1, E2, N_EDGES,
                                               COUNT_BINS), COUNT_BINS)
            bins = tl.maximum(_bucket(tl.abs(log_ratio), delta_edges_ptr, N_DELTA_EDGES, DELTA_STEPS) - 1, 0)
            local_delta += tl.histogram(tl.where(read, bins, DELTA_BINS - 1), DELTA_BINS)
    lane = tl.arange(0, PART)
    values = tl.where(lane == A_TOKENS, tokens, 0.0)
    values = tl.where(lane == A_COMPARED, compared, values)
    values = tl.where(lane == A_ABS_SUM, abs_sum, values)
    values = tl.where(lane == A_ABS_MAX, abs_max, values)
    values = tl.where(lane == A_RATIO_SUM, ratio_sum, values)
    values = tl.where(lane == A_K3_SUM, k3_sum, values)
    values = tl.where(lane == A_ENGINE_MAX, engine_max, values)
    values = tl.where(lane == A_ENGINE_SUM, engine_sum, values)
    values = tl.where(lane == A_ENGINE_COUNT, engine_count, values)
    values = tl.where(lane == A_TRAINER_MAX, trainer_max, values)
    values = tl.where(lane == A_TRAINER_SUM, trainer_sum, values)
    values = tl.where(lane == A_TRAINER_COUNT, trainer_count, values)
    values = tl.where(lane == A_CEILING, over_ceiling, values)
    values = tl.where(lane == A_TOLERANCE, over_tolerance, values)
    tl.store(part_ptr + (row * chunks + chunk) * PART + lane, values)
    slots = tl.arange(0, COUNT_BINS)
    tl.atomic_add(acc_ptr + slots, local, mask=(slots < 4 * (N_EDGES + 1)) & (local > 0), sem="relaxed")
    delta_slots = tl.arange(0, DELTA_BINS)
    tl.atomic_add(acc_ptr + 2 * COUNT_BINS + delta_slots, local_delta,
                  mask=(delta_slots < N_DELTA_EDGES) & (local_delta > 0), sem="relaxed")


# --- pass 2: the score (score.row_scores) ------------------------------------------------------------------------

@triton.jit
def _cdf(at, region, side, below_ptr, edges_ptr, N_EDGES: tl.constexpr):
    """Counts at or below ``at`` in region ``region`` of table ``side`` (noise._cdf: linear within a bin, an open
    bin's mass at its edge); ``below``: (2, NUM_REGIONS, NUM_BINS + 1) cumulative counts."""
    k = _edge_bucket(at, edges_ptr)
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
def _by_region(table_ptr, region, lag_index):
    """(LAG_BLOCK, BLOCK): row ``region`` of a (NUM_REGIONS, LAG_BLOCK) table, per token."""
    width = lag_index.shape[0]
    r0 = tl.load(table_ptr + lag_index)
    r1 = tl.load(table_ptr + width + lag_index)
    r2 = tl.load(table_ptr + 2 * width + lag_index)
    r3 = tl.load(table_ptr + 3 * width + lag_index)
    return tl.where(region == 0, r0, tl.where(region == 1, r1, tl.where(region == 2, r2, r3)))


@triton.jit
def _token_terms(engine, trainer, valid, tables_ptr, lags, lag_index, lag_ok, edges_ptr, E0, E1, E2,
                 N_EDGES: tl.constexpr):
    """Per token of a block: whether it is read, x / b (its excess), and the (LAG_BLOCK, BLOCK) capped
    engine-favouring and trainer-favouring lag log ratios and the later-token log ratio (score.py)."""
    below_ptr = tables_ptr + 16
    edge_ptr = below_ptr + 8 * (N_EDGES + 2)
    read = _read(engine, trainer, valid)
    engine_read = tl.where(read, engine, 0.0)
    delta = tl.where(read, engine - trainer, 0.0)
    region = _region(engine_read, E0, E1, E2)
    centre = tl.load(tables_ptr + region)
    x = tl.where(read, delta - centre, 0.0)
    b = tl.where(read, tl.load(tables_ptr + 4 + region), 1.0)
    # the cap: how rare the other side shows the distance |x| (tail_rarity); engine-favouring: table 0 (the run's
    # and this batch's d), else table 1 (the kept state's d mirrored, its centre negated)
    up = x > 0
    side = tl.where(up, 0, 1)
    centre_side = tl.where(up, centre, -centre)
    beyond = _cdf(centre_side - tl.abs(x), region, side, below_ptr, edges_ptr, N_EDGES)
    mass = tl.load(tables_ptr + 8 + side * 4 + region)
    cap = tl.where(beyond > 0, tl.log(mass / tl.where(beyond > 0, beyond, 1.0)), float("inf"))
    tail = tl.load(edge_ptr + 8 * lag_index.shape[0] + region)  # engine-favouring: also at most |x| / b_tail
    cap = tl.where(up, tl.minimum(cap, tl.abs(x) / tail), cap)
    xs = x[None, :]  # lags on the leading axis, so that one thread holds a token's lags
    per_b = (1.0 / b)[None, :]  # one division per token, then products
    caps = cap[None, :]
    regions = region[None, :]
    first = tl.minimum((tl.abs(xs) - tl.abs(xs - lags)) * per_b, caps)
    down = tl.minimum((tl.abs(xs) - tl.abs(xs + lags)) * per_b, caps)
    inside = tl.minimum(tl.maximum(xs, 0.0), lags)
    edge = _by_region(edge_ptr, regions, lag_index)  # ln(1 − e^{−D/b}) of the token's region
    scaled = inside * per_b
    middle = scaled + tl.log(tl.maximum(2.0 - tl.exp(-scaled) - tl.exp((inside - lags) * per_b), 1e-30))
    body = tl.where(xs <= 0, edge, tl.where(xs >= lags, lags * per_b + edge, middle))
    later = _by_region(edge_ptr + 4 * lag_index.shape[0], regions, lag_index) + body  # ln(b/D) + body
    counted = read[None, :] & lag_ok
    later = tl.where(counted, later, 0.0)
    first = tl.where(counted, first, -float("inf"))
    down = tl.where(counted, down, -float("inf"))
    return read, tl.where(read, x / b, -float("inf")), first, down, later


@triton.jit
def _lse_lags(values, LAG_AXIS: tl.constexpr):
    """Per token (or chunk), ln Σ_lags exp(values) over axis ``LAG_AXIS`` (−inf where every value is −inf)."""
    top = tl.max(values, axis=LAG_AXIS)
    safe = tl.where(top == -float("inf"), 0.0, top)
    return safe + tl.log(tl.sum(tl.exp(values - tl.expand_dims(safe, LAG_AXIS)), axis=LAG_AXIS))


@triton.jit
def _sparse_terms(compared):
    """ln π and ln(1 − π) of the sparse alternative (π = 1/n), and ln n."""
    n = tl.maximum(compared, 1.0)
    log_n = tl.log(n)
    pi = tl.minimum(1.0 / n, 1.0 - 1e-7)
    log_rest = tl.where(pi < 0.01, -pi - pi * pi / 2 - pi * pi * pi / 3, tl.log(1.0 - pi))  # ln(1 − π), accurate
    return -log_n, log_rest, log_n


@triton.jit
def score_pass(engine_ptr, trainer_ptr, mask_ptr, injected_ptr, length, stride_e, stride_t, stride_m, acc_ptr,
               part_ptr, tables_ptr, lags_ptr, record_ptr, reasons_ptr, score_ptr, onset_ptr, delta_ptr, rows,
               edges_ptr, E0, E1, E2, threshold, ln_engine, ln_trainer,
               N_EDGES: tl.constexpr, NUM_LAGS: tl.constexpr, LAG_BLOCK: tl.constexpr,
               COUNT_BINS: tl.constexpr, DELTA_BINS: tl.constexpr, N_DELTA_EDGES: tl.constexpr,
               HAS_CEILING: tl.constexpr, HAS_TOLERANCE: tl.constexpr, HAS_INJECTED: tl.constexpr,
               WIDTH: tl.constexpr, PART: tl.constexpr, CHUNK_BLOCK: tl.constexpr, CHUNK: tl.constexpr,
               BLOCK: tl.constexpr, HIST_BLOCK: tl.constexpr, ROW_TILE: tl.constexpr):
    """One chunk of a row, backwards: per lag, the sum of its read tokens' later-token log ratios, and of its onset
    terms (each token's lag log ratio plus the later-token sum of the chunk's read tokens after it) the maximum and
    the sum of exp scaled by it; its share of the sparse alternative's sum, its strongest token and its largest
    x / b (``part`` second block, S_* order). The row's last chunk to finish combines the row (:func:`_finish_row`)."""
    chunk = tl.program_id(0)  # a row's chunks are scheduled together, so its finish overlaps other rows' chunks
    row = tl.program_id(1).to(tl.int64)
    chunks = tl.num_programs(0)
    first_token = chunk * CHUNK
    end = tl.minimum(first_token + CHUNK, length)
    lag_index = tl.arange(0, LAG_BLOCK)[:, None]
    lag_ok = lag_index < NUM_LAGS
    lags = tl.load(lags_ptr + lag_index, mask=lag_ok, other=1.0)
    inf = float("inf")
    compared = 0.0
    for c0 in range(0, chunks, CHUNK_BLOCK):
        c = c0 + tl.arange(0, CHUNK_BLOCK)
        compared += tl.sum(tl.load(part_ptr + (row * chunks + c) * PART + A_COMPARED, mask=c < chunks, other=0.0),
                           axis=0)
    log_pi, log_rest, _ = _sparse_terms(compared)
    carry = tl.zeros((LAG_BLOCK,), tl.float32)  # Σ later-token log ratios of the chunk's read tokens after a block
    top = tl.zeros((LAG_BLOCK,), tl.float32) - inf  # per lag, the onset terms' running maximum
    scaled = tl.zeros((LAG_BLOCK,), tl.float32)  # and their sum of exp, scaled by it
    excess = -inf
    sparse = 0.0
    best = -inf
    best_at = -1
    last_start = first_token + ((end - first_token + BLOCK - 1) // BLOCK - 1) * BLOCK
    for back in range(0, end - first_token, BLOCK):
        start = last_start - back
        offsets = start + tl.arange(0, BLOCK)
        engine, trainer, valid = _load_row(engine_ptr, trainer_ptr, mask_ptr, row, offsets, end,
                                           stride_e, stride_t, stride_m)
        if tl.max(valid.to(tl.int32), axis=0) > 0:  # a block of padding adds nothing
            read, ratio, first, down, later = _token_terms(engine, trainer, valid, tables_ptr, lags, lag_index,
                                                           lag_ok, edges_ptr, E0, E1, E2, N_EDGES)
            after = carry[:, None] + tl.cumsum(later, axis=1, reverse=True) - later
            carry += tl.sum(later, axis=1)
            terms = tl.where(read[None, :] & lag_ok, first + after, -inf)
            new_top = tl.maximum(top, tl.max(terms, axis=1))
            safe = tl.where(new_top == -inf, 0.0, new_top)
            scaled = scaled * tl.exp(top - safe) + tl.sum(tl.exp(terms - safe[:, None]), axis=1)
            top = new_top
            excess = tl.maximum(excess, tl.max(ratio, axis=0))
            log_m = (_logaddexp(_lse_lags(first, 0) + ln_engine, _lse_lags(down, 0) + ln_trainer)
                     - tl.log(NUM_LAGS * 1.0))
            log_m = tl.where(read, log_m, -inf)
            top_m = tl.max(log_m, axis=0)
            better = (top_m >= best) & (top_m > -inf)  # backwards, so ≥ keeps the earliest of equal tokens
            best_at = tl.where(better, start + tl.argmax(log_m, axis=0), best_at)
            best = tl.where(better, top_m, best)
            sparse += tl.sum(tl.where(read, _logaddexp(log_rest + tl.zeros_like(log_m), log_pi + log_m), 0.0),
                             axis=0)
    lane = tl.arange(0, PART)
    in_block = lane[:, None] - tl.arange(0, LAG_BLOCK)[None, :]  # lane − lag: the lag a lane of a lag block holds
    values = tl.sum(tl.where(in_block == S_LATER, carry[None, :], 0.0), axis=1)
    values += tl.sum(tl.where(in_block == S_TOP, top[None, :], 0.0), axis=1)
    values += tl.sum(tl.where(in_block == S_SCALED, scaled[None, :], 0.0), axis=1)
    values = tl.where(lane == S_EXCESS, excess, values)
    values = tl.where(lane == S_SPARSE, sparse, values)
    values = tl.where(lane == S_BEST, best, values)
    values = tl.where(lane == S_BEST_AT, best_at.to(tl.float32), values)
    tl.store(part_ptr + (rows * chunks + row * chunks + chunk) * PART + lane, values)
    tl.debug_barrier()
    ticket = tl.atomic_add(acc_ptr + 2 * COUNT_BINS + DELTA_BINS + 2 + row, 1)
    if ticket == chunks - 1:
        _finish_row(engine_ptr, trainer_ptr, mask_ptr, injected_ptr, length, stride_e, stride_t, stride_m, acc_ptr,
                    part_ptr, tables_ptr, lags_ptr, edges_ptr, record_ptr, reasons_ptr, score_ptr, onset_ptr,
                    delta_ptr, row, chunks, rows, E0, E1, E2, threshold, N_EDGES, NUM_LAGS, LAG_BLOCK,
                    COUNT_BINS, DELTA_BINS, N_DELTA_EDGES, HAS_CEILING, HAS_TOLERANCE, HAS_INJECTED, WIDTH, PART,
                    CHUNK_BLOCK, CHUNK, BLOCK, HIST_BLOCK, ROW_TILE)


@triton.jit
def _onset_mode(engine_ptr, trainer_ptr, mask_ptr, length, stride_e, stride_t, stride_m, tables_ptr, lags_ptr,
                edges_ptr, row, chunk, carry, best, best_at, E0, E1, E2, N_EDGES: tl.constexpr,
                NUM_LAGS: tl.constexpr, LAG_BLOCK: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """The largest onset term ln Σ_lags of one chunk's read tokens and its earliest token, folded into ``best`` and
    ``best_at`` (scanned backwards: ≥ keeps the earliest); ``carry``: (LAG_BLOCK,) the later chunks' later-token
    sums."""
    first_token = chunk * CHUNK
    end = tl.minimum(first_token + CHUNK, length)
    lag_index = tl.arange(0, LAG_BLOCK)[:, None]
    lag_ok = lag_index < NUM_LAGS
    lags = tl.load(lags_ptr + lag_index, mask=lag_ok, other=1.0)
    last_start = first_token + ((end - first_token + BLOCK - 1) // BLOCK - 1) * BLOCK
    for back in range(0, end - first_token, BLOCK):
        start = last_start - back
        offsets = start + tl.arange(0, BLOCK)
        engine, trainer, valid = _load_row(engine_ptr, trainer_ptr, mask_ptr, row, offsets, end,
                                           stride_e, stride_t, stride_m)
        read, _, first, _, later = _token_terms(engine, trainer, valid, tables_ptr, lags, lag_index, lag_ok,
                                                edges_ptr, E0, E1, E2, N_EDGES)
        after = carry[:, None] + tl.cumsum(later, axis=1, reverse=True) - later
        carry += tl.sum(later, axis=1)
        per_token = _lse_lags(tl.where(read[None, :] & lag_ok, first + after, -float("inf")), 0)  # (BLOCK,)
        top = tl.max(per_token, axis=0)
        better = (top >= best) & (top > -float("inf"))
        best_at = tl.where(better, start + tl.argmax(per_token, axis=0), best_at)
        best = tl.where(better, top, best)
    return best, best_at


@triton.jit
def _finish_row(engine_ptr, trainer_ptr, mask_ptr, injected_ptr, length, stride_e, stride_t, stride_m, acc_ptr,
                part_ptr, tables_ptr, lags_ptr, edges_ptr, record_ptr, reasons_ptr, score_ptr, onset_ptr, delta_ptr,
                row, chunks, rows, E0, E1, E2, threshold, N_EDGES: tl.constexpr,
                NUM_LAGS: tl.constexpr, LAG_BLOCK: tl.constexpr, COUNT_BINS: tl.constexpr, DELTA_BINS: tl.constexpr,
                N_DELTA_EDGES: tl.constexpr, HAS_CEILING: tl.constexpr, HAS_TOLERANCE: tl.constexpr,
                HAS_INJECTED: tl.constexpr, WIDTH: tl.constexpr, PART: tl.constexpr, CHUNK_BLOCK: tl.constexpr,
                CHUNK: tl.constexpr, BLOCK: tl.constexpr, HIST_BLOCK: tl.constexpr, ROW_TILE: tl.constexpr):
    """A row's score, onset, verdict bits and statistics from its chunks' partials (fused.ROW_COLUMNS order into the
    record's row of WIDTH fp64); a suspect row's read tokens into the suspect histogram. The last row to finish
    writes the kept rows' histogram (the batch's less the suspect rows'), the |Δ| histogram and the batch's
    aggregates (:func:`_aggregates`).

    The onset mixture: a chunk's onset terms are its partial terms plus, per lag, the later chunks' later-token sums
    ``k``, so their log-sum-exp is exact from the partials. Its mode: a chunk's terms are at most
    ``ub = ln Σ_lags exp(max + k)`` and some token reaches ``max + k`` of each lag, so only the chunks whose ``ub``
    reaches the best such lower bound are scanned again (:func:`_onset_mode`)."""
    inf = float("inf")
    nan = float("nan")
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
    over_ceiling = 0.0
    over_tolerance = 0.0
    excess = -inf
    sparse = 0.0
    best_token = -inf
    for c0 in range(0, chunks, CHUNK_BLOCK):
        c = c0 + tl.arange(0, CHUNK_BLOCK)
        inside = c < chunks
        a = part_ptr + (row * chunks + c) * PART
        s = part_ptr + (rows * chunks + row * chunks + c) * PART
        tokens += tl.sum(tl.load(a + A_TOKENS, mask=inside, other=0.0), axis=0)
        compared += tl.sum(tl.load(a + A_COMPARED, mask=inside, other=0.0), axis=0)
        abs_sum += tl.sum(tl.load(a + A_ABS_SUM, mask=inside, other=0.0), axis=0)
        abs_max = tl.maximum(abs_max, tl.max(tl.load(a + A_ABS_MAX, mask=inside, other=-inf), axis=0))
        ratio_sum += tl.sum(tl.load(a + A_RATIO_SUM, mask=inside, other=0.0), axis=0)
        k3_sum += tl.sum(tl.load(a + A_K3_SUM, mask=inside, other=0.0), axis=0)
        engine_max = tl.maximum(engine_max, tl.max(tl.load(a + A_ENGINE_MAX, mask=inside, other=-inf), axis=0))
        engine_sum += tl.sum(tl.load(a + A_ENGINE_SUM, mask=inside, other=0.0), axis=0)
        engine_count += tl.sum(tl.load(a + A_ENGINE_COUNT, mask=inside, other=0.0), axis=0)
        trainer_max = tl.maximum(trainer_max, tl.max(tl.load(a + A_TRAINER_MAX, mask=inside, other=-inf), axis=0))
        trainer_sum += tl.sum(tl.load(a + A_TRAINER_SUM, mask=inside, other=0.0), axis=0)
        trainer_count += tl.sum(tl.load(a + A_TRAINER_COUNT, mask=inside, other=0.0), axis=0)
        over_ceiling = tl.maximum(over_ceiling, tl.max(tl.load(a + A_CEILING, mask=inside, other=0.0), axis=0))
        over_tolerance = tl.maximum(over_tolerance, tl.max(tl.load(a + A_TOLERANCE, mask=inside, other=0.0), axis=0))
        excess = tl.maximum(excess, tl.max(tl.load(s + S_EXCESS, mask=inside, other=-inf, cache_modifier=".cg"),
                                           axis=0))
        sparse += tl.sum(tl.load(s + S_SPARSE, mask=inside, other=0.0, cache_modifier=".cg"), axis=0)
        best_token = tl.maximum(best_token, tl.max(tl.load(s + S_BEST, mask=inside, other=-inf, cache_modifier=".cg"),
                                                   axis=0))
    best_token_at = length
    for c0 in range(0, chunks, CHUNK_BLOCK):  # the earliest of equal maxima: chunks are in token order
        c = c0 + tl.arange(0, CHUNK_BLOCK)
        inside = c < chunks
        s = part_ptr + (rows * chunks + row * chunks + c) * PART
        at = tl.load(s + S_BEST_AT, mask=inside, other=0.0, cache_modifier=".cg").to(tl.int32)
        hit = inside & (tl.load(s + S_BEST, mask=inside, other=-inf, cache_modifier=".cg") == best_token)
        best_token_at = tl.minimum(best_token_at, tl.min(tl.where(hit, at, length), axis=0))
    # the onset mixture, over the chunks from the last: k = the later chunks' later-token sums per lag
    lag_index = tl.arange(0, LAG_BLOCK)[None, :]
    chunk_index = tl.arange(0, CHUNK_BLOCK)[:, None]
    blocks = (chunks + CHUNK_BLOCK - 1) // CHUNK_BLOCK
    suffix = tl.zeros((LAG_BLOCK,), tl.float32)
    bound = -inf  # the best lower bound on a token's onset term: max over chunks and lags of max + k
    onset_top = -inf
    onset_sum = 0.0
    for back in range(0, blocks):
        c = (blocks - 1 - back) * CHUNK_BLOCK + chunk_index
        inside = c < chunks
        s = part_ptr + (rows * chunks + row * chunks + c) * PART + lag_index
        later = tl.load(s + S_LATER, mask=inside, other=0.0, cache_modifier=".cg")
        tops = tl.load(s + S_TOP, mask=inside, other=-inf, cache_modifier=".cg")
        scaled = tl.load(s + S_SCALED, mask=inside, other=0.0, cache_modifier=".cg")
        k = suffix[None, :] + tl.cumsum(later, axis=0, reverse=True) - later
        suffix += tl.sum(later, axis=0)
        reach = tops + k
        bound = tl.maximum(bound, tl.max(tl.max(reach, axis=1), axis=0))
        terms = tl.where(scaled > 0, reach + tl.log(tl.where(scaled > 0, scaled, 1.0)), -inf)
        new_top = tl.maximum(onset_top, tl.max(tl.max(terms, axis=1), axis=0))
        safe = tl.where(new_top == -inf, 0.0, new_top)
        onset_sum = onset_sum * tl.exp(onset_top - safe) + tl.sum(tl.sum(tl.exp(terms - safe), axis=1), axis=0)
        onset_top = new_top
    log_pi, log_rest, log_n = _sparse_terms(compared)
    n = tl.maximum(compared, 1.0)
    safe_top = tl.where(onset_top == -inf, 0.0, onset_top)
    log_onset = safe_top + tl.log(onset_sum) - log_n - tl.log(NUM_LAGS * 1.0)
    score = _logaddexp(log_onset, sparse) - 0.6931471805599453
    has = compared > 0
    best_onset = -inf
    best_onset_at = -1
    if has & (sparse <= log_onset):  # the onset is the mixture's mode: scan the chunks that can hold it
        margin = 1e-4 * tl.abs(bound) + 1e-2  # float32 rounding between the bound's sums and the scan's
        suffix = tl.zeros((LAG_BLOCK,), tl.float32)
        for back in range(0, blocks):
            block = blocks - 1 - back
            c = block * CHUNK_BLOCK + chunk_index
            inside = c < chunks
            s = part_ptr + (rows * chunks + row * chunks + c) * PART + lag_index
            later = tl.load(s + S_LATER, mask=inside, other=0.0, cache_modifier=".cg")
            tops = tl.load(s + S_TOP, mask=inside, other=-inf, cache_modifier=".cg")
            k = suffix[None, :] + tl.cumsum(later, axis=0, reverse=True) - later
            suffix += tl.sum(later, axis=0)
            upper = _lse_lags(tops + k, 1)  # (CHUNK_BLOCK,)
            flat = tl.arange(0, CHUNK_BLOCK)
            candidate = (block * CHUNK_BLOCK + flat < chunks) & (upper >= bound - margin)
            for i in range(0, CHUNK_BLOCK):
                at = CHUNK_BLOCK - 1 - i
                if tl.sum(tl.where(flat == at, candidate.to(tl.int32), 0), axis=0) > 0:
                    carry = tl.sum(tl.where(chunk_index == at, k, 0.0), axis=0)
                    best_onset, best_onset_at = _onset_mode(
                        engine_ptr, trainer_ptr, mask_ptr, length, stride_e, stride_t, stride_m, tables_ptr,
                        lags_ptr, edges_ptr, row, block * CHUNK_BLOCK + at, carry, best_onset, best_onset_at, E0,
                        E1, E2, N_EDGES, NUM_LAGS, LAG_BLOCK, CHUNK, BLOCK)
    onset = tl.where(sparse > log_onset, best_token_at, best_onset_at)
    onset = tl.where(has, onset, -1)
    at_onset = tl.maximum(onset, 0).to(tl.int64)
    onset_engine = tl.load(engine_ptr + row * stride_e + at_onset).to(tl.float32)
    onset_trainer = tl.load(trainer_ptr + row * stride_t + at_onset).to(tl.float32)
    onset_scale = tl.load(tables_ptr + 4 + _region(onset_engine, E0, E1, E2))
    engine_nonfinite = tokens - engine_count
    trainer_nonfinite = tokens - trainer_count
    reasons = ((engine_nonfinite > 0).to(tl.int32) | (trainer_nonfinite > 0).to(tl.int32) * 2
               | (has & (score > threshold)).to(tl.int32) * 8)
    if HAS_CEILING:
        reasons = reasons | (over_ceiling > 0).to(tl.int32) * 4
    if HAS_TOLERANCE:
        reasons = reasons | (over_tolerance > 0).to(tl.int32) * 16
    tl.store(reasons_ptr + row, reasons)
    tl.store(score_ptr + row, tl.where(has, score, -inf))
    tl.store(onset_ptr + row, onset.to(tl.int64))
    injected = nan
    if HAS_INJECTED:
        injected = tl.load(injected_ptr + row).to(tl.float32)
    column = tl.arange(0, 32)
    values = tl.where(column == 0, tokens, nan)
    values = tl.where(column == 1, compared, values)
    values = tl.where(column == 2, tl.where(has, abs_max, nan), values)
    values = tl.where(column == 3, tl.where(has, abs_sum / n, nan), values)
    values = tl.where(column == 4, tl.where(has, ratio_sum, nan), values)
    values = tl.where(column == 5, tl.where(has, k3_sum / n, nan), values)
    values = tl.where(column == 6, tl.where(engine_count > 0, engine_max, nan), values)
    values = tl.where(column == 7, tl.where(engine_count > 0, engine_sum / tl.maximum(engine_count, 1.0), nan),
                      values)
    values = tl.where(column == 8, tl.where(trainer_count > 0, trainer_max, nan), values)
    values = tl.where(column == 9, tl.where(trainer_count > 0, trainer_sum / tl.maximum(trainer_count, 1.0), nan),
                      values)
    values = tl.where(column == 10, engine_nonfinite, values)
    values = tl.where(column == 11, trainer_nonfinite, values)
    values = tl.where(column == 12, injected, values)
    values = tl.where(column == 13, tl.where(has, score, nan), values)
    values = tl.where(column == 14, onset.to(tl.float32), values)
    values = tl.where(column == 15, tl.where(has, onset_engine, nan), values)
    values = tl.where(column == 16, tl.where(has, onset_trainer, nan), values)
    values = tl.where(column == 17, tl.where(has, onset_scale, nan), values)
    values = tl.where(column == 18, tl.where(has, excess, nan), values)
    tl.store(record_ptr + row * WIDTH + column, values.to(tl.float64), mask=column < WIDTH)
    tl.store(record_ptr + rows * WIDTH + row, reasons.to(tl.float64))
    if (reasons != 0) & has:  # a suspect row teaches the noise nothing: its read tokens leave the kept histogram
        local = tl.zeros((COUNT_BINS,), tl.int32)
        for start in range(0, length, HIST_BLOCK):
            offsets = start + tl.arange(0, HIST_BLOCK)
            engine, trainer, valid = _load_row(engine_ptr, trainer_ptr, mask_ptr, row, offsets, length,
                                               stride_e, stride_t, stride_m)
            read = _read(engine, trainer, valid)
            local += tl.histogram(_region_bins(engine, trainer, read, edges_ptr, E0, E1, E2, N_EDGES,
                                               COUNT_BINS), COUNT_BINS)
        slots = tl.arange(0, COUNT_BINS)
        tl.atomic_add(acc_ptr + COUNT_BINS + slots, local, mask=(slots < 4 * (N_EDGES + 1)) & (local > 0),
                      sem="relaxed")
    tl.debug_barrier()
    ticket = tl.atomic_add(acc_ptr + 2 * COUNT_BINS + DELTA_BINS + 1, 1)
    if ticket == rows - 1:
        slots = tl.arange(0, COUNT_BINS)
        used = slots < 4 * (N_EDGES + 1)
        kept = (tl.load(acc_ptr + slots, mask=used, other=0, cache_modifier=".cg")
                - tl.load(acc_ptr + COUNT_BINS + slots, mask=used, other=0, cache_modifier=".cg"))
        base = record_ptr + rows * (WIDTH + 1)
        delta_slots = tl.arange(0, DELTA_BINS)
        delta = tl.load(acc_ptr + 2 * COUNT_BINS + delta_slots, mask=delta_slots < N_DELTA_EDGES, other=0,
                        cache_modifier=".cg")
        tl.store(delta_ptr + delta_slots, delta.to(tl.int64), mask=delta_slots < N_DELTA_EDGES)
        tl.store(base + delta_slots, delta.to(tl.float64), mask=delta_slots < N_DELTA_EDGES)
        tl.store(base + N_DELTA_EDGES + slots, kept.to(tl.float64), mask=used)
        _aggregates(record_ptr, reasons_ptr, rows, base + N_DELTA_EDGES + 4 * (N_EDGES + 1) + 12, WIDTH, ROW_TILE)


@triton.jit
def _column(table, column, j):
    """Column ``j`` of a (ROWS, 32) tile."""
    return tl.sum(tl.where(column == j, table, 0.0), axis=1)


@triton.jit
def _aggregates(record_ptr, reasons_ptr, rows, out_ptr, WIDTH: tl.constexpr, TILE: tl.constexpr):
    """packet.partial_aggregates of the record's rows (fused.ROW_COLUMNS order) and verdict bits, into ``out`` in
    packet.AGGREGATES order (fp64): the sums of tokens, compared, non-finite engine and trainer tokens; the maxima of
    max |Δ|, the engine's and trainer's max logprob, the score, and of max |Δ| and the score over the kept rows (NaN
    read as −inf, ±inf as ±the largest float64, as ``nan_to_num``); the token-weighted means' numerators and
    denominators; per rule the rows it flags; the injected, labelled, suspect and caught rows."""
    inf = float("inf")
    largest = tl.full((), 1.7976931348623157e308, tl.float64)
    column = tl.arange(0, 32)[None, :]
    lane = tl.arange(0, 8)[None, :]
    sums = tl.zeros((32,), tl.float64)
    maxima = tl.zeros((32,), tl.float64) - inf
    kept_maxima = tl.zeros((32,), tl.float64) - inf
    numerators = tl.zeros((8,), tl.float64)
    denominators = tl.zeros((8,), tl.float64)
    counts = tl.zeros((8,), tl.float64)
    caught = tl.zeros((), tl.float64)
    for r0 in range(0, rows, TILE):
        r = r0 + tl.arange(0, TILE)
        inside = r < rows
        table = tl.load(record_ptr + r[:, None] * WIDTH + column, mask=inside[:, None] & (column < WIDTH),
                        other=float("nan"), cache_modifier=".cg")
        reasons = tl.load(reasons_ptr + r, mask=inside, other=0, cache_modifier=".cg")
        suspect = (reasons != 0) & inside
        sums += tl.sum(tl.where(inside[:, None], table, 0.0), axis=0)
        finite = tl.where(table == inf, largest, tl.where(table == -inf, -largest, table))
        read = tl.where((table != table) | ~inside[:, None], -inf, finite)
        maxima = tl.maximum(maxima, tl.max(read, axis=0))
        kept_maxima = tl.maximum(kept_maxima, tl.max(tl.where(suspect[:, None], -inf, read), axis=0))
        tokens = _column(table, column, 0)
        compared = _column(table, column, 1)
        # the means (mean |Δ|, k3, engine mean, trainer mean) and the tokens each stands on, one lane each
        values = tl.where(lane == 0, _column(table, column, 3)[:, None],
                          tl.where(lane == 1, _column(table, column, 5)[:, None],
                                   tl.where(lane == 2, _column(table, column, 7)[:, None],
                                            _column(table, column, 9)[:, None])))
        weights = tl.where(lane < 2, compared[:, None],
                           tokens[:, None] - tl.where(lane == 2, _column(table, column, 10)[:, None],
                                                      _column(table, column, 11)[:, None]))
        keep = (values == values) & (weights > 0) & inside[:, None] & (lane < 4)
        numerators += tl.sum(tl.where(keep, values * weights, 0.0), axis=0)
        denominators += tl.sum(tl.where(keep, weights, 0.0), axis=0)
        injected_column = _column(table, column, 12)
        labelled = (injected_column == injected_column) & inside
        injected = labelled & (injected_column == 1)
        flags = tl.where(lane < 5, (reasons[:, None] >> lane) & 1, 0) != 0
        flags = tl.where(lane == 5, injected[:, None], flags)
        flags = tl.where(lane == 6, labelled[:, None], flags)
        flags = tl.where(lane == 7, suspect[:, None], flags)
        counts += tl.sum((flags & inside[:, None]).to(tl.float64), axis=0)
        caught += tl.sum((injected & suspect).to(tl.float64), axis=0)
    tl.store(out_ptr + 0, _pick(sums, 0))
    tl.store(out_ptr + 1, _pick(sums, 1))
    tl.store(out_ptr + 2, _pick(sums, 10))
    tl.store(out_ptr + 3, _pick(sums, 11))
    tl.store(out_ptr + 4, _pick(maxima, 2))
    tl.store(out_ptr + 5, _pick(maxima, 6))
    tl.store(out_ptr + 6, _pick(maxima, 8))
    tl.store(out_ptr + 7, _pick(maxima, 13))
    tl.store(out_ptr + 8, _pick(kept_maxima, 2))
    tl.store(out_ptr + 9, _pick(kept_maxima, 13))
    lanes = tl.arange(0, 8)
    tl.store(out_ptr + 10 + lanes, numerators, mask=lanes < 4)
    tl.store(out_ptr + 14 + lanes, denominators, mask=lanes < 4)
    tl.store(out_ptr + 18 + lanes, counts)
    tl.store(out_ptr + 26, caught)


@triton.jit
def _pick(values, j):
    """Element ``j`` of a vector."""
    return tl.sum(tl.where(tl.arange(0, values.shape[0]) == j, values, 0.0), axis=0)
