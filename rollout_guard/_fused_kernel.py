"""The Triton source of :func:`rollout_guard.fused_statistics.fused_packet` (imported on first use, so that
``TRITON_INTERPRET=1`` set before then runs it in Triton's interpreter). One program per sample row; see
:mod:`rollout_guard.fused_statistics` for what it computes and :mod:`rollout_guard.packet` for where it writes."""

import triton
import triton.language as tl


@triton.jit
def _last_min(v1, i1, v2, i2):
    # running minimum and its position; a later equal value wins, as in torch.cummin
    later = v2 <= v1
    return tl.where(later, v2, v1), tl.where(later, i2, i1)

@triton.jit
def _logprobs(pointer, inside, valid, PRESENT: tl.constexpr):
    # one side's logprobs in a block (0 where the side is absent), which count (valid and finite), and how many
    # valid tokens are NaN/±inf (none when the side is absent)
    if PRESENT:
        values = tl.load(pointer, mask=inside, other=0.0).to(tl.float32)
        finite = (values == values) & (tl.abs(values) != float("inf"))
        bad = tl.sum((valid & ~finite).to(tl.int32), axis=0)
    else:
        values = inside.to(tl.float32) * 0.0
        finite = values != values
        bad = tl.sum(finite.to(tl.int32), axis=0)
    return values, valid & finite, bad


@triton.jit
def guard_rows(
    mask_ptr, engine_ptr, trainer_ptr, injected_ptr, score_ptr, parameters_ptr, out_ptr,
    length, batch, mask_stride, engine_stride, trainer_stride,
    HAS_ENGINE: tl.constexpr, HAS_TRAINER: tl.constexpr, HAS_INJECTED: tl.constexpr, HAS_SCORE: tl.constexpr,
    SPIKE_RULE: tl.constexpr,
    NUM_DELTA: tl.constexpr, NUM_EXCESS: tl.constexpr, CAL_WIDTH: tl.constexpr, WIDTH: tl.constexpr,
    BLOCK: tl.constexpr, HISTOGRAMS: tl.constexpr = True,
):
    # where the packet's parts start (rollout_guard.packet.PacketLayout)
    samples_at = 2
    reasons_at = samples_at + batch * WIDTH
    histogram_at = reasons_at + batch
    calibration_at = histogram_at + NUM_DELTA
    kept_at = calibration_at + 4 * CAL_WIDTH
    aggregates_at = kept_at + 1
    # the parameter table (rollout_guard.fused_statistics.kernel_parameters)
    thresholds_ptr = parameters_ptr
    confident_logprob = tl.load(parameters_ptr + 20)
    doubtful_logprob = tl.load(parameters_ptr + 21)
    divergence_delta = tl.load(parameters_ptr + 22)
    spike_min_engine_logprob = tl.load(parameters_ptr + 23)
    edge0 = tl.load(parameters_ptr + 24)
    edge1 = tl.load(parameters_ptr + 25)
    edge2 = tl.load(parameters_ptr + 26)
    clip_low = tl.load(parameters_ptr + 27)
    clip_high = tl.load(parameters_ptr + 28)
    k3_cap = tl.load(parameters_ptr + 29)
    min_nonfinite_engine = tl.load(parameters_ptr + 30)
    min_nonfinite_trainer = tl.load(parameters_ptr + 31)
    spike_delta = tl.load(parameters_ptr + 32)
    mean_delta = tl.load(parameters_ptr + 33)
    min_confident_wrong = tl.load(parameters_ptr + 34)
    drift_threshold = tl.load(parameters_ptr + 35)
    spike_min_trainer_logprob = tl.load(parameters_ptr + 36)
    unlikely_step_clip = tl.load(parameters_ptr + 37)
    joint_limit = tl.load(parameters_ptr + 38)
    joint_weight = tl.load(parameters_ptr + 39)
    delta_edges_ptr = parameters_ptr + 40
    excess_edges_ptr = parameters_ptr + 40 + NUM_DELTA
    rows_ptr = parameters_ptr + 40 + NUM_DELTA + NUM_EXCESS  # each row's spike thresholds: 4 slopes, floor, mean row
    changepoint_threshold = tl.load(rows_ptr + 6)  # +inf: the changepoint rule does not judge
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    buckets4 = tl.arange(0, 4)
    inf = float("inf")

    tokens = tl.zeros([], dtype=tl.int32)
    compared = tl.zeros([], dtype=tl.int32)
    confident_wrong = tl.zeros([], dtype=tl.int32)
    nonfinite_engine = tl.zeros([], dtype=tl.int32)
    nonfinite_trainer = tl.zeros([], dtype=tl.int32)
    engine_count = tl.zeros([], dtype=tl.int32)
    trainer_count = tl.zeros([], dtype=tl.int32)
    first_divergent = tl.zeros([], dtype=tl.int32) + 2147483647
    sum_abs = tl.zeros([], dtype=tl.float32)
    sum_log_ratio = tl.zeros([], dtype=tl.float32)
    sum_k3 = tl.zeros([], dtype=tl.float32)
    sum_engine = tl.zeros([], dtype=tl.float32)
    sum_trainer = tl.zeros([], dtype=tl.float32)
    max_abs = tl.zeros([], dtype=tl.float32) - inf
    max_engine = tl.zeros([], dtype=tl.float32) - inf
    max_trainer = tl.zeros([], dtype=tl.float32) - inf
    margin = tl.zeros([], dtype=tl.float32) - inf  # over the tokens no side found likely
    bucket_max = tl.zeros([4], dtype=tl.float32) - inf  # the largest judged |x| of a spike candidate, per bucket
    running = tl.zeros([], dtype=tl.float32)  # the CUSUM's running sum so far
    low = tl.zeros([], dtype=tl.float32) + inf  # its running minimum
    low_at = tl.zeros([], dtype=tl.int32)  # and where (the last position that reached it)
    best_rise = tl.zeros([], dtype=tl.float32) - 1.0
    best_start = tl.zeros([], dtype=tl.int32)
    delta_counts = tl.zeros([128], dtype=tl.int32)
    excess_counts = tl.zeros([512], dtype=tl.int32)  # [candidates | other tokens] × bucket × 64 bins
    bucket_tokens = tl.zeros([4], dtype=tl.float32)
    bucket_sum = tl.zeros([4], dtype=tl.float32)
    bucket_square = tl.zeros([4], dtype=tl.float32)
    bucket_candidates = tl.zeros([4], dtype=tl.float32)

    for start in range(0, length, BLOCK):
        position = start + offsets
        inside = position < length
        valid = tl.load(mask_ptr + row * mask_stride + position, mask=inside, other=0) != 0
        tokens += tl.sum(valid.to(tl.int32), axis=0)
        engine, engine_ok, engine_bad = _logprobs(engine_ptr + row * engine_stride + position, inside, valid,
                                                  HAS_ENGINE)
        nonfinite_engine += engine_bad
        trainer, trainer_ok, trainer_bad = _logprobs(trainer_ptr + row * trainer_stride + position, inside, valid,
                                                     HAS_TRAINER)
        nonfinite_trainer += trainer_bad
        both = engine_ok & trainer_ok
        engine_count += tl.sum(engine_ok.to(tl.int32), axis=0)
        trainer_count += tl.sum(trainer_ok.to(tl.int32), axis=0)
        sum_engine += tl.sum(tl.where(engine_ok, engine, 0.0), axis=0)
        sum_trainer += tl.sum(tl.where(trainer_ok, trainer, 0.0), axis=0)
        max_engine = tl.maximum(max_engine, tl.max(tl.where(engine_ok, engine, -inf), axis=0))
        max_trainer = tl.maximum(max_trainer, tl.max(tl.where(trainer_ok, trainer, -inf), axis=0))

        log_ratio = tl.where(both, trainer - engine, 0.0)
        abs_delta = tl.abs(log_ratio)
        compared += tl.sum(both.to(tl.int32), axis=0)
        sum_abs += tl.sum(abs_delta, axis=0)
        sum_log_ratio += tl.sum(log_ratio, axis=0)
        max_abs = tl.maximum(max_abs, tl.max(tl.where(both, abs_delta, -inf), axis=0))
        capped = tl.minimum(log_ratio, k3_cap)
        series = capped * capped * (0.5 + capped * (1.0 / 6.0 + capped * (1.0 / 24.0
                                                                          + capped * (1.0 / 120.0 + capped / 720.0))))
        k3 = tl.where(tl.abs(capped) < 0.1, series, tl.exp(capped) - 1.0 - capped)
        sum_k3 += tl.sum(tl.where(both, k3, 0.0), axis=0)
        confident_wrong += tl.sum((both & (engine >= confident_logprob) & (trainer <= doubtful_logprob)).to(tl.int32),
                                  axis=0)
        divergent = both & (abs_delta > divergence_delta)
        first_divergent = tl.minimum(first_divergent, tl.min(tl.where(divergent, position, 2147483647), axis=0))

        # direction-aware detector: x = d − centre of the token's engine bucket
        engine_bucketed = tl.where(engine_ok, engine, 0.0)
        bucket = ((engine_bucketed >= edge0).to(tl.int32) + (engine_bucketed >= edge1).to(tl.int32)
            + (engine_bucketed >= edge2).to(tl.int32))
        centre = tl.load(thresholds_ptr + bucket)
        allowance = tl.load(thresholds_ptr + 4 + bucket)
        unlikely_spike = tl.load(thresholds_ptr + 12 + bucket)
        weighted = tl.load(thresholds_ptr + 16 + bucket) > 0.0
        excess = tl.where(both, (engine - trainer) - centre, 0.0)
        # the surprise weight w (rollout_guard.statistics.surprise_weight): the histograms read w·|x|, the spike
        # rules w·|x| where the bucket is calibrated (weighted), else |x|; IEEE division, as torch's
        lower = tl.where(bucket <= 1, -edge0, tl.where(bucket == 2, -edge1, -edge2))
        surprise = tl.minimum(tl.maximum(-engine, 0.0), -edge0)
        weight = tl.where(engine_ok, tl.math.div_rn(1.0 + lower, 1.0 + surprise), 1.0)
        magnitude = tl.abs(excess * weight)
        judged = tl.where(weighted, magnitude, tl.abs(excess))
        likely = both & ((engine >= spike_min_engine_logprob) | (trainer >= spike_min_trainer_logprob))
        margin = tl.maximum(margin, tl.max(tl.where(both & ~likely, judged - unlikely_spike, -inf), axis=0))
        clipped = tl.minimum(tl.maximum(excess, clip_low), clip_high)

        # CUSUM drawup, carried across blocks: C_t, min(0, min_{j≤t} C_j) and where that minimum was
        steps = tl.where(likely, clipped, tl.minimum(clipped, unlikely_step_clip))
        increment = tl.where(both, steps - allowance, 0.0)
        block_running = running + tl.cumsum(increment, axis=0)
        block_low, block_low_at = tl.associative_scan((block_running, position), 0, _last_min)
        carried = block_low > low  # a later equal value wins
        low_here = tl.where(carried, low, block_low)
        low_at_here = tl.where(carried, low_at, block_low_at)
        floor = tl.minimum(low_here, 0.0)
        rise = tl.where(inside, block_running - floor, -inf)
        starts = tl.where(floor < 0.0, low_at_here + 1, 0)
        block_best = tl.max(rise, axis=0)
        block_best_at = tl.argmax(rise, axis=0, tie_break_left=True)
        block_best_start = tl.sum(tl.where(offsets == block_best_at, starts, 0), axis=0)
        better = block_best > best_rise
        best_start = tl.where(better, block_best_start, best_start)
        best_rise = tl.maximum(best_rise, block_best)
        last = tl.minimum(length - start, BLOCK) - 1
        running = tl.sum(tl.where(offsets == last, block_running, 0.0), axis=0)
        low = tl.sum(tl.where(offsets == last, low_here, 0.0), axis=0)
        low_at = tl.sum(tl.where(offsets == last, low_at_here, 0), axis=0)

        # histograms: |Δ| of compared tokens; |x| of spike candidates, and of the other tokens, per engine bucket
        # |Δ| bin = (edges ≤ |Δ|) − 1 over 0, 1e-6 … 100 (8 per decade): a guess from the logarithm, then one
        # step either way against the exact float32 edges (the guess is off by at most one)
        guess = tl.floor((tl.log(tl.maximum(abs_delta, 1e-30)) * 0.4342944819032518 + 6.0) * 8.0).to(tl.int32) + 1
        delta_bin = tl.minimum(tl.maximum(guess, 0), NUM_DELTA - 1)
        delta_bin = tl.where(abs_delta < tl.load(delta_edges_ptr + delta_bin), delta_bin - 1, delta_bin)
        above = tl.load(delta_edges_ptr + tl.minimum(delta_bin + 1, NUM_DELTA - 1))
        delta_bin = tl.where((delta_bin + 1 < NUM_DELTA) & (abs_delta >= above), delta_bin + 1, delta_bin)
        if HISTOGRAMS:
            delta_counts += tl.histogram(tl.where(both, delta_bin, 127), 128)
        # w·|x| bin = (edges ≤ w·|x|) − 1 over 2^(k/4), k = −8 … 24 (−1 below 0.25), the same way
        guess = tl.floor(tl.log(tl.maximum(magnitude, 1e-30)) * 5.770780163555854).to(tl.int32) + 8
        excess_bin = tl.minimum(tl.maximum(guess, 0), NUM_EXCESS - 1)
        excess_bin = tl.where(magnitude < tl.load(excess_edges_ptr + excess_bin), excess_bin - 1, excess_bin)
        above = tl.load(excess_edges_ptr + tl.minimum(excess_bin + 1, NUM_EXCESS - 1))
        excess_bin = tl.where((excess_bin + 1 < NUM_EXCESS) & (magnitude >= above), excess_bin + 1, excess_bin)
        slot = tl.where(likely, 0, 256) + bucket * 64 + excess_bin
        if HISTOGRAMS:
            excess_counts += tl.histogram(tl.where(both & (excess_bin >= 0), slot, 511), 512)
        in_bucket = (bucket[:, None] == buckets4[None, :]) & both[:, None]
        bucket_tokens += tl.sum(in_bucket.to(tl.float32), axis=0)
        bucket_sum += tl.sum(tl.where(in_bucket, clipped[:, None], 0.0), axis=0)
        bucket_square += tl.sum(tl.where(in_bucket, (clipped * clipped)[:, None], 0.0), axis=0)
        bucket_candidates += tl.sum((in_bucket & likely[:, None]).to(tl.float32), axis=0)
        bucket_max = tl.maximum(bucket_max, tl.max(tl.where(in_bucket & likely[:, None], judged[:, None], -inf),
                                                   axis=0))

    nan = float("nan")
    has_compared = compared > 0
    mean_abs = tl.where(has_compared, sum_abs / tl.maximum(compared, 1).to(tl.float32), nan)
    max_abs = tl.where(has_compared, max_abs, nan)
    seq_log_ratio = tl.where(has_compared, sum_log_ratio, nan)
    kl_k3 = tl.where(has_compared, sum_k3 / tl.maximum(compared, 1).to(tl.float32), nan)
    engine_max = tl.where(engine_count > 0, max_engine, nan)
    engine_mean = tl.where(engine_count > 0, sum_engine / tl.maximum(engine_count, 1).to(tl.float32), nan)
    trainer_max = tl.where(trainer_count > 0, max_trainer, nan)
    trainer_mean = tl.where(trainer_count > 0, sum_trainer / tl.maximum(trainer_count, 1).to(tl.float32), nan)
    first_divergent = tl.where(first_divergent < 2147483647, first_divergent, -1)
    # the candidates' margin against this row's own threshold per bucket (rollout_guard.statistics.spike_per_row)
    spikes = tl.load(thresholds_ptr + 8 + buckets4)
    slopes = tl.load(rows_ptr + buckets4)
    factor = tl.log(tl.maximum(tl.sum(bucket_candidates, axis=0), 1.0) / tl.load(rows_ptr + 5))
    scaled = tl.maximum(spikes + slopes * factor, tl.load(rows_ptr + 4))
    row_spikes = tl.where(slopes > 0.0, scaled, spikes)
    margin = tl.maximum(margin, tl.max(bucket_max - row_spikes, axis=0))
    spike_margin = tl.where(margin > -inf, margin, nan)  # no token that can fire
    drift = tl.where(has_compared, tl.maximum(best_rise, 0.0), nan)
    drift_start = tl.where(has_compared, best_start, -1)
    if HAS_INJECTED:
        injected = tl.load(injected_ptr + row).to(tl.float32)
    else:
        injected = nan
    if HAS_SCORE:  # computed beside the kernel (rollout_guard.changepoint.changepoint_score)
        changepoint = tl.load(score_ptr + row).to(tl.float32)
    else:
        changepoint = nan

    reasons = (nonfinite_engine.to(tl.float32) >= min_nonfinite_engine).to(tl.int32)
    reasons += (nonfinite_trainer.to(tl.float32) >= min_nonfinite_trainer).to(tl.int32) * 2
    reasons += (max_abs > spike_delta).to(tl.int32) * 4
    reasons += (mean_abs > mean_delta).to(tl.int32) * 8
    reasons += (confident_wrong.to(tl.float32) >= min_confident_wrong).to(tl.int32) * 16
    if SPIKE_RULE:
        reasons += (spike_margin > 0.0).to(tl.int32) * 32
    joint = spike_margin + joint_weight * (drift - drift_threshold)  # NaN never fires (as the reference)
    reasons += ((drift > drift_threshold) | (joint > joint_limit)).to(tl.int32) * 64
    reasons += (changepoint > changepoint_threshold).to(tl.int32) * 128  # NaN, −inf never fire

    out = out_ptr + samples_at + row * WIDTH
    tl.store(out + 0, tokens.to(tl.float32).to(tl.float64))
    tl.store(out + 1, compared.to(tl.float32).to(tl.float64))
    tl.store(out + 2, max_abs.to(tl.float64))
    tl.store(out + 3, mean_abs.to(tl.float64))
    tl.store(out + 4, seq_log_ratio.to(tl.float64))
    tl.store(out + 5, kl_k3.to(tl.float64))
    tl.store(out + 6, engine_max.to(tl.float64))
    tl.store(out + 7, engine_mean.to(tl.float64))
    tl.store(out + 8, trainer_max.to(tl.float64))
    tl.store(out + 9, trainer_mean.to(tl.float64))
    tl.store(out + 10, confident_wrong.to(tl.float32).to(tl.float64))
    tl.store(out + 11, first_divergent.to(tl.float32).to(tl.float64))
    tl.store(out + 12, nonfinite_engine.to(tl.float32).to(tl.float64))
    tl.store(out + 13, nonfinite_trainer.to(tl.float32).to(tl.float64))
    tl.store(out + 14, injected.to(tl.float64))
    tl.store(out + 15, spike_margin.to(tl.float64))
    tl.store(out + 16, drift.to(tl.float64))
    tl.store(out + 17, drift_start.to(tl.float32).to(tl.float64))
    tl.store(out + 18, changepoint.to(tl.float64))
    tl.store(out_ptr + reasons_at + row, reasons.to(tl.float64))
    if row == 0:
        tl.store(out_ptr, 1.0)  # status: ok

    # this process's step aggregates (rollout_guard.packet.AGGREGATES; the maxima start at −inf)
    aggregates = out_ptr + aggregates_at
    tl.atomic_add(aggregates + 0, tokens.to(tl.float64), sem="relaxed")
    tl.atomic_add(aggregates + 1, compared.to(tl.float64), sem="relaxed")
    tl.atomic_add(aggregates + 2, confident_wrong.to(tl.float64), sem="relaxed")
    tl.atomic_add(aggregates + 3, nonfinite_engine.to(tl.float64), sem="relaxed")
    tl.atomic_add(aggregates + 4, nonfinite_trainer.to(tl.float64), sem="relaxed")
    if compared > 0:
        tl.atomic_max(aggregates + 5, max_abs.to(tl.float64), sem="relaxed")
        if reasons == 0:
            tl.atomic_max(aggregates + 8, max_abs.to(tl.float64), sem="relaxed")
        tl.atomic_add(aggregates + 9, mean_abs.to(tl.float64) * compared.to(tl.float64), sem="relaxed")
        tl.atomic_add(aggregates + 10, compared.to(tl.float64), sem="relaxed")
        tl.atomic_add(aggregates + 11, kl_k3.to(tl.float64) * compared.to(tl.float64), sem="relaxed")
        tl.atomic_add(aggregates + 12, compared.to(tl.float64), sem="relaxed")
    if engine_count > 0:
        tl.atomic_max(aggregates + 6, engine_max.to(tl.float64), sem="relaxed")
        engine_weight = (tokens - nonfinite_engine).to(tl.float64)
        tl.atomic_add(aggregates + 13, engine_mean.to(tl.float64) * engine_weight, sem="relaxed")
        tl.atomic_add(aggregates + 14, engine_weight, sem="relaxed")
    if trainer_count > 0:
        tl.atomic_max(aggregates + 7, trainer_max.to(tl.float64), sem="relaxed")
        trainer_weight = (tokens - nonfinite_trainer).to(tl.float64)
        tl.atomic_add(aggregates + 15, trainer_mean.to(tl.float64) * trainer_weight, sem="relaxed")
        tl.atomic_add(aggregates + 16, trainer_weight, sem="relaxed")
    if HAS_INJECTED:
        tl.atomic_add(aggregates + 17, injected.to(tl.float64), sem="relaxed")
        tl.atomic_add(aggregates + 18, 1.0, sem="relaxed")
        if (injected == 1.0) & (reasons != 0):
            tl.atomic_add(aggregates + 20, 1.0, sem="relaxed")
    if reasons != 0:
        tl.atomic_add(aggregates + 19, 1.0, sem="relaxed")
        for bit in tl.static_range(8):
            if (reasons >> bit) & 1:
                tl.atomic_add(aggregates + 21 + bit, 1.0, sem="relaxed")

    bins128 = tl.arange(0, 128)
    tl.atomic_add(out_ptr + histogram_at + bins128, delta_counts.to(tl.float64), mask=bins128 < NUM_DELTA,
                  sem="relaxed")
    if reasons == 0:  # a kept sample feeds the calibration
        calibration = out_ptr + calibration_at + buckets4 * CAL_WIDTH
        tl.atomic_add(calibration + 0, bucket_tokens.to(tl.float64), sem="relaxed")
        tl.atomic_add(calibration + 1, bucket_sum.to(tl.float64), sem="relaxed")
        tl.atomic_add(calibration + 2, bucket_square.to(tl.float64), sem="relaxed")
        tl.atomic_add(calibration + 3, bucket_candidates.to(tl.float64), sem="relaxed")
        bins512 = tl.arange(0, 512)  # slot 511 (bin 63 of the last bucket's other tokens) takes what is not counted
        tl.atomic_add(out_ptr + calibration_at + ((bins512 % 256) // 64) * CAL_WIDTH + 4 + (bins512 // 256) * NUM_EXCESS
                      + bins512 % 64, excess_counts.to(tl.float64), mask=bins512 % 64 < NUM_EXCESS, sem="relaxed")
        tl.atomic_add(out_ptr + kept_at, 1.0, sem="relaxed")
