"""The one configuration object of the guard.

Every threshold is in natural-log units (nats) of token probability unless it says tokens. Why the defaults:
clean rollouts from a bf16 engine differ from the trainer by ~0.01–0.05 nat per token on average and rarely by
more than ~0.5 nat on a single token (2 on a rare, low-probability token); an fp32 engine agrees to ~1e-6.
Stale-engine-state corruption (vLLM PR #32118: a new request read another request's SSM state) produces text
that the engine is confident about and the trainer, reading the true prompt, finds unlikely: several nats on
most tokens. An integer overflow in a scan kernel showed up as isolated spikes of many nats. The defaults sit an
order of magnitude above clean bf16 noise and an order of magnitude below those failures.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

from rollout_guard.errors import GuardConfigError

MODES = ("monitor", "quarantine")
ON_CEILING = ("stop", "raise", "alert")


def _is_number(value: object) -> bool:
    """A real number, not a bool (``True`` is an ``int`` to Python, never a threshold here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class GuardConfig:
    """Settings of the rollout guard. A rule whose threshold is ``None`` is off."""

    mode: str = "quarantine"
    """``"monitor"``: measure, judge and report only. ``"quarantine"``: also remove suspect samples from the loss
    (zero loss mask, excluded from their group's advantage baseline, loss normaliser corrected). Default
    ``"quarantine"``."""

    spike_delta: float | None = 25.0
    """nats. Rule ``token_spike``, a fixed ceiling that needs no calibration: some token's |engine − trainer|
    logprob exceeds this, whatever the token. Healthy 7B runs reach 10.6–13.2 nats (dense) and ≈ 18 nats (hybrid)
    per step on tokens both sides find unlikely (allenai/open-instruct ``docs/hybrid-rl-logprobs.md``), so the
    ceiling sits above those; ``directional_spike`` catches smaller spikes where they matter. Release 0.1 used 8.0,
    which fired on healthy heavy-tailed runs in the fidelity benchmark. Default 25.0."""

    mean_delta: float | None = 2.5
    """nats per token. Rule ``mean_drift``, a fixed ceiling: the sample's mean |engine − trainer| logprob over its
    compared tokens exceeds this, in either direction. Above the processed-logprob offset of an early high-entropy
    policy sampled with top_k=5 (≈ 1.5 nats per token, issue 10) and the per-step mean of healthy hybrid runs
    (0.24–0.58); below confident stale-state gibberish. The calibrated ``drift`` rule catches subtler drift (engine
    above the trainer only). Lowered from 3.0 when the uncalibrated spike threshold went to 4 nats: an engine
    with other weights, 2.7–3.4 nats below the trainer on 5 of 6 tokens (mean 2.68), was then flagged by nothing in
    a fresh guard (``rollout-guard replay``; ``tests/integrations/test_audit_stress.py`` caught it); on the fidelity
    benchmark 2.5 added no false quarantine in any of the 27 conditions. Release 0.1 used 1.0, which flagged every
    clean sample of a top_k=5 high-entropy run. Default 2.5."""

    confident_logprob: float = math.log(0.5)
    """nats. An engine logprob at or above this makes a token *confident* (p ≥ 0.5). Default ln 0.5 ≈ −0.693."""

    doubtful_logprob: float = math.log(0.01)
    """nats. A trainer logprob at or below this makes a token *doubtful* (p ≤ 0.01). Default ln 0.01 ≈ −4.605."""

    confident_wrong_tokens: int | None = 2
    """tokens. Rule ``confident_wrong``: at least this many tokens are confident for the engine and doubtful for
    the trainer (each one is a ≥ 3.9-nat disagreement in the direction of the AI21 signature). Default 2."""

    nonfinite_engine_tokens: int | None = 1
    """tokens. Rule ``nonfinite_engine``: at least this many of the sample's engine logprobs are NaN or ±inf
    (an engine that cannot score its own token is itself evidence). Default 1."""

    nonfinite_trainer_tokens: int | None = 1
    """tokens. Rule ``nonfinite_trainer``: at least this many trainer logprobs are NaN or ±inf; such a sample
    would poison the loss whatever the engine did. Default 1."""

    spike_excess: float | None = 4.0
    """nats. Rule ``directional_spike``: some token that one side found likely (``spike_min_engine_logprob``,
    ``spike_min_trainer_logprob``) has ``|x|``, ``x = (engine − trainer) − centre``, above its engine bucket's
    threshold: this value until the bucket is calibrated (or the batch's own reading where that is lower:
    :func:`rollout_guard.statistics.batch_spike_thresholds`), then the run's extrapolated ``1 − α`` quantile of healthy
    ``w · |x|`` (α from ``false_alarm_budget``; see :mod:`rollout_guard.calibration`; ``w`` ≥ 1 the token's
    :func:`rollout_guard.statistics.surprise_weight`, which the calibrated rule reads too), never below
    ``calibrated_spike_floor``. The other tokens, which neither side found likely, are judged too once calibrated,
    against a threshold of their own that is +inf while their healthy tail is heavy
    (:func:`rollout_guard.calibration.unlikely_spike_threshold`). Catches 1–3 isolated spikes (the scan-kernel
    overflow of vLLM PR #35275) in either direction. Measured on the fidelity benchmark (1,000 faults per
    condition): with 3.0, the hybrid heavy-tail noise put 4–11 clean samples per condition (up to 0.14 %) over it
    in the first, uncalibrated steps (an engine logprob of −4…−6 for a token the trainer gives ≥ 20 %), with 4.0 none;
    recall of isolated spikes fell by 0–1 point. Above the processed-logprob offset of an uncalibrated top-k=5
    high-entropy policy (≈ 1.5 nats). Measured on rows of up to 256 tokens: for longer rows it rises by 0.9 nats
    per e-fold of tokens per row (:data:`rollout_guard.statistics.UNCALIBRATED_SPIKE_SLOPE`; with rows of ~2,000
    tokens, 4 nats flagged 0.21–0.30 % of the healthy rows under the hybrid-7B tail). Default 4.0."""

    calibrated_spike_floor: float = 1.5
    """nats. Once a bucket is calibrated (``calibration_warmup_tokens`` kept tokens), its spike threshold (on
    ``w · |x|``, :func:`rollout_guard.statistics.surprise_weight`) is the larger of this and the run's extrapolated
    healthy quantile (with fewer than 50 spike candidates,
    :data:`rollout_guard.calibration.MIN_SPIKE_CANDIDATES`: the Gaussian bound of its tokens' spread, capped at
    ``spike_excess``); before, ``spike_excess`` applies. Lower than ``spike_excess`` so that a 3-nat spike still
    fires when the token's own noise or a processed-logprob offset takes up to 1.5 nats off it. Measured on the
    fidelity benchmark (1,000 faults per condition, 27 conditions, 91,776 clean samples): 2.0 → 1.5 kept the false
    quarantines at 22 and caught 160 more late-onset rows (missed 854 → 694), 36 more moderate ones, 33 more
    truncated; 1.0 added 6 false quarantines (3 in a top-k = 20 condition, whose renormalisation offsets reach 2.2
    nats, and the pooled hybrid-tail stream over 0.1 %). (In 2026-11 with the budget quantile read directly, before
    :func:`rollout_guard.calibration.extrapolated_quantile`, 1.5 had fired on those top-k = 20 rows.) Default 1.5."""

    spike_min_engine_logprob: float = -3.0
    """nats. A token the engine gave at least this logprob is a ``directional_spike`` candidate (either direction).
    Corruption puts tokens the engine found likely (stale state: −2.5…−0.5 nats in the fault zoo; after a top-k=5
    policy's flattening, down to −3.6), while healthy runs put their large |Δ| (10–18 nats in 7B runs,
    allenai/open-instruct) on tokens both sides find unlikely, and healthy noise grows with a token's surprise
    (measured on the fidelity benchmark's H200 rollouts: std of Δ 0.001 nats at engine logprob > −0.1, 0.02–0.03 at
    −3…−1), which the calibrated per-bucket thresholds absorb. Measured on the fidelity benchmark (1,000 faults per
    condition) against ln 0.2 on both sides: single spikes 95.3 → 99.4 % pooled (top-k=5 condition 57–59 → 94–99 %),
    late onset 93.5 → 96.9 %, isolated spikes 92.5 → 95.0 %, at 1–2 more false quarantines in three of the 27
    conditions (of 7,040–15,488 clean samples each) as long as the trainer side keeps its own, higher cut
    (``spike_min_trainer_logprob``). Default −3.0 (≈ ln 0.0498): the lowest edge of the engine-logprob buckets
    (:data:`rollout_guard.statistics.ENGINE_BUCKET_EDGES`), so that every token of the buckets above it is a
    candidate. At ln 0.05 (−2.9957) a token between the two belonged to the bucket above −3 nats without being a
    candidate, and that bucket's own threshold for tokens no side found likely never filled: such a token was not
    judged at any size (the top-k = 5 streams' flattening puts a few corrupted tokens there; measured on the
    fidelity benchmark, 1,000 faults per condition: single spikes missed 8 → 7 of 27,000, nothing else moved). A
    cut above −3 nats leaves the tokens between −3 and the cut to that bucket's threshold for tokens no side found
    likely (judged once it holds enough of them: :func:`rollout_guard.calibration.unlikely_min_tokens`)."""

    spike_min_trainer_logprob: float = math.log(0.2)
    """nats. A token the trainer gave at least this logprob is a ``directional_spike`` candidate too (an engine
    that returns a garbage low logprob for a token the trainer finds likely: the scan-kernel overflow's other
    direction). Higher than the engine's cut because the hybrid heavy-tail noise model lifts the trainer's logprob
    of tokens the engine put at −5…−10 nats to −3…−2 (measured: with ln 0.05 here, 4–11 clean samples per condition went
    over the threshold); at ln 0.2 that noise reaches it a few times per 10,000 samples, which the calibrated threshold
    of the bucket below −3 nats covers. Tokens under both cuts are judged against their own threshold
    (:func:`rollout_guard.calibration.unlikely_spike_threshold`: 1.5 × the |x| only 4 kept such tokens exceed, when
    that is within ``spike_excess``, else not judged; only once the bucket holds 10,000–100,000 of them,
    :func:`rollout_guard.calibration.unlikely_min_tokens`; 100,000 when this was measured): measured on the
    fidelity benchmark (1,000 faults per condition), isolated spikes 95.3 → 97.7 % pooled (100 % in five of the 18
    real-noise conditions, 95.8–99.6 % in the others, whose 512–1,664 clean rollouts leave most steps before the
    bucket holds 100,000 such tokens; top-k=5 87.8–90.9 → 98.2–99.8 %), none gained under the heavy-tail noise
    models (a garbage low logprob there is inside the healthy tail), false quarantines unchanged (70 of 91,776
    clean samples). Measured again with the calibrated detector of 2026-12-01 (1,000 faults per condition):
    ln 0.1 would miss 288 instead of 356 of 27,000 isolated spikes for 15 instead of 7 false quarantines of
    122,368, the worst condition at 0.087 % (hybrid-7B tail), ln 0.05 257 for 28 (0.198 %): the half of the goal
    held in reserve decides. Measured once more on the engine's support (``compare_on_engine_support``; 2026-12-02,
    seed 0): ln 0.1 misses 260 instead of 320 isolated spikes for 12 instead of 6 false quarantines (worst 0.074 %,
    hybrid-7B tail), the same in four other modes (seed 1, sampling untold, dense phase 2, option off: 57–65 fewer
    missed for 3–8 more false); one cell newly at 99.9 % in two of the five (a top-k = 5 one), none in the others: kept.
    Default ln 0.2 ≈ −1.61."""

    drift_threshold: float | None = 6.0
    """nats. Rule ``drift``: the CUSUM of ``clip(x, −2, 4) − allowance`` over the sample's tokens exceeds the
    drift threshold: this value until the run's own is read (then never above this). Catches corruption from token
    0 at any confidence and corruption that starts late (a CUSUM does not care where a run starts); one healthy
    tail token moves it by at most 4 nats (1.5 if no side found it likely). Default 6.0."""

    calibrated_drift_floor: float = 2.5
    """nats. Once :data:`rollout_guard.calibration.MIN_DRIFT_ROWS` kept samples were judged with the same kind of
    allowance, the drift threshold is the run's own: the extrapolated ``1 − false_alarm_budget / 1000`` quantile of
    the kept samples' CUSUM (:func:`rollout_guard.calibration.drift_threshold`), never below this and never above
    ``drift_threshold``. At 2.5, one token no side found likely (its CUSUM step clipped at 1.5 nats,
    :data:`rollout_guard.statistics.UNLIKELY_STEP_CLIP`, less the allowance of ≥ 0.5) can never fire it: a
    healthy tail token is the spike rules' business, judged against its bucket's own tail. Measured on the fidelity
    benchmark (1,000 faults per condition, every setting judged after 20 steps of it): with those tokens' steps
    clipped at 4 nats like the others, a floor of 3.0 flagged 0.16 % of the judgements of healthy rows in the
    dense-7B-tail streams (a tail token in ~1 % of rows, below the reading's 1 % anchor), so it sat at 3.5; with
    the clip at 1.5, at 2.5: 28 of 888,995 judgements of resampled healthy rows flagged (61–70 at 3.5 without the
    clip), late-onset rows missed 387 → 280 of 27,000, moderate ones 126 → 102; at 2.0, 35, 248 and 94. Default 2.5."""

    joint_margin: float | None = 0.4
    """nats. The ``drift`` rule also fires on a sample whose two kinds of evidence both fall just short: when
    ``spike_margin + joint_drift_weight · (drift CUSUM − drift threshold) > −joint_margin`` (each term ≤ 0 when
    neither rule fires on its own; the thresholds are those in use, calibrated or not). Late-onset corruption whose
    worst token sits a little under its spike threshold and whose CUSUM sits a little under its own is such a
    sample; a healthy one is rarely near both. One likely token alone can fire it too, its own CUSUM step being
    most of the CUSUM: at a calibrated drift threshold of 2.5 nats and an allowance of 0.5, a token ε nats under a
    spike threshold t fires it if ε < 0.2·t − 0.28, so in effect a calibrated spike threshold moves down by up to
    0.12 nats at t = 2 and 0.32 at t = 3 (above 3 nats such a token's step less the allowance already passes 2.5
    and the CUSUM alone fires; before the drift threshold is calibrated, at 6 nats, neither happens); the
    measurement below includes that. A NaN spike margin (no token that can fire) never fires it; ``None`` turns
    it off. Chosen by re-judging the stored statistics of the fidelity benchmark (seed 0, 1,000 faults per
    condition): 0.4 with the weight 0.25 caught 34 of the 102 missed late-onset rows for 12 more flagged
    judgements of healthy rows in 1,011,363 (0.5: 49 for 50; weight 0.5: 19 for 8). Measured with it in the
    guard (`benchmarks/results-2026-12-01-eleventh/`): late onset missed 102 → 68 of 27,000, moderate 11 → 5,
    real late onset 2 → 0 of 3,052, false quarantines 7 → 7 of 122,368, resampled judgements flagged 20 → 22
    of 888,995; held out (seed 1) late onset 116 → 80, moderate 16 → 9, false 6 → 6, resampled 33 → 37.
    Default 0.4."""

    joint_drift_weight: float = 0.25
    """nats of spike margin per nat of drift CUSUM in ``joint_margin``'s sum (a CUSUM nat is weaker evidence:
    it builds up over many tokens). Default 0.25 (see ``joint_margin``)."""

    drift_allowance: float = 0.5
    """nats per token. What ``x`` may average per token on a run before the drift CUSUM grows, once the run's own
    offset per engine bucket is known (its first 2,000 kept tokens); a bucket whose healthy spread is large gets more
    (see :mod:`rollout_guard.calibration`). Moderate corruption averages ≥ 0.7 nats per token. Default 0.5."""

    warmup_drift_allowance: float = 2.0
    """nats per token. The allowance while a bucket's offset is unknown (its first 2,000 kept tokens: the first
    step of a run, or after a change of the sampling settings) and its batch holds too few of its tokens for a
    centre of its own (:func:`rollout_guard.statistics.batch_thresholds`), judged around 0: above the
    processed-logprob offset of an early, high-entropy policy sampled with top_k=5 (≈ 1.5 nats per token), below
    confident stale-state gibberish (≥ 2 nats per token). Also the most a batch's own allowance may be, so that the
    spread of its corrupted rows cannot loosen it further. Default 2.0."""

    false_alarm_budget: float = 0.5
    """expected false ``directional_spike`` firings per 1,000 clean samples, from which each bucket's calibrated
    spike threshold is set (the healthy ``x`` quantile at 1 − budget / 1000 / tokens per sample in the bucket). The
    calibrated drift threshold is read at the same share (``calibrated_drift_floor``) and the drift allowance from
    it (:mod:`rollout_guard.calibration`), so with ``changepoint_budget`` the rules' budgets add to 1.2 per 1,000
    where each rule fires at exactly its own share and never with another, over the goal of ≤ 1 (measured on the
    fidelity benchmark, flagged judgements of resampled healthy rows, worst condition: 0.043 % in the default noise
    shape; 0.090–0.116 % in the measured softmax one, where drift and ``changepoint`` fire above their own share
    (0.072 % and 0.030 % of the worst stream's judgements at 4,000 faults) and a fifth to a third of the flagged
    judgements trip two rules. At 0.4: 0.019 % and 0.105 %, for 3 more isolated spikes missed and, in the softmax
    shape, 2 more late-onset and 5 more single-spike rows, of 27,000 each:
    ``benchmarks/results-2026-12-05-thirtyeighth/variants/``; not taken). Default 0.5 (half the goal of ≤ 1 false
    quarantine per 1,000)."""

    changepoint_budget: float | None = 0.0002
    """share of the kept samples' scores, from which the threshold of rule ``changepoint`` is read: a sample fires
    where its change-point log likelihood ratio (:func:`rollout_guard.changepoint.changepoint_score`, against the
    calibration's per-bucket centre and spread, each token's log ratio held to at most
    :data:`rollout_guard.changepoint.TOKEN_CAP`, 10 nats, since the thirty-seventh session) exceeds the
    ``1 − changepoint_budget`` point of the scores of the samples kept by the other rules
    (:func:`rollout_guard.calibration.changepoint_threshold`), never above ln 1000
    (:data:`rollout_guard.calibration.CHANGEPOINT_CEILING`, where it sits until
    :data:`rollout_guard.calibration.MIN_CHANGEPOINT_ROWS` such samples were scored with the same buckets read).
    Buckets whose centre the calibration does not know yet (the first step of a run or of a new sampling setting)
    are read around the batch's own centre and spread, as the other rules judge them there
    (:func:`rollout_guard.statistics.batch_thresholds`; before the thirty-fourth session the rule did not judge
    such a step: ``benchmarks/results-2026-12-04-thirtyfourth/``, late onset missed 7 → 6 told, 4 → 3 seed 2, 8 → 7,
    10 → 10 and 17 → 15 at 4,000 faults, moderate 2 → 0 seed 1, false quarantines 6 → 7 told and phase 2 dense (one
    healthy row this rule flagged, its condition then at 0.026 %), flagged resampled judgements unchanged). For
    corruption that starts late in a row and lags by a few nats on each token after: what per-token rarity and the
    drift CUSUM miss under a heavy healthy tail. Only when the guard is told the sampling settings (as the
    calibrated drift threshold), and not where the engine's logprobs are renormalised over a top-k or min-p support
    that the trainer's are not compared on (``compare_on_engine_support`` off, or a setup it cannot serve: the TRL
    adapter sets :attr:`rollout_guard.calibration.Calibration.per_token_offset`): such an offset varies from token
    to token, inside the noise the rule takes as one Gaussian per bucket (measured with it judging there: false
    quarantines 7 → 23 of 122,368, a top_k = 20 run at 0.59 %). ``None``: off. Default 0.0002, from the fidelity
    benchmark (1,000 faults per condition unless said; ``benchmarks/results-2026-12-04-thirtysecond/``), off → on:
    late onset missed 12 → 7 of 27,000 (seed 1: 9 → 2; phase 2 dense: 12 → 7; 4,000 faults: 25 → 8 and 24 → 10 of
    108,000), moderate ones at 4,000 faults 5 → 0 and 2 → 0, real context swaps 7 → 6; false quarantines 6 → 6
    (seed 1 6 → 6, 4,000 faults 5 → 5 and 7 → 8, worst 0.037 %); flagged judgements of resampled healthy rows
    27 → 45 of 888,995 (15 distinct rows of 117,987; worst condition 0.039 %); cells at the goal 198 → 198 of 217
    (seed 1 197 → 198, 4,000 faults 198 → 199 and 197 → 198: the hybrid-7B-tail late-onset cells). The
    twenty-eighth session's prototype read 0.0005 over 0.25-nat bins; 0.0002 was the budget its 4,000-row runs
    reached those cells at (thirty-first session). 0.0005 in the library (thirty-third session,
    ``benchmarks/results-2026-12-04-thirtythird/``) caught 2–5 more late-onset rows at 4,000 faults for ~1.5× the
    flagged resampled judgements and no more false quarantines, but left both cells below the goal in the held-out
    seed 2; over five seeds at 4,000 faults (thirty-fifth session, ``benchmarks/results-2026-12-04-thirtyfifth/``)
    it catches 2–5 more per run, pooled 99.850 → 99.880 % (hybrid-seed1) and 99.865 → 99.900 % (llama); with the
    per-token cap, over ten seeds (thirty-ninth and fortieth sessions, ``benchmarks/results-2026-12-05-fortieth/``),
    99.858 → 99.880 % and 99.853 → 99.892 %, both still below the goal (the llama cell's 99.912 % over the first six
    seeds did not hold on the four held out), no more false quarantines, flagged resampled judgements 1.4–2.0× (worst
    0.068 %): each extra corrupted row caught costs a run ~220–330 healthy rollouts flagged where faults are 2 % of
    its rollouts, ~4,500–6,700 where they are 0.1 % (~47 and ~950 if all were late onset). Those ten seeds were
    run with the benchmark's faults at 2 % of each step; at AI21's rate, 0.1 % (forty-first session,
    ``benchmarks/results-2026-12-05-fortyfirst/``), the default catches 99.860 % and 99.905 % [99.870, 99.931]
    there, the llama cell at the goal. Costs
    0.08–0.91 ms per step on an H200 (its Triton kernel, 64 × 1,024 to 512 × 16,384 tokens), the guard's step then
    1.37–1.92× TRL's own mismatch-metric ops instead of ~1× (``benchmarks/statistics_speed.py``, thirty-eighth
    session)."""

    calibration_warmup_tokens: int = 20_000
    """tokens. A bucket's calibration is used once this many (decayed) kept tokens have fed its histograms (after
    the :data:`rollout_guard.calibration.CENTRE_WARMUP_TOKENS` that set its centre); before, the fixed thresholds
    apply. Default 20,000 (a 0.1 % quantile then rests on ~20 tokens)."""

    calibration_decay: float = 0.95
    """per step. The calibration's counts are multiplied by this before each step's kept tokens are added (a
    memory of ~20 steps, so it follows the policy as it sharpens). Default 0.95."""

    divergence_delta: float = 1.0
    """nats. A token whose |Δ| exceeds this counts as *divergent*; the index of the first one is reported with
    each sample as evidence (no rule uses it). Default 1.0."""

    fused_statistics: bool = True
    """``True``: when the evidence is on a CUDA device and Triton is installed, compute the statistics, the
    verdict, the histograms and the calibration contributions in one fused kernel
    (:mod:`rollout_guard.fused_statistics`), and the ``changepoint`` rule's score in one more
    (:mod:`rollout_guard._changepoint_kernel`); elsewhere, and with ``False``, the pure-torch reference
    (:func:`rollout_guard.packet.reference_packet`). Both give the same packet up to the order of float32 sums.
    Default True (on an H200 the kernel makes the guard's step as fast as TRL's own mismatch metrics, 1.4–2.3× as
    long with the ``changepoint`` rule on: see ``benchmarks/statistics_speed.py``)."""

    compare_on_engine_support: bool = True
    """TRL adapter, when the engine samples with top-k (with or without top-p and min-p) or with min-p alone, and no
    penalty, logit bias or guided decoding: judge the trainer's logprob renormalised over the engine's kept support,
    ``trainer − log Z`` (:mod:`rollout_guard.support`), as vLLM's processed logprobs are, instead of calibrating the
    offset ``−log Z`` away. ``Z`` comes from the trainer's own hidden states in the pass that computes its logprobs
    (a hook on the backbone, one more LM-head projection and a ``topk`` of the vocabulary per completion token; no
    extra forward pass, no host sync; on one H200, 1.5 B-parameter shape, vocabulary 151,936: +45 ms next to TRL's
    135-ms scoring pass of 16 × 1,024 tokens, 8 % of that pass and the training pass together,
    ``benchmarks/support_overhead.py``); a token whose recomputed logprob
    differs from TRL's by more than 0.1 nat keeps ``log Z = 0``, and a failure in the hook on any process turns the
    option off for the run on every process: that step is not judged (one ``guard_failures``) and the calibration
    starts over from the next. Top-p alone stays with the calibration: its offset is at most
    ``−log top_p`` and its ``log Z`` would need a sort of the vocabulary per token (+296 ms there). The offset varies
    token by token (standard deviation 0.26–0.35 nats under top-k = 20 on the fidelity benchmark's H200 rollouts;
    the engine-vs-trainer noise of the same tokens on one support: 0.014–0.025), so on the support the calibrated
    thresholds sit far lower. Measured on the fidelity benchmark (``--same-support``; seed 0, 1,000 faults per
    condition): late onset missed 68 → 15 of 27,000, one spike 7 → 3, false quarantines 7 → 6 of 122,368 (README,
    "How well it decides"). Default True; ``False``: the calibration alone absorbs the offset, as before this
    option."""

    compute_trainer_logprobs: bool = True
    """When there are engine logprobs but the trainer did not compute its own logprobs of the sampled tokens (TRL
    with ``vllm_importance_sampling_correction=False``), run one extra no-grad forward pass to get them (one forward
    pass over the generation batch per generation step); with ``mask_truncated_completions``, also the pass over
    the truncated rows whose trainer logprobs TRL computed under a zero mask (those rows only). ``False``: no extra
    pass; without trainer logprobs the guard then checks non-finite engine logprobs only. Never used without an
    engine (``use_vllm=False``, no ``rollout_func``): rollouts from the trainer's own model have nothing to
    disagree with, so no pass is run there. Default True (the mismatch rules need both sides)."""

    output_dir: str | None = None
    """Folder for the guard's local files (metrics, quarantine store, charts). ``None``: the trainer's
    ``output_dir`` + ``/rollout_guard``. Default None."""

    evidence_samples_per_step: int = 16
    """samples per step. Full evidence (token ids, decoded prompt, completion and tokens, engine and trainer
    logprobs per token) is recorded for at most this many suspect samples per step, the worst first: by the most
    severe rule that fired, in the verdict's rule order (non-finite values, then the fixed ceilings, then the
    calibrated rules), then by max |Δ| (largest first), then by rollout index. Every other suspect sample still gets
    a record with its statistics, rules and rewards but no tokens (``full_evidence`` false), so counts cover all.
    0 records no tokens at all. Bounds the per-step cost of decoding and writing: a full record of a 16,384-token
    completion is ~1 MB of JSON, so a step writes at most ~16 MB however many samples are suspect (half the batch
    can be, under the circuit breaker's default); 16 also covers the HTML report's 10 worst samples and W&B's
    worst-sample chart. Default 16."""

    chart_every_steps: int = 25
    """steps. Redraw the local spike chart every this many guarded steps (and at the end of training).
    Default 25."""

    image_every_steps: int = 50
    """steps. Charts sent to W&B as images (spike chart, worst sample token by token) at least every this many
    steps. Default 50."""

    spike_image_min_gap_steps: int = 10
    """steps. On a step with suspect samples, images are sent again only if the last ones are at least this old,
    so a run full of spikes does not send an image per step. Default 10."""

    alert_jump: float = 3.0
    """× baseline. An alert fires when the quarantined share or the max |Δ| exceeds this multiple of its running
    baseline (an exponential moving average over past steps). Default 3.0."""

    alert_min_share: float = 0.02
    """share of rollouts (0–1). The quarantine-rate alert also needs at least this share in the step, so one
    sample in a large batch does not page anyone (it is still quarantined and tabled). Default 0.02."""

    alert_baseline_steps: int = 50
    """steps. Horizon of the running baselines (EMA weight 2 / (n + 1)). Default 50."""

    alert_cooldown_steps: int = 100
    """steps. At most one alert of each kind per this many steps. Default 100."""

    max_quarantine_share: float | None = 0.5
    """share of a step's rollouts (0–1). Circuit breaker: when more than this share of a step's rollouts is
    suspect for ``ceiling_steps`` steps in a row, the engine is broken rather than one sample, and the guard
    acts as ``on_ceiling`` says (in monitor mode it only alerts). Default 0.5."""

    ceiling_steps: int = 1
    """steps. Consecutive steps above ``max_quarantine_share`` before the circuit breaker trips. Default 1."""

    on_ceiling: str = "stop"
    """``"stop"``: end training cleanly after the current step, with a message saying why (``trainer.train()``
    returns normally: check ``summary.json["stopped"]``). ``"raise"``: raise ``CircuitBreakerTripped`` (a
    ``GuardError``) from ``trainer.train()`` once the guard's records and summary are written, so a script or
    pipeline cannot mistake the stop for success. ``"alert"``: send an error-level alert (at most once per
    ``alert_cooldown_steps``) and go on. In monitor mode the breaker always only alerts. Default ``"stop"``."""

    strict: bool = False
    """``True``: any failure inside the guard raises and stops training. ``False``: a failure is logged and
    counted (``guard_failures``), the step's batch passes through unguarded, and training goes on. Structural
    input errors on the first guarded step raise in both cases: they mean the guard is wired wrong. A failure
    beside the verdict (writing records, decoding, a sink) with several processes is raised on every process at
    the next step's judgement, carried in its gather (raised on one process only, it left the others waiting in
    the loss's collectives); after the last step, at the end of training on the failing process. Default
    False."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise GuardConfigError("mode", self.mode, f"use one of {MODES}")
        for name in ("spike_delta", "mean_delta"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and value > 0 and math.isfinite(value)):
                raise GuardConfigError(name, value, "use a positive finite number of nats, "
                                       "or None to turn the rule off")
        for name in ("confident_wrong_tokens", "nonfinite_engine_tokens", "nonfinite_trainer_tokens"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise GuardConfigError(name, value, "use a whole number of tokens ≥ 1, or None to turn the rule off")
        for name in ("confident_logprob", "doubtful_logprob"):
            value = getattr(self, name)
            if not (_is_number(value) and math.isfinite(value) and value < 0):
                raise GuardConfigError(name, value, "use a finite log-probability in nats below 0, e.g. math.log(0.5)")
        if self.doubtful_logprob >= self.confident_logprob:
            raise GuardConfigError("doubtful_logprob", self.doubtful_logprob,
                                   f"use a value below confident_logprob={self.confident_logprob:g} "
                                   "(a token cannot be both)")
        if not (_is_number(self.calibrated_spike_floor) and 0 <= self.calibrated_spike_floor < math.inf):
            raise GuardConfigError("calibrated_spike_floor", self.calibrated_spike_floor, "use nats ≥ 0, e.g. 1.5")
        if not (_is_number(self.calibrated_drift_floor) and 0 <= self.calibrated_drift_floor < math.inf):
            raise GuardConfigError("calibrated_drift_floor", self.calibrated_drift_floor, "use nats ≥ 0, e.g. 3.0")
        for name in ("spike_excess", "drift_threshold"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and value > 0 and math.isfinite(value)):
                raise GuardConfigError(name, value, "use a positive finite number of nats, "
                                       "or None to turn the rule off")
        if self.joint_margin is not None and not (_is_number(self.joint_margin) and 0 <= self.joint_margin < math.inf):
            raise GuardConfigError("joint_margin", self.joint_margin,
                                   "use nats ≥ 0, e.g. 0.4, or None to turn it off")
        if not (_is_number(self.joint_drift_weight) and 0 <= self.joint_drift_weight < math.inf):
            raise GuardConfigError("joint_drift_weight", self.joint_drift_weight,
                                   "use a finite weight ≥ 0, e.g. 0.25")
        for name in ("drift_allowance", "warmup_drift_allowance"):
            value = getattr(self, name)
            if not (_is_number(value) and 0 <= value < math.inf):
                raise GuardConfigError(name, value, "use a finite number of nats per token ≥ 0")
        for name in ("spike_min_engine_logprob", "spike_min_trainer_logprob"):
            value = getattr(self, name)
            if not (_is_number(value) and -math.inf < value <= 0):
                raise GuardConfigError(name, value, "use a finite log-probability in nats (≤ 0), e.g. math.log(0.05)")
        if not (_is_number(self.false_alarm_budget) and 0 < self.false_alarm_budget < 1000):
            raise GuardConfigError("false_alarm_budget", self.false_alarm_budget,
                                   "use expected false firings per 1,000 clean samples, in (0, 1000)")
        if self.changepoint_budget is not None and not (_is_number(self.changepoint_budget)
                                                        and 0 < self.changepoint_budget < 1):
            raise GuardConfigError("changepoint_budget", self.changepoint_budget,
                                   "use a share of clean samples in (0, 1), e.g. 0.0002, or None to turn it off")
        if not (isinstance(self.calibration_warmup_tokens, int) and not isinstance(self.calibration_warmup_tokens, bool)
                and self.calibration_warmup_tokens >= 1):
            raise GuardConfigError("calibration_warmup_tokens", self.calibration_warmup_tokens,
                                   "use a whole number of tokens ≥ 1")
        if not (_is_number(self.calibration_decay) and 0 < self.calibration_decay <= 1):
            raise GuardConfigError("calibration_decay", self.calibration_decay,
                                   "use a factor in (0, 1]; 1 never forgets")
        if not (_is_number(self.divergence_delta) and self.divergence_delta > 0
                and math.isfinite(self.divergence_delta)):
            raise GuardConfigError("divergence_delta", self.divergence_delta, "use a positive finite number of nats")
        if not isinstance(self.fused_statistics, bool):
            raise GuardConfigError("fused_statistics", self.fused_statistics, "use True or False")
        if not isinstance(self.compare_on_engine_support, bool):
            raise GuardConfigError("compare_on_engine_support", self.compare_on_engine_support, "use True or False")
        if not isinstance(self.compute_trainer_logprobs, bool):
            raise GuardConfigError("compute_trainer_logprobs", self.compute_trainer_logprobs, "use True or False")
        if self.output_dir is not None and not isinstance(self.output_dir, (str, os.PathLike)):
            raise GuardConfigError("output_dir", self.output_dir, "use a folder path (str or pathlib.Path), or None")
        if not (isinstance(self.evidence_samples_per_step, int) and not isinstance(self.evidence_samples_per_step, bool)
                and self.evidence_samples_per_step >= 0):
            raise GuardConfigError("evidence_samples_per_step", self.evidence_samples_per_step,
                                   "use a whole number of samples ≥ 0 (0: statistics only, no tokens)")
        for name in ("chart_every_steps", "image_every_steps", "spike_image_min_gap_steps", "alert_baseline_steps",
                     "alert_cooldown_steps"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise GuardConfigError(name, value, "use a whole number of steps ≥ 1")
        if self.max_quarantine_share is not None and not (
            _is_number(self.max_quarantine_share) and 0.0 < self.max_quarantine_share <= 1.0
        ):
            raise GuardConfigError("max_quarantine_share", self.max_quarantine_share,
                                   "use a share in (0, 1], or None to turn the breaker off")
        if not (isinstance(self.ceiling_steps, int) and not isinstance(self.ceiling_steps, bool)
                and self.ceiling_steps >= 1):
            raise GuardConfigError("ceiling_steps", self.ceiling_steps, "use a whole number of steps ≥ 1")
        if self.on_ceiling not in ON_CEILING:
            raise GuardConfigError("on_ceiling", self.on_ceiling, f"use one of {ON_CEILING}")
        if not isinstance(self.strict, bool):
            raise GuardConfigError("strict", self.strict, "use True or False")
        if not (_is_number(self.alert_jump) and math.isfinite(self.alert_jump) and self.alert_jump >= 1.0):
            raise GuardConfigError("alert_jump", self.alert_jump,
                                   "use a factor ≥ 1 (3.0 alerts at three times the baseline)")
        if not (_is_number(self.alert_min_share) and 0.0 <= self.alert_min_share <= 1.0):
            raise GuardConfigError("alert_min_share", self.alert_min_share, "use a share between 0 and 1")

    @property
    def quarantines(self) -> bool:
        return self.mode == "quarantine"

    @property
    def joint_drift_limit(self) -> float | None:
        """nats: the ``drift`` rule's joint part fires where ``spike_margin + joint_drift_weight · (CUSUM − drift
        threshold)`` exceeds this (``−joint_margin``); ``None`` where that part is off (``joint_margin`` or the
        spike rule, ``spike_excess``, is ``None``). One place for the reference verdict and the fused kernel."""
        return -self.joint_margin if self.joint_margin is not None and self.spike_excess is not None else None

    def to_dict(self) -> dict:
        return {field.name: getattr(self, field.name) for field in fields(self)}
