"""The direction-aware, self-calibrating detector: CUSUM, spike rule, calibration (borderline and clean cases)."""

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_guard import calibration as calibration_module
from rollout_guard import statistics as statistics_module
from rollout_guard.calibration import Calibration
from rollout_guard.config import GuardConfig
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.guard import RolloutGuard
from rollout_guard.statistics import COLUMN, NUM_ENGINE_BUCKETS, Thresholds, cusum_drawup, sample_statistics
from test_guard import ThreadGroup  # the thread-backed gather standing in for processes

ONLY_DETECTOR = dict(spike_delta=None, mean_delta=None, confident_wrong_tokens=None, max_quarantine_share=None)


def reference_cusum(increments: list[float]) -> float:
    """The textbook recursion S_t = max(0, S_{t-1} + u_t), max over t."""
    s = best = 0.0
    for u in increments:
        s = max(0.0, s + u)
        best = max(best, s)
    return best


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=1, max_size=40))
def test_cusum_matches_the_recursion(values):
    increments = torch.tensor([values])
    drawup, start = cusum_drawup(increments, torch.ones_like(increments, dtype=torch.bool))
    assert float(drawup) == pytest.approx(reference_cusum(values), abs=1e-3)
    if float(drawup) > 1e-3:  # the rise that starts at `start` reaches the maximum
        assert sum(values[int(start):]) <= float(drawup) + 1e-3
        assert max(sum(values[int(start) : end]) for end in range(int(start) + 1, len(values) + 1)) == pytest.approx(
            float(drawup), abs=1e-3)


def test_cusum_skips_invalid_tokens():
    increments = torch.tensor([[3.0, 100.0, 3.0]])
    valid = torch.tensor([[True, False, True]])
    assert cusum_drawup(increments, valid)[0].tolist() == [6.0]


def rows(engine: list[list[float]], trainer: list[list[float]]) -> RolloutEvidence:
    engine_t, trainer_t = torch.tensor(engine), torch.tensor(trainer)
    return RolloutEvidence(mask=torch.ones_like(engine_t, dtype=torch.long), engine_logprobs=engine_t, trainer_logprobs=trainer_t)


def stat(evidence: RolloutEvidence, name: str, config: GuardConfig | None = None) -> list[float]:
    return sample_statistics(evidence, config or GuardConfig()).select(1, COLUMN[name]).tolist()


def test_spike_only_where_one_side_finds_the_token_likely():
    # a 10-nat gap on a token both sides find unlikely (healthy tail), on an engine-likely one, and reversed
    engine = [[-8.0, -0.1], [-0.2, -0.1], [-11.0, -0.1]]
    trainer = [[-18.0, -0.1], [-10.2, -0.1], [-1.0, -0.1]]
    margin = stat(rows(engine, trainer), "spike_margin")
    assert math.isclose(margin[0], 0.0 - 4.0, abs_tol=1e-5), "the tail token is no candidate; the equal token is"
    assert margin[1] == pytest.approx(10.0 - 4.0) and margin[2] == pytest.approx(10.0 - 4.0)


def test_spike_candidates_have_a_lower_cut_on_the_engine_side_than_on_the_trainer_side():
    """Corruption puts tokens the engine liked (down to 5 %); healthy surprise noise lifts the trainer's logprob of
    tokens the engine found unlikely. A 6-nat gap where the engine gave −2.5 is a candidate; the mirror image, the
    trainer at −2.5 and the engine at −8.5, is not (the trainer's cut is ln 0.2); at the trainer's cut it is."""
    engine = [[-2.5, -0.1], [-8.5, -0.1], [-7.6, -0.1], [-3.05, -0.1]]
    trainer = [[-8.5, -0.1], [-2.5, -0.1], [math.log(0.2), -0.1], [-9.05, -0.1]]
    margin = stat(rows(engine, trainer), "spike_margin")
    assert margin[0] == pytest.approx(6.0 - 4.0, abs=1e-5)
    assert margin[1] == pytest.approx(0.0 - 4.0, abs=1e-5), "only the equal token is a candidate"
    assert margin[2] == pytest.approx(7.6 + math.log(0.2) - 4.0, abs=1e-5)
    assert margin[3] == pytest.approx(0.0 - 4.0, abs=1e-5), "the engine just below its cut (−3.0)"


def test_every_token_of_the_buckets_above_the_lowest_is_a_spike_candidate():
    """The engine's candidate cut is the lowest bucket edge (−3 nats). At ln 0.05 (−2.9957), a token the engine
    gave −2.998 sat in the bucket above −3 nats without being a candidate, and was judged only by that bucket's
    threshold for tokens no side found likely, which never fills from so thin a band: a 9-nat spike there was
    never flagged (the fidelity benchmark's top-k = 5 streams). Now it is, at step 1 as later; at −3.002 it is
    the lowest bucket's business (not a candidate; no threshold for such tokens before 100,000 of them)."""
    config = GuardConfig(**ONLY_DETECTOR)
    engine = [[-2.998, -0.1], [-3.002, -0.1]]
    trainer = [[-11.998, -0.1], [-12.002, -0.1]]
    assert RolloutGuard(config).inspect(rows(engine, trainer), step=1).suspect.tolist() == [True, False]
    old = GuardConfig(**ONLY_DETECTOR, spike_min_engine_logprob=math.log(0.05))
    assert RolloutGuard(old).inspect(rows(engine, trainer), step=1).suspect.tolist() == [False, False]


def test_spike_threshold_is_borderline_exact():
    config = GuardConfig(**ONLY_DETECTOR)
    below = RolloutGuard(config).inspect(rows([[-0.5, -0.1]], [[-4.49, -0.1]]), step=1)  # uncalibrated: 4 nats
    above = RolloutGuard(config).inspect(rows([[-0.5, -0.1]], [[-4.51, -0.1]]), step=1)
    assert below.suspect.tolist() == [False] and above.suspect.tolist() == [True]
    assert above.metrics["rule/directional_spike"] == 1


def late_onset(length: int, corrupt: int, gap: float) -> list[float]:
    return [-0.1] * (length - corrupt) + [-0.1 - gap] * corrupt


def test_drift_fires_on_late_onset_and_not_just_below(monkeypatch):
    monkeypatch.setattr(statistics_module, "BATCH_CENTRE_MIN_TOKENS", math.inf)  # the warm-up arithmetic alone
    config = GuardConfig(**ONLY_DETECTOR, spike_excess=None)
    # before calibration: allowance 2.0 per token, clip 4 → each 2.9-nat token adds 0.9 nats; threshold 6
    engine = [[-0.1] * 100, [-0.1] * 100]
    trainer = [late_onset(100, 7, 2.9), late_onset(100, 6, 2.9)]  # 7 × 0.9 = 6.3 fires, 6 × 0.9 = 5.4 does not
    report = RolloutGuard(config).inspect(rows(engine, trainer), step=1)
    assert report.suspect.tolist() == [True, False]
    assert report.column("drift_start").tolist() == [93, 94]


def test_one_clipped_healthy_tail_token_never_fires_drift():
    config = GuardConfig(**ONLY_DETECTOR, spike_excess=None, warmup_drift_allowance=0.0)
    engine = [[-0.1] * 50]
    trainer = [[-0.1] * 25 + [-18.0] + [-0.1] * 24]  # 17.9 nats on one token, clipped to 4
    assert stat(rows(engine, trainer), "drift_cusum", config) == [pytest.approx(4.0)]
    assert not RolloutGuard(config).inspect(rows(engine, trainer), step=1).suspect.any()


def test_a_tail_token_no_side_found_likely_moves_the_drift_cusum_by_at_most_its_clip():
    """Healthy 7B runs put their 10–18-nat tails on tokens both sides find unlikely: such a token's CUSUM step is
    clipped at 1.5 nats (at 4 it alone reached 3.5 past the allowance, over a 2.5-nat floor), while a token one side
    found likely still moves it by up to 4 (corruption lives there)."""
    config = GuardConfig(**ONLY_DETECTOR, spike_excess=None, warmup_drift_allowance=0.0)
    engine = [[-0.1] * 25 + [-8.0] + [-0.1] * 24, [-0.1] * 50]
    trainer = [[-0.1] * 25 + [-18.0] + [-0.1] * 24, [-0.1] * 25 + [-5.1] + [-0.1] * 24]  # 10 and 5 nats
    assert stat(rows(engine, trainer), "drift_cusum", config) == [pytest.approx(1.5), pytest.approx(4.0)]
    calibrated = GuardConfig(**ONLY_DETECTOR, spike_excess=None)
    assert 1.5 - calibrated.drift_allowance < calibrated.calibrated_drift_floor


def offset_batch(generator: torch.Generator, batch: int, length: int, offset: float, corrupt: list[int]) -> RolloutEvidence:
    """Clean rows whose engine logprob is raised by a processed-logprob offset, plus corrupted rows."""
    trainer = -0.3 - torch.rand(batch, length, generator=generator)
    engine = trainer + offset + 0.05 * torch.randn(batch, length, generator=generator)
    engine = engine.clamp(max=-0.01)
    trainer = torch.where(engine == -0.01, engine - offset, trainer)
    for row in corrupt:
        trainer[row] = engine[row] - offset - 4.0  # 4 nats beyond the offset on every token
    injected = torch.zeros(batch, dtype=torch.bool)
    injected[corrupt] = True
    return RolloutEvidence(mask=torch.ones(batch, length, dtype=torch.long), engine_logprobs=engine,
                           trainer_logprobs=trainer, injected=injected)


def test_calibration_absorbs_a_systematic_offset_and_keeps_catching_corruption(monkeypatch):
    config = GuardConfig(**ONLY_DETECTOR, calibration_warmup_tokens=2000)
    generator = torch.Generator().manual_seed(0)
    uncalibrated = RolloutGuard(GuardConfig(**ONLY_DETECTOR, warmup_drift_allowance=0.5, calibration_warmup_tokens=10**9))
    guard = RolloutGuard(config)
    for step in range(1, 6):
        evidence = offset_batch(generator, 32, 64, offset=1.5, corrupt=[3])
        report = guard.inspect(evidence, step=step)
        assert report.suspect.tolist() == evidence.injected.tolist(), f"step {step}"
    centre = guard.calibration.thresholds().centre
    assert guard.calibration.warm().any()
    assert float(centre[guard.calibration.warm()].min()) == pytest.approx(1.5, abs=0.1)
    # without a centre (neither calibrated nor the batch's own) and with the calibrated allowance, the same offset
    # flags every clean row
    monkeypatch.setattr(statistics_module, "BATCH_CENTRE_MIN_TOKENS", math.inf)
    assert uncalibrated.inspect(offset_batch(generator, 32, 64, 1.5, []), step=1).suspect.all()


def late_drift_batch(generator: torch.Generator, offset: float, corrupt: int | None) -> RolloutEvidence:
    """32 rows of 64 tokens with a top-p-like offset; ``corrupt``: that row drifts 1 nat per token beyond the
    offset over its last 30 tokens (no token beyond 4 nats: no spike)."""
    evidence = offset_batch(generator, 32, 64, offset=offset, corrupt=[])
    if corrupt is not None:
        evidence.trainer_logprobs[corrupt, 34:] = evidence.engine_logprobs[corrupt, 34:] - offset - 1.0
        evidence.injected[corrupt] = True
    return evidence


@pytest.mark.parametrize("when", ["first step", "first step after a change of the sampling settings"])
def test_a_step_without_known_centres_is_judged_around_the_batchs_own(monkeypatch, when):
    """Before a bucket's centre is known it was judged around 0 with the warm-up allowance (2 nats per token): a
    0.5-nat offset plus a 1-nat drift adds −0.5 per token and is never caught. Around the batch's own median
    (0.5) with its own allowance (0.5) the drift adds 0.5 per token: 15 nats over 30 tokens. The clean rows of
    the same batch stay clean; the calibration learns the offset itself (the packet's sums are moved back to
    its centre, 0)."""
    config = GuardConfig(**ONLY_DETECTOR)
    generator = torch.Generator().manual_seed(7)

    def judged(centres_of_their_own: bool) -> tuple[list[bool], list[bool], RolloutGuard]:
        if not centres_of_their_own:
            monkeypatch.setattr(statistics_module, "BATCH_CENTRE_MIN_TOKENS", math.inf)
        guard = RolloutGuard(config)
        if when != "first step":
            for step in range(1, 4):  # a healthy setting without offset, then a change
                assert not guard.inspect(offset_batch(generator, 32, 64, 0.0, []), step=step, sampling=(1.0, 1.0, 0)).suspect.any()
        evidence = late_drift_batch(generator, offset=0.5, corrupt=5)
        report = guard.inspect(evidence, step=9, sampling=(1.0, 0.9, 0) if when != "first step" else None)
        return report.suspect.tolist(), evidence.injected.tolist(), guard

    suspect, injected, guard = judged(True)
    assert suspect == injected
    assert float(guard.calibration.centre[3]) == pytest.approx(0.5, abs=0.05), "learned from absolute d"
    suspect, injected, _ = judged(False)
    assert not any(suspect), "without them, the same batch is judged around 0 at 2 nats per token"


def test_a_batch_too_small_keeps_the_warm_up_thresholds():
    """A bucket with fewer than BATCH_CENTRE_MIN_TOKENS tokens in the batch gets no centre of its own (a median of
    a few tokens would be noise): 3 rows of 64 tokens = 192 < 200 is judged around 0; 4 rows are not."""
    from rollout_guard.statistics import BATCH_CENTRE_MIN_TOKENS, batch_thresholds

    assert BATCH_CENTRE_MIN_TOKENS == 200
    config = GuardConfig()
    generator = torch.Generator().manual_seed(8)
    own = torch.ones(NUM_ENGINE_BUCKETS, dtype=torch.bool)
    for rows, moved in ((3, False), (4, True)):
        evidence = offset_batch(generator, rows, 64, offset=0.8, corrupt=[])
        thresholds, shift, _ = batch_thresholds(evidence, config, Thresholds.fixed(config), own)
        assert (float(shift[3]) == pytest.approx(0.8, abs=0.05)) is moved, rows
        assert (float(thresholds.allowance[3]) == 2.0) is not moved, rows


def test_a_run_broken_from_step_one_does_not_teach_the_calibration_its_corruption(monkeypatch):
    monkeypatch.setattr(calibration_module, "CENTRE_WARMUP_TOKENS", 100.0)  # the centres set by step 1's tokens
    config = GuardConfig(**ONLY_DETECTOR, calibration_warmup_tokens=500)
    generator = torch.Generator().manual_seed(1)
    guard = RolloutGuard(config)
    for step in range(1, 4):
        evidence = offset_batch(generator, 16, 64, offset=0.0, corrupt=list(range(8)))  # half the batch broken
        assert guard.inspect(evidence, step=step).suspect.tolist() == evidence.injected.tolist()
    assert float(guard.calibration.thresholds().centre.abs().max()) < 0.1
    # step 1 sets the centres and feeds nothing else; steps 2 and 3 feed their 8 kept rows each
    assert guard.calibration.rows == pytest.approx(8 * (1 + 0.95))


def test_calibration_state_round_trip_and_identical_on_two_ranks():
    config = GuardConfig(**ONLY_DETECTOR, calibration_warmup_tokens=500)
    generator = torch.Generator().manual_seed(2)
    evidence = [offset_batch(generator, 8, 32, 0.7, [1]), offset_batch(generator, 8, 32, 0.7, [])]
    group = ThreadGroup(2)
    guards = [RolloutGuard(config, gather=group.gather_for(rank), process_index=rank) for rank in range(2)]
    group.run(lambda rank: [guards[rank].inspect(evidence[rank], step=s) for s in (1, 2)])
    assert torch.equal(guards[0].calibration.sums, guards[1].calibration.sums)
    assert torch.equal(guards[0].calibration.centre, guards[1].calibration.centre)
    restored = Calibration(config)
    restored.load_state_dict(guards[0].calibration.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(restored.thresholds(), guards[0].calibration.thresholds(), strict=True))


def test_a_held_update_is_applied_on_every_rank_even_where_the_step_fails():
    """Past the first SETTLE_AT_ONCE_STEPS steps a step's calibration update is held and applied during the next
    step; a rank whose next step fails before its packet must still apply it, or its calibration falls a step
    behind the other ranks' (and judges its rows with other thresholds from then on)."""
    config = GuardConfig(**ONLY_DETECTOR, calibration_warmup_tokens=500)
    generator = torch.Generator().manual_seed(4)
    steps = calibration_module.SETTLE_AT_ONCE_STEPS + 2
    evidence = [[offset_batch(generator, 8, 32, 0.7, [1] if rank == 0 else []) for rank in range(2)]
                for _ in range(steps)]
    group = ThreadGroup(2)
    guards = [RolloutGuard(config, gather=group.gather_for(rank), process_index=rank) for rank in range(2)]

    def run(rank: int) -> None:
        for step in range(steps):
            guards[rank].inspect(evidence[step][rank], step=step + 1, batch_size=8)
        failing = RuntimeError("rank 1 could not build its evidence") if rank == 1 else evidence[0][rank]
        guards[rank].inspect(failing, step=steps + 1, batch_size=8)

    group.run(run)
    assert all(guard.totals.failures == 1 for guard in guards)
    states = [guard.calibration.state_dict() for guard in guards]
    assert states[0]["pending"] is None and states[0]["age"] == steps
    assert states[0] == states[1]


def test_a_checkpoint_taken_while_an_update_is_held_resumes_the_same_run():
    """The held update is part of the saved state: a guard restored from a checkpoint taken between two steps
    judges the next steps exactly as the one that ran on (without it, its calibration would miss a step)."""
    config = GuardConfig(**ONLY_DETECTOR, calibration_warmup_tokens=500)
    generator = torch.Generator().manual_seed(5)
    batches = [offset_batch(generator, 16, 32, 0.7, [step % 16]) for step in range(20)]
    guard = RolloutGuard(config)
    for step in range(15):
        guard.inspect(batches[step], step=step + 1)
    saved = json.loads(json.dumps(guard.state_dict(), allow_nan=True))
    assert saved["calibration"]["pending"] is not None  # past SETTLE_AT_ONCE_STEPS: held
    restored = RolloutGuard(config)
    restored.load_state_dict(saved)
    for step in range(15, 20):
        ran_on, resumed = (g.inspect(batches[step], step=step + 1) for g in (guard, restored))
        assert torch.equal(ran_on.samples.nan_to_num(-1.0), resumed.samples.nan_to_num(-1.0))
        assert torch.equal(ran_on.reasons, resumed.reasons)
    assert guard.calibration.state_dict() == restored.calibration.state_dict()


def test_a_held_update_places_its_tokens_with_the_centres_they_were_judged_with():
    """A held step's tokens were centred with the centres in use when it was judged, which the update before it
    may since have moved: its mean goes on the centre it was judged with. Here a step judged around 0 whose tokens
    average 1 nat moves the centre toward 1 nat; placed on the current centre (1 nat) it would pull it toward 2."""
    config = GuardConfig()
    calibration = Calibration(config)
    tokens = 4000.0
    one_nat = torch.zeros(NUM_ENGINE_BUCKETS, statistics_module.CALIBRATION_WIDTH, dtype=torch.float64)
    one_nat[:, 0], one_nat[:, 1], one_nat[:, 2] = tokens, tokens * 1.0, tokens * 1.0  # x = 1 nat on every token
    around_zero = ([0.0] * NUM_ENGINE_BUCKETS, [True] * NUM_ENGINE_BUCKETS)
    calibration.update(one_nat, 100.0, judged_with=([0.0] * NUM_ENGINE_BUCKETS, [False] * NUM_ENGINE_BUCKETS))
    assert calibration.centre.tolist() == pytest.approx([1.0] * NUM_ENGINE_BUCKETS)
    calibration.update(one_nat, 100.0, judged_with=around_zero)
    assert calibration.centre.tolist() == pytest.approx([1.0] * NUM_ENGINE_BUCKETS)  # 0 + 1: where it was
    calibration.update(one_nat, 100.0)  # judged with the current centres (1 nat): the tokens lie at 2 nats
    assert calibration.centre.min() > 1.3


def test_fixed_thresholds_before_calibration():
    thresholds = Thresholds.fixed(GuardConfig())
    assert thresholds.centre.tolist() == [0.0] * NUM_ENGINE_BUCKETS
    assert thresholds.allowance.tolist() == [2.0] * NUM_ENGINE_BUCKETS
    assert thresholds.spike.tolist() == [4.0] * NUM_ENGINE_BUCKETS


def test_a_noisy_bucket_gets_a_larger_drift_allowance():
    """Healthy but noisy tokens (σ ≈ 1.5 nats around the centre) would random-walk the CUSUM past its threshold
    with the configured allowance; calibration raises that bucket's allowance from its measured spread."""
    config = GuardConfig(**ONLY_DETECTOR, spike_excess=None, calibration_warmup_tokens=3000)
    generator = torch.Generator().manual_seed(3)

    def noisy(batch: int = 32, length: int = 128) -> RolloutEvidence:
        engine = torch.full((batch, length), -2.0)  # one bucket: [−3, −1.5)
        trainer = (engine - 1.5 * torch.randn(batch, length, generator=generator)).clamp(max=-0.01)
        return RolloutEvidence(mask=torch.ones(batch, length, dtype=torch.long), engine_logprobs=engine,
                           trainer_logprobs=trainer)

    guard = RolloutGuard(config)
    for step in range(1, 4):
        guard.inspect(noisy(), step=step)
    allowance = guard.calibration.thresholds().allowance
    assert float(allowance[1]) > 0.7 and float(allowance[3]) == pytest.approx(2.0)  # bucket 3 never warmed up
    assert not guard.inspect(noisy(), step=4).suspect.any()
    full = lambda value: torch.full((NUM_ENGINE_BUCKETS,), value)  # noqa: E731
    fixed = Thresholds(full(0.0), full(0.5), full(99.0), full(math.inf), full(0.0))
    from rollout_guard.statistics import summarise
    samples = summarise(noisy(), config, fixed)[0]
    assert (samples[:, COLUMN["drift_cusum"]] > config.drift_threshold).float().mean() > 0.5, "control: 0.5 nats is too little here"


def gaussian_candidates(generator: torch.Generator, batch: int, length: int, sigma: float) -> RolloutEvidence:
    """Healthy rows in one engine bucket ([−1.5, −0.5): every token a spike candidate), d ~ N(0, σ²)."""
    engine = torch.full((batch, length), -1.0)
    trainer = engine - sigma * torch.randn(batch, length, generator=generator)
    return RolloutEvidence(mask=torch.ones(batch, length, dtype=torch.long), engine_logprobs=engine,
                           trainer_logprobs=trainer.clamp(max=-0.01))


def offset_candidates(generator: torch.Generator, batch: int, length: int, sigma: float, offset: float
                      ) -> RolloutEvidence:
    """:func:`gaussian_candidates` with the engine ``offset`` nats above the trainer on every token (top-k
    renormalisation)."""
    evidence = gaussian_candidates(generator, batch, length, sigma)
    return RolloutEvidence(mask=evidence.mask, engine_logprobs=evidence.engine_logprobs,
                           trainer_logprobs=evidence.trainer_logprobs - offset)


def test_the_spike_threshold_does_not_ratchet_down_under_its_own_censoring():
    """The calibration sees kept rows only, so the tail above the threshold in use is always empty: a threshold
    read there sinks step after step (measured: 2.38 nats = 4.0 σ after 40 steps, 6 of the last 1,920 healthy rows
    flagged). Read in the body and extrapolated, it stays above the healthy 1 − α quantile (α ≈ 8·10⁻⁶ per token,
    ~4.5 σ = 2.7 nats; measured 2.70, no row flagged)."""
    config = GuardConfig(**ONLY_DETECTOR, drift_threshold=None, calibration_warmup_tokens=2000)
    generator = torch.Generator().manual_seed(4)
    guard = RolloutGuard(config)
    flagged = rows = 0
    for step in range(1, 41):
        report = guard.inspect(gaussian_candidates(generator, 64, 64, sigma=0.6), step=step)
        if step > 10:
            flagged += int(report.suspect.sum())
            rows += 64
    threshold = float(guard.calibration.thresholds().spike[2])
    assert threshold > 2.6, threshold  # checked before the count, so a failure names the threshold
    assert flagged <= 3, f"{flagged} of {rows} healthy rows flagged"


@pytest.mark.parametrize(("kept_rows", "cap"), [(600.0, 4.0), (100.0, 4.0 + 0.9 * math.log(1200 / 256))])
def test_a_bucket_with_few_candidates_is_judged_by_its_tokens_spread_not_by_its_candidates(kept_rows, cap):
    """Healthy tokens almost never become candidates in some buckets (below −3 nats for the engine while the
    trainer finds them likely); the few candidates there are the corrupted rows the rules missed, and calibrating
    on them would raise the threshold. Under MIN_SPIKE_CANDIDATES a bucket's threshold is the Gaussian bound of
    its kept tokens' spread (never above the uncalibrated threshold, never below the floor). The uncalibrated
    threshold is ``spike_excess`` for kept rows of up to 256 tokens (here 120,000 tokens in 600 rows), and rises
    by 0.9 nats per e-fold beyond (in 100 rows, 1,200 tokens each: 5.39 nats; measured with ``fidelity.py --stitch
    8``, a 4.03-nat healthy token fired there in 1,700-token rows)."""
    from rollout_guard.calibration import MIN_SPIKE_CANDIDATES, gaussian_bound
    from rollout_guard.statistics import CALIBRATION_WIDTH, EXCESS_EDGES

    config = GuardConfig(calibration_warmup_tokens=1000)
    contribution = torch.zeros(NUM_ENGINE_BUCKETS, CALIBRATION_WIDTH, dtype=torch.float64)
    high_bin = EXCESS_EDGES.index(8.0)  # |x| in [8, 9.5) nats: missed corruption
    assert 40 < MIN_SPIKE_CANDIDATES < 60
    # bucket: (candidates, where they sit, spread of all its tokens in nats)
    for bucket, candidates, where, sd in ((0, 40.0, high_bin, 0.1), (1, 60.0, high_bin, 0.1), (2, 30000.0, 0, 0.1),
                                          (3, 40.0, high_bin, 1.5)):
        contribution[bucket, 0] = 30000.0
        contribution[bucket, 2] = 30000.0 * sd**2  # Σ clip(x)² with Σ clip(x) = 0
        contribution[bucket, 3] = candidates
        contribution[bucket, 4 + where] = candidates
    calibration = Calibration(config)
    calibration.announced = True  # told the sampling settings: the configured floor applies
    calibration.update(contribution, kept_rows=kept_rows)  # sets the centres
    calibration.update(contribution, kept_rows=kept_rows)  # feeds the histograms
    spike = calibration.threshold_values()[2]
    assert spike[0] == config.calibrated_spike_floor  # quiet tokens, few candidates: the floor, not 8+ nats
    assert spike[1] > 8.0  # enough candidates: calibrated on what it saw
    assert spike[2] == config.calibrated_spike_floor  # quiet bucket: the floor
    assert gaussian_bound(1.5, 1e-5) > cap and spike[3] == pytest.approx(cap)  # noisy, few: capped


def unlikely_tokens_stream(generator: torch.Generator, batch: int, length: int, tail_rate: float,
                           every: int = 2) -> RolloutEvidence:
    """Healthy rows: one token in ``every`` unlikely for both sides (engine −8, trainer −8 ± 0.1; token 1 is
    one), the others likely for both (engine −0.2); with ``tail_rate``, an unlikely token gets a healthy
    ±LogUniform(1, 18)-nat tail (the published hybrid 7B run's, on tokens both sides find unlikely), the trainer
    kept below −3."""
    likely = torch.arange(length) % every != 1
    engine = torch.where(likely, -0.2, -8.0).expand(batch, length).clone()
    trainer = engine - torch.where(likely, 0.05, 0.1) * torch.randn(batch, length, generator=generator)
    hit = ~likely & (torch.rand(batch, length, generator=generator) < tail_rate)
    size = torch.exp(torch.rand(batch, length, generator=generator) * math.log(18.0))
    sign = torch.where(torch.rand(batch, length, generator=generator) < 0.5, -1.0, 1.0)
    trainer = torch.where(hit, (trainer - sign * size).clamp(max=-3.0), trainer)
    return RolloutEvidence(mask=torch.ones(batch, length, dtype=torch.long), engine_logprobs=engine,
                           trainer_logprobs=trainer.clamp(max=-0.01))


def with_garbage_low_engine_logprob(evidence: RolloutEvidence, row: int, size: float) -> RolloutEvidence:
    """The scan-kernel overflow's other face on a token both sides find unlikely: the engine's logprob of one of
    row ``row``'s unlikely tokens is ``size`` nats below the trainer's."""
    engine = evidence.engine_logprobs.clone()
    engine[row, 1] = evidence.trainer_logprobs[row, 1] - size
    return RolloutEvidence(evidence.mask, engine, evidence.trainer_logprobs)


@pytest.mark.parametrize(("batch", "tail_rate"), [(256, 0.0), (256, 0.004), (64, 0.004)])
def test_tokens_no_side_found_likely_are_judged_only_where_their_healthy_tail_is_quiet(batch, tail_rate):
    """Such tokens are no spike candidates (that is where healthy large-model runs put 10–18-nat tails), so a
    garbage low engine logprob on one went unjudged: 4–5 % of isolated spikes missed even in quiet conditions of the
    fidelity benchmark. Calibrated, they get their own threshold: 1.5 × the |x| only 4 kept such tokens exceed when
    that stays within ``spike_excess`` (quiet: here the floor of a guard never told its sampling settings, 2 nats,
    so a 3-nat garbage value is caught), else
    none (a heavy healthy tail: the same value is inside the noise, and no healthy row may be flagged). With 64-row
    steps the bucket never holds UNLIKELY_MIN_TOKENS (its decayed count tops out at ~41,000): not judged (read
    from 2,000 tokens instead, the tail looked quiet at warm-up and 25 healthy rows were flagged)."""
    config = GuardConfig(**ONLY_DETECTOR, drift_threshold=None, calibration_warmup_tokens=2000)
    generator = torch.Generator().manual_seed(7)
    guard = RolloutGuard(config)
    flagged = 0
    for step in range(1, 31):  # 256 rows: 8,192 unlikely tokens a step, judged from step ~19 (UNLIKELY_MIN_TOKENS)
        flagged += int(guard.inspect(unlikely_tokens_stream(generator, batch, 64, tail_rate), step=step).suspect.sum())
    threshold = float(guard.calibration.thresholds().unlikely_spike[0])
    assert flagged == 0, f"{flagged} healthy rows flagged"
    garbage = with_garbage_low_engine_logprob(unlikely_tokens_stream(generator, batch, 64, tail_rate), 5, 3.0)
    report = guard.inspect(garbage, step=31)
    if tail_rate == 0.0:
        from rollout_guard.calibration import UNANNOUNCED_SPIKE_FLOOR
        assert threshold == UNANNOUNCED_SPIKE_FLOOR > config.calibrated_spike_floor
        assert report.suspect.nonzero().flatten().tolist() == [5]
        assert report.samples[5, COLUMN["spike_margin"]] == pytest.approx(3.0 - 2.0, abs=0.3)
    else:
        assert threshold == math.inf
        assert not report.suspect[5]


@pytest.mark.parametrize(("tail_rate", "judged"), [(0.0, True), (0.004, False)])
def test_a_run_with_few_unlikely_tokens_per_row_is_judged_once_their_bound_allows(monkeypatch, tail_rate, judged):
    """Two such tokens per 64-token row (top-p sampling keeps few): 512 a step, whose decayed count (0.99) tops
    out near 51,000, never the 100,000 a run with many per row needs, so a garbage low engine logprob there was
    never judged (the fidelity benchmark's T0.7/top_p0.9 runs: 8–19 such tokens per row, read only after 24–64
    steps). A tail too rare to show in N tokens flags at most 4·u/N of the rows, so u = 2 needs 10,000 (read from
    step ~22). A quiet tail: the garbage token is flagged after 30 steps, and no healthy row before; a heavy one
    (4 in 1,000 such tokens) shows in those 10,000 and keeps them unjudged. With the old fixed count: not
    judged."""
    from rollout_guard import calibration as calibration_module

    def run() -> tuple[int, bool]:
        config = GuardConfig(**ONLY_DETECTOR, drift_threshold=None, calibration_warmup_tokens=2000)
        generator = torch.Generator().manual_seed(11)
        guard = RolloutGuard(config)
        flagged = sum(int(guard.inspect(unlikely_tokens_stream(generator, 256, 64, tail_rate, every=32),
                                        step=step).suspect.sum()) for step in range(1, 31))
        garbage = with_garbage_low_engine_logprob(unlikely_tokens_stream(generator, 256, 64, tail_rate, every=32), 5,
                                                  5.0)
        return flagged, bool(guard.inspect(garbage, step=31).suspect[5])

    flagged, caught = run()
    assert flagged == 0
    assert caught is judged
    monkeypatch.setattr(calibration_module, "UNLIKELY_ROW_SHARE", 1e-9)  # every run needs UNLIKELY_MIN_TOKENS
    assert run() == (0, False)


def test_an_unlikely_token_at_the_threshold_does_not_fire_and_just_above_it_does():
    config = GuardConfig(**ONLY_DETECTOR, drift_threshold=None)
    thresholds = Thresholds(torch.zeros(NUM_ENGINE_BUCKETS), torch.full((NUM_ENGINE_BUCKETS,), 0.5),
                            torch.full((NUM_ENGINE_BUCKETS,), 4.0), torch.tensor([2.5, math.inf, math.inf, math.inf]),
                            torch.zeros(NUM_ENGINE_BUCKETS))
    from rollout_guard.statistics import summarise
    evidence = rows([[-10.49, -0.1], [-10.51, -0.1], [-8.0, -0.1]], [[-7.99, -0.1], [-7.99, -0.1], [-8.0, -0.1]])
    margin = summarise(evidence, config, thresholds)[0][:, COLUMN["spike_margin"]].tolist()
    assert margin[0] <= 0 < margin[1]  # the rule fires on margin > 0
    assert margin[2] == pytest.approx(0.0 - 2.5, abs=1e-5)  # the unlikely token's own threshold, not the 4-nat one


def offset_stream(generator: torch.Generator, batch: int, length: int, offset: float) -> RolloutEvidence:
    """Healthy rows whose engine logprobs sit ``offset`` nats above the trainer's on every token, ±0.3 (top-k
    renormalisation: −log of the kept mass)."""
    engine = torch.full((batch, length), -0.8)
    trainer = engine - offset - 0.3 * torch.rand(batch, length, generator=generator)
    return RolloutEvidence(mask=torch.ones(batch, length, dtype=torch.long), engine_logprobs=engine,
                           trainer_logprobs=trainer)


@pytest.mark.parametrize("announced", [True, False])
def test_a_sampling_change_announced_restarts_the_centres_and_flags_no_healthy_row(announced):
    """Top_p = 1 for 12 steps (offset 0), then top_k: every token 1.2 nats higher for the engine. Calibrated to
    the first setting, the drift rule fires on most of the second's rows; told of the change (as the TRL adapter
    does each step), the guard judges the next step with centre 0 and the warm-up allowance and learns the new
    centre from it (control: unannounced, rows are flagged)."""
    config = GuardConfig(max_quarantine_share=None, calibration_warmup_tokens=2000)
    generator = torch.Generator().manual_seed(11)
    guard = RolloutGuard(config)
    for step in range(1, 13):
        assert not guard.inspect(offset_stream(generator, 64, 64, 0.0), step=step, sampling=("top_k=0",)).suspect.any()
    flagged = 0
    for step in range(13, 19):
        sampling = ("top_k=20",) if announced else ("top_k=0",)
        flagged += int(guard.inspect(offset_stream(generator, 64, 64, 1.2), step=step, sampling=sampling).suspect.sum())
    if announced:
        assert flagged == 0, f"{flagged} healthy rows flagged after an announced change"
        assert guard.calibration_resets == 1 and guard.sampling == ("top_k=20",)
        assert float(guard.calibration.thresholds().centre[2]) == pytest.approx(1.35, abs=0.05)
        restored = RolloutGuard(config)
        restored.load_state_dict(guard.state_dict())
        assert restored.sampling == ("top_k=20",) and restored.calibration_resets == 1
    else:
        assert flagged > 64, f"control: only {flagged} rows flagged without the announcement"


def with_late_drift(evidence: RolloutEvidence, row: int, tokens: int, gap: float) -> RolloutEvidence:
    """The row's last ``tokens`` tokens: the trainer ``gap`` nats below the engine (moderate late onset)."""
    trainer = evidence.trainer_logprobs.clone()
    trainer[row, -tokens:] = evidence.engine_logprobs[row, -tokens:] - gap
    injected = torch.zeros(trainer.shape[0], dtype=torch.bool)
    injected[row] = True
    return RolloutEvidence(mask=evidence.mask, engine_logprobs=evidence.engine_logprobs, trainer_logprobs=trainer,
                           injected=injected)


SETTINGS = ("temperature=1.0", "top_p=1.0")  # what the TRL adapter hands over each step


def test_the_drift_threshold_is_the_runs_own_once_calibrated():
    """A quiet run's healthy CUSUM stays near 0: told its sampling settings, the guard's drift threshold falls to
    the floor (2.5 nats) and a short late drift (8 tokens 0.85 nats off: CUSUM 8 × 0.35 = 2.8) is caught that the
    fixed 6 nats miss; 7 such tokens (2.45, just below the floor) are not (nor by the joint part: their spike margin,
    1.25 · 0.85 − 1.5 under the surprise weight at −1 nats, is −0.44); it survives a checkpoint; never told the
    settings, a guard keeps the fixed one; a restart starts it at the fixed one. The ``changepoint`` rule is off: at
    σ = 0.05 such a lag is 17 σ a token, which it catches at any threshold (tests/test_changepoint.py)."""
    config = GuardConfig(**ONLY_DETECTOR, calibration_warmup_tokens=2000, changepoint_budget=None)
    fixed = RolloutGuard(GuardConfig(**ONLY_DETECTOR, calibration_warmup_tokens=2000, calibrated_drift_floor=6.0,
                                     changepoint_budget=None))
    guard = RolloutGuard(config)
    generator = torch.Generator().manual_seed(7)
    for step in range(1, 9):
        evidence = gaussian_candidates(generator, 256, 64, sigma=0.05)
        assert not guard.inspect(evidence, step=step, sampling=SETTINGS).suspect.any()
        fixed.inspect(evidence, step=step, sampling=SETTINGS)
    assert guard.calibration.drift_threshold_value() == pytest.approx(config.calibrated_drift_floor) == 2.5
    assert fixed.calibration.drift_threshold_value() == pytest.approx(6.0)
    late = with_late_drift(gaussian_candidates(generator, 8, 64, sigma=0.05), row=2, tokens=8, gap=0.85)
    assert guard.inspect(late, step=9, sampling=SETTINGS).suspect.tolist() == late.injected.tolist()
    assert not fixed.inspect(late, step=9, sampling=SETTINGS).suspect.any()
    shorter = with_late_drift(gaussian_candidates(generator, 8, 64, sigma=0.05), row=2, tokens=7, gap=0.85)
    assert not guard.inspect(shorter, step=10, sampling=SETTINGS).suspect.any()
    restored = RolloutGuard(config)
    restored.load_state_dict(guard.state_dict())
    assert restored.calibration.drift_threshold_value() == guard.calibration.drift_threshold_value()
    # never told the sampling settings, a guard keeps the fixed drift threshold (an unannounced change of them
    # would move every row's CUSUM at once)
    unannounced = RolloutGuard(config)
    unannounced.load_state_dict({**guard.state_dict(), "sampling": None})
    assert unannounced.calibration.drift_threshold_value() == pytest.approx(6.0)
    assert not unannounced.inspect(late, step=11).suspect.any()
    guard.recalibrate()
    assert guard.calibration.drift_threshold_value() == pytest.approx(6.0)


def test_a_noisy_runs_drift_threshold_stays_above_its_healthy_cusum():
    """Healthy tokens with σ = 0.7 nats (a top-k = 20 stream's spread of offsets). From the step after the centre
    is set the allowance is the bucket's own (0.5 nats per token) and the healthy CUSUM reaches 3.3–4.8 nats; the
    threshold is the fixed one until ~1,000 samples were judged with that allowance, then it is read above the floor,
    where the healthy samples' CUSUM ends. (Before the allowance was the bucket's own from its centre on, the warm-up
    allowance of 2 nats held until step 15, and the reading from its CUSUM, under 1.1 nats, sat at the floor.) No
    more of all 7,680 rows flagged than the goal allows (0.1 %; the drift budget is 0.05 %). The ``changepoint``
    rule is off: its own budget (0.02 %) flags one of these healthy rows, at step 24 (tests/test_changepoint.py)."""
    config = GuardConfig(**ONLY_DETECTOR, calibration_warmup_tokens=160_000, spike_excess=None, changepoint_budget=None)
    guard = RolloutGuard(config)
    generator = torch.Generator().manual_seed(8)
    flagged, thresholds = [], []
    for step in range(1, 31):
        report = guard.inspect(gaussian_candidates(generator, 256, 64, sigma=0.7), step=step, sampling=SETTINGS)
        flagged.append(int(report.suspect.sum()))
        thresholds.append(report.drift_threshold)
    assert thresholds[0] == 6.0 and min(thresholds) > config.calibrated_drift_floor, thresholds
    assert sum(flagged[:24]) == 0 and sum(flagged) <= 8, (flagged, thresholds)
    assert min(thresholds[-10:]) > config.calibrated_drift_floor


def test_a_processed_logprob_offset_does_not_reach_the_first_calibrated_thresholds():
    """Top-k renormalisation puts the engine ~1.5 nats above the trainer on every token. The tokens judged before
    a bucket's centre is known sit 1.5 nats off, and fed into the histograms they raised the first calibrated spike
    threshold to 3.0 nats (a 2.9-nat spike missed for the decay window). A bucket's first tokens set its centre
    and feed nothing else, so the threshold read from the next ones is the floor and the spike is caught."""
    config = GuardConfig(**ONLY_DETECTOR)
    guard = RolloutGuard(config)
    generator = torch.Generator().manual_seed(12)
    for step in range(1, 8):
        evidence = offset_candidates(generator, 256, 64, sigma=0.1, offset=1.5)
        assert not guard.inspect(evidence, step=step, sampling=SETTINGS).suspect.any()
    assert guard.calibration.calibrated_flags()[2]
    assert guard.calibration.threshold_values()[2][2] == pytest.approx(config.calibrated_spike_floor)
    spiked = offset_candidates(generator, 8, 64, sigma=0.1, offset=1.5)
    trainer = spiked.trainer_logprobs.clone()
    trainer[3, 20] = spiked.engine_logprobs[3, 20] - 1.5 - 2.9  # 2.9 nats beyond the offset
    injected = torch.zeros(8, dtype=torch.bool)
    injected[3] = True
    report = guard.inspect(RolloutEvidence(mask=spiked.mask, engine_logprobs=spiked.engine_logprobs,
                                           trainer_logprobs=trainer), step=8, sampling=SETTINGS)
    assert report.suspect.tolist() == injected.tolist()


def test_a_change_to_noisier_settings_restarts_the_histograms_and_keeps_the_old_thresholds_as_floors():
    """Twelve steps of quiet tokens (σ = 0.1 nats: spike threshold at the 1.5-nat floor), then, announced, a
    setting whose healthy spread is 0.5 nats around another offset (top-k = 20 after top-p = 1). Read against the
    new centre, histograms kept from the first setting would judge it by the 1.5-nat floor (3 σ: ~16 % of its rows
    flagged); restarted, each bucket is judged by max(spike_excess, its old threshold) until its new histograms
    hold enough tokens, then by the new setting's own reading. No healthy row flagged in the ten steps after."""
    config = GuardConfig(**ONLY_DETECTOR, calibration_warmup_tokens=2000)
    guard = RolloutGuard(config)
    generator = torch.Generator().manual_seed(13)
    for step in range(1, 13):
        assert not guard.inspect(gaussian_candidates(generator, 256, 64, sigma=0.1), step=step,
                                 sampling=("top_k=0",)).suspect.any()
    before = guard.calibration.threshold_values()[2][2]
    assert before == pytest.approx(config.calibrated_spike_floor)
    flagged = 0
    for step in range(13, 23):
        noisier = gaussian_candidates(generator, 256, 64, sigma=0.5)
        noisier = RolloutEvidence(mask=noisier.mask, engine_logprobs=noisier.engine_logprobs,
                                  trainer_logprobs=noisier.trainer_logprobs - 0.7)
        report = guard.inspect(noisier, step=step, sampling=("top_k=20",))
        flagged += int(report.suspect.sum())
        if step == 13:  # judged right after the restart: the uncalibrated threshold, not the old floor
            assert guard.calibration_resets == 1
    assert flagged == 0, f"{flagged} of 2,560 healthy rows flagged after the change"
    assert guard.calibration.calibrated_flags()[2]
    assert guard.calibration.threshold_values()[2][2] > 2.0  # the new setting's own reading (σ = 0.5)
    restored = RolloutGuard(config)
    restored.load_state_dict(guard.state_dict())
    assert restored.calibration.threshold_values() == guard.calibration.threshold_values()


def test_a_restart_keeps_a_noisy_buckets_threshold_through_the_warm_up():
    """A bucket whose healthy noise needed more than ``spike_excess`` keeps that threshold while it re-learns."""
    config = GuardConfig(**ONLY_DETECTOR, calibration_warmup_tokens=2000)
    calibration = Calibration(config)
    calibration.announced = True
    contribution = torch.zeros(NUM_ENGINE_BUCKETS, calibration_module.CALIBRATION_WIDTH, dtype=torch.float64)
    edges = calibration_module.EXCESS_EDGES
    contribution[:, 0] = 30000.0
    contribution[:, 3] = 30000.0  # every token a candidate
    contribution[:, 4 + edges.index(1.0)] = 6000.0  # 20 % near 1 nat
    contribution[:, 4 + edges.index(4.0)] = 900.0  # 3 % near 4 nats: a tail read far above spike_excess
    calibration.update(contribution, kept_rows=500.0)  # sets the centres
    calibration.update(contribution, kept_rows=500.0)
    read = calibration.threshold_values()[2]
    assert min(read) > config.spike_excess
    calibration.restart()
    assert calibration.calibrated_flags() == [False] * NUM_ENGINE_BUCKETS
    assert calibration.threshold_values()[2] == read  # carried, not dropped to spike_excess
    assert calibration.threshold_values()[0] == [0.0] * NUM_ENGINE_BUCKETS  # centres start over


def test_a_checkpoint_from_before_the_surprise_weight_starts_its_calibration_over():
    """Its spike histograms hold |x|; thresholds read from them would judge w · |x| (up to 1.67-fold tighter): such
    a checkpoint restarts the calibration, its thresholds carried as uncalibrated ones (judged on |x|). A checkpoint
    of today's loads as it was saved."""
    config = GuardConfig(**ONLY_DETECTOR, calibration_warmup_tokens=2000)
    guard = RolloutGuard(config)
    generator = torch.Generator().manual_seed(7)
    for step in range(1, 5):
        guard.inspect(gaussian_candidates(generator, 256, 64, sigma=0.5), step=step, sampling=SETTINGS)
    assert guard.calibration.calibrated_flags()[2]
    state = guard.state_dict()
    today = RolloutGuard(config)
    today.load_state_dict(state)
    assert today.calibration.threshold_values() == guard.calibration.threshold_values()
    older = RolloutGuard(config)
    calibration = {key: value for key, value in state["calibration"].items() if key != "surprise_weighted"}
    older.load_state_dict({**state, "calibration": calibration})
    assert older.calibration.calibrated_flags() == [False] * NUM_ENGINE_BUCKETS
    assert older.calibration.threshold_values()[4] == [0.0] * NUM_ENGINE_BUCKETS  # judged on |x|
    assert older.calibration.threshold_values()[2][2] == max(config.spike_excess,
                                                             guard.calibration.threshold_values()[2][2])


def test_the_drift_reading_sees_the_rows_its_own_rule_flagged():
    """1.5 % of healthy rows drift 1 nat for 8 tokens (CUSUM ≈ 4 nats, under every spike threshold). Read only from
    the rows it kept, the drift threshold could fall below them once (its first reading rests on 2 % of ~1,000
    rows) and then never see them again: they were flagged for good. Counting the rows the drift rule alone
    flagged, the reading sees them and sits above them."""
    config = GuardConfig(**ONLY_DETECTOR, calibration_warmup_tokens=2000, changepoint_budget=None)  # the drift rule alone
    guard = RolloutGuard(config)
    generator = torch.Generator().manual_seed(14)
    flagged = 0
    for step in range(1, 41):
        evidence = gaussian_candidates(generator, 256, 64, sigma=0.05)
        trainer = evidence.trainer_logprobs.clone()
        drifting = torch.randperm(256, generator=generator)[:4]
        trainer[drifting, -8:] = evidence.engine_logprobs[drifting, -8:] - 1.0
        report = guard.inspect(RolloutEvidence(mask=evidence.mask, engine_logprobs=evidence.engine_logprobs,
                                               trainer_logprobs=trainer), step=step, sampling=SETTINGS)
        if step > 20:
            flagged += int(report.suspect.sum())
    assert guard.calibration.drift_threshold_value() > 4.5
    assert flagged == 0, f"{flagged} of 5,120 healthy rows flagged in steps 21-40"


def test_a_centred_bucket_judges_drift_by_its_own_spread_before_it_calibrates():
    """Top-k renormalisation: the engine 1.5 nats above the trainer on every token (±0.15). Once a bucket's centre
    is set (its first 2,000 tokens, step 1 here) the CUSUM allowance is read from its spread (0.5 nats) instead of
    the warm-up's 2 nats, which must stay above an unknown offset. A row whose last 12 tokens drift 1.2 nats past
    the offset (CUSUM 12 × 0.7 = 8.4 > 6) is then caught at step 2, long before the bucket calibrates (20,000
    tokens); with the warm-up allowance it was not (checked), nor at step 2 while the allowance waited for the
    first step whose tokens fed the sums (checked). No healthy row is flagged."""
    config = GuardConfig(**ONLY_DETECTOR)
    guard = RolloutGuard(config)
    generator = torch.Generator().manual_seed(13)
    first = offset_candidates(generator, 64, 48, sigma=0.15, offset=1.5)
    assert not guard.inspect(first, step=1, sampling=SETTINGS).suspect.any()
    assert guard.calibration.centred_flags()[2] and not guard.calibration.calibrated_flags()[2]
    late = with_late_drift(offset_candidates(generator, 64, 48, sigma=0.15, offset=1.5), row=5, tokens=12,
                           gap=1.5 + 1.2)
    report = guard.inspect(late, step=2, sampling=SETTINGS)
    assert report.suspect.tolist() == late.injected.tolist()
    assert guard.calibration.threshold_values()[1][2] == pytest.approx(config.drift_allowance)


def test_a_bucket_too_rare_for_a_centre_of_its_own_skips_the_batchs_pass():
    """After the first step, an uncentred bucket whose kept tokens so far promise fewer than half of
    BATCH_CENTRE_MIN_TOKENS per batch is not sent to batch_thresholds (it would pay its pass for nothing); the first
    step after a restart always is."""
    config = GuardConfig(**ONLY_DETECTOR)
    guard = RolloutGuard(config)
    generator = torch.Generator().manual_seed(9)
    assert guard.calibration.uncentred_on("cpu", 32).tolist() == [True] * NUM_ENGINE_BUCKETS  # nothing known yet
    guard.inspect(offset_batch(generator, 128, 64, 0.5, []), step=1)  # every token in the upper two buckets
    assert guard.calibration.centred_flags() == [False, False, True, True]
    assert guard.calibration.uncentred_on("cpu", 64) is None, "buckets 0 and 1 saw no token"
    guard.recalibrate()
    assert guard.calibration.uncentred_on("cpu", 64).tolist() == [True] * NUM_ENGINE_BUCKETS


def test_the_drift_reading_restarts_when_a_bucket_gets_its_centre():
    """The samples' CUSUM depends on the allowance each bucket had; when a bucket's centre is set its allowance
    changes kind (warm-up or the batch's own → its calibrated one), so the CUSUMs read before do not describe the
    ones to come: the drift histogram starts over at that step, and fills on the next."""
    from rollout_guard.statistics import CALIBRATION_WIDTH

    calibration = Calibration(GuardConfig())
    calibration.announced = True
    step = torch.zeros(NUM_ENGINE_BUCKETS, CALIBRATION_WIDTH, dtype=torch.float64)
    step[3, 0] = 3000.0  # one bucket's tokens: enough to set its centre (CENTRE_WARMUP_TOKENS)
    cusums = torch.full((100,), 1.0)
    calibration.update(step, 100.0, cusums)
    assert calibration.centred_flags() == [False, False, False, True]
    assert calibration._drift_rows == 0.0 and sum(calibration._drift) == 0.0
    calibration.update(step, 100.0, cusums)
    assert calibration._drift_rows == pytest.approx(100.0) and sum(calibration._drift) == pytest.approx(100.0)


def test_a_guard_not_told_the_settings_follows_an_offset_that_jumps(monkeypatch):
    """Never told the sampling settings, a guard cannot restart where they change: its centres stay those of the
    old setting, and a 0.7-nat jump of every token's offset (say top_p = 1 → top_k = 20) adds 0.2 nats per token
    past the 0.5-nat allowance — 12.8 nats over 64 tokens, every clean row over the drift threshold. Around the
    batch's own median (it lies more than UNANNOUNCED_FOLLOW from the centre) none is, and a row that drifts 1 nat
    per token beyond the new offset over 30 tokens is still caught."""
    config = GuardConfig(**ONLY_DETECTOR, calibration_warmup_tokens=2000)
    generator = torch.Generator().manual_seed(10)

    def jumped(follow: float | None) -> tuple[list[bool], list[bool]]:
        monkeypatch.setattr(calibration_module, "UNANNOUNCED_FOLLOW", follow)
        guard = RolloutGuard(config)
        for step in range(1, 4):
            assert not guard.inspect(offset_batch(generator, 128, 64, 0.0, []), step=step).suspect.any()
        assert guard.calibration.centred_flags()[2:] == [True, True] and not guard.calibration.announced
        evidence = late_drift_batch(generator, offset=0.7, corrupt=5)
        return guard.inspect(evidence, step=4).suspect.tolist(), evidence.injected.tolist()

    suspect, injected = jumped(0.25)
    assert suspect == injected
    suspect, _ = jumped(None)
    assert sum(suspect) >= 30, "without following, the clean rows of the step are flagged"


def spiked(evidence: RolloutEvidence, row: int, size: float) -> RolloutEvidence:
    """One token of ``row`` with the single-spike fault: the trainer ``size`` nats lower than it was."""
    engine, trainer = evidence.engine_logprobs, evidence.trainer_logprobs.clone()
    trainer[row, 7] -= size
    injected = torch.zeros(engine.shape[0], dtype=torch.bool)
    injected[row] = True
    return RolloutEvidence(evidence.mask, engine, trainer, injected=injected)


@pytest.mark.parametrize("step", [1, 3])
def test_a_bucket_not_yet_calibrated_takes_its_spike_threshold_from_the_batch(monkeypatch, step):
    """Until a bucket's histograms hold ``calibration_warmup_tokens`` (20,000) kept tokens, its spike threshold was
    the fixed 4 nats: a 3-nat single spike in a quiet run (σ = 0.05 nats) went unseen in the first steps of a run
    and after every change of the sampling settings (measured on the fidelity benchmark: half the single spikes
    it missed). Read from the batch's own histogram (its 1 % and 10 % points, extrapolated as the calibrated
    reading is), it is the 1.5-nat floor, at step 1 (no centre known) and at step 3 (centre known, not
    calibrated). No healthy row is flagged; without the batch's reading the spike is missed."""
    config = GuardConfig(**ONLY_DETECTOR, changepoint_budget=None)  # the spike rules alone

    def judged(from_the_batch: bool) -> tuple[list[bool], list[bool]]:
        generator = torch.Generator().manual_seed(21)
        guard = RolloutGuard(config)
        if not from_the_batch:
            monkeypatch.setattr(Calibration, "uncalibrated_on", lambda self, device="cpu", batch=0: None)
        for earlier in range(1, step):
            assert not guard.inspect(spiked(offset_candidates(generator, 64, 64, 0.05, 0.3), 0, 0.0), step=earlier,
                                     sampling=SETTINGS).suspect.any()
        assert not guard.calibration.calibrated_flags()[2]
        assert guard.calibration.centred_flags()[2] is (step > 1)
        evidence = spiked(offset_candidates(generator, 64, 64, 0.05, 0.3), 5, 3.0)
        return guard.inspect(evidence, step=step, sampling=SETTINGS).suspect.tolist(), evidence.injected.tolist()

    suspect, injected = judged(True)
    assert suspect == injected
    monkeypatch.undo()
    suspect, injected = judged(False)
    assert not any(suspect), "the fixed 4 nats miss it"


@pytest.mark.parametrize(("sigma", "read"), [(0.5, True), (0.8, False)])
def test_a_noisy_batch_reads_a_spike_threshold_above_its_noise_and_no_healthy_row_fires(sigma, read):
    """The batch's reading never flags its own healthy tail: Gaussian noise of σ = 0.5 nats (16,384 tokens, the
    largest |x| ≈ 4 σ = 2 nats) reads 2.67 nats, below the fixed 4 (used); σ = 0.8 puts 0.6 % of its tokens past
    the clip's −2-nat edge and as many past +2, so its 1 % point lies on the edge: not read, the fixed 4 stays.
    Either way no row of the first step is flagged."""
    from rollout_guard.statistics import batch_thresholds

    config = GuardConfig(**ONLY_DETECTOR)
    generator = torch.Generator().manual_seed(22)
    engine = torch.full((256, 64), -2.0)  # bucket [−3, −1.5): every token a candidate, the trainer never near 0
    evidence = RolloutEvidence(torch.ones(256, 64, dtype=torch.long), engine,
                               engine - sigma * torch.randn(256, 64, generator=generator))
    own = torch.ones(NUM_ENGINE_BUCKETS, dtype=torch.bool)
    thresholds, _, _ = batch_thresholds(evidence, config, Thresholds.fixed(config), own, spiky=own, spike_floor=1.5)
    spike = float(thresholds.spike[1])
    assert (spike < config.spike_excess) is read, spike
    if read:
        assert spike > 5 * sigma
    assert not RolloutGuard(config).inspect(evidence, step=1, sampling=SETTINGS).suspect.any()


def test_a_batch_whose_tokens_pile_on_the_clip_keeps_the_uncalibrated_spike_threshold():
    """A bucket whose upper anchor lies on the clip's edge (more tokens at d ≥ 4 or ≤ −2 nats than the anchor
    allows) cannot read its tail from the clipped grid: +inf, so the uncalibrated threshold stays (here 5 % of the
    tokens sit past 4 nats, a run broken in a few rows from step 1)."""
    from rollout_guard.statistics import BATCH_CENTRE_GRID, batch_spike_thresholds

    histogram = torch.zeros(2, BATCH_CENTRE_GRID + 1)
    histogram[:, 200] = 950.0  # d = 0
    histogram[0, -1] = 50.0  # 5 % at the upper clip
    histogram[1, 210] = 50.0  # the same 5 % at d = 0.1 instead
    read = batch_spike_thresholds(histogram, torch.zeros(2), histogram.sum(1), torch.tensor(64.0), 0.5, 1.5)
    assert math.isinf(float(read[0])) and float(read[1]) == pytest.approx(1.5)


def test_a_corrupted_row_on_the_clip_does_not_cost_the_batch_its_spike_threshold(monkeypatch):
    """Tokens on the clip's edge are further out than any distance the reading's anchors land on below it, so they
    count as beyond them and the reading stays exact; only an anchor on the edge itself is unknown. One corrupted
    row with 30 tokens 4.1 nats off (past the clip's 4-nat edge, yet 3.8 from the 0.3-nat centre: inside the fixed
    threshold, so the row stays in the reading; 0.7 % of a quiet step's 4,096 tokens, past half the 1 % anchor)
    had made the step keep the fixed 4 nats (the fidelity benchmark's top-k = 5 streams: warm-up steps beside a
    gibberish row), so a 3-nat single spike beside it went unseen at step 1. Now both are caught and no healthy
    row; with the old count of edge tokens (more than half the anchor's share: +inf) the spike is missed."""
    from rollout_guard import statistics as statistics_module

    config = GuardConfig(**ONLY_DETECTOR)

    def judged() -> tuple[list[bool], list[bool]]:
        generator = torch.Generator().manual_seed(23)
        evidence = spiked(offset_candidates(generator, 64, 64, 0.05, 0.3), 5, 3.0)
        trainer = evidence.trainer_logprobs.clone()
        trainer[40, :30] -= 3.8  # a corrupted row: 30 of its tokens past the clip's 4-nat edge
        injected = evidence.injected.clone()
        injected[40] = True
        evidence = RolloutEvidence(evidence.mask, evidence.engine_logprobs, trainer, injected=injected)
        return RolloutGuard(config).inspect(evidence, step=1, sampling=SETTINGS).suspect.tolist(), injected.tolist()

    suspect, injected = judged()
    assert suspect == injected
    original = statistics_module.batch_spike_thresholds

    def counting_the_edges(histogram, centre, count, per_row, budget, floor):
        read = original(histogram, centre, count, per_row, budget, floor)
        p1 = torch.clamp(torch.maximum(torch.full_like(count, 0.01), 20.0 / count.clamp(min=1.0)), max=0.1)
        return torch.where(histogram[:, 0] + histogram[:, -1] <= p1 * count / 2, read, math.inf)

    monkeypatch.setattr(statistics_module, "batch_spike_thresholds", counting_the_edges)
    suspect, _ = judged()
    assert not suspect[5] and suspect[40], "with the edge count the step keeps 4 nats and misses the spike"


def test_rows_the_thresholds_in_use_flag_do_not_feed_the_batchs_spike_reading():
    """Two corrupted rows whose tokens run from 0.5 to 5 nats off (3 % of a quiet step's tokens, most inside the
    clip) lift the step's 1 % point to ~2 nats, and the reading extrapolated from it lies past the fixed 4: a
    3-nat single spike in another row went unseen at step 1. Their rows hold a token the thresholds in use flag
    (5 nats ≥ 4), so they are left out of the reading: the spike is caught, the corrupted rows too, no healthy row
    (fails with the corrupted rows in the reading)."""
    from rollout_guard.statistics import batch_thresholds

    config = GuardConfig(**ONLY_DETECTOR)
    generator = torch.Generator().manual_seed(24)
    evidence = spiked(offset_candidates(generator, 64, 64, 0.05, 0.3), 5, 3.0)
    trainer = evidence.trainer_logprobs.clone()
    trainer[40:42] -= torch.linspace(0.5, 5.0, 64)  # moderate corruption: most tokens a little, the last 5 nats
    injected = evidence.injected.clone()
    injected[40:42] = True
    evidence = RolloutEvidence(evidence.mask, evidence.engine_logprobs, trainer, injected=injected)
    own = torch.ones(NUM_ENGINE_BUCKETS, dtype=torch.bool)
    thresholds, _, _ = batch_thresholds(evidence, config, Thresholds.fixed(config), own, spiky=own, spike_floor=1.5)
    assert float(thresholds.spike[2]) == pytest.approx(1.5)
    suspect = RolloutGuard(config).inspect(evidence, step=1, sampling=SETTINGS).suspect
    assert suspect.tolist() == injected.tolist()


def quiet_unlikely_calibration(config: GuardConfig, tail_at: float, scale: float = 1.0,
                               rows: float = 1000.0) -> Calibration:
    """A calibration whose buckets hold 200,000 kept tokens no side found likely (times ``scale``, per update of
    ``rows`` kept samples), their |x| near 1 nat and 4 of them (per bucket) at ``tail_at`` nats, and 30,000
    candidates near 0.5 nats."""
    calibration = Calibration(config)
    calibration.announced = True
    edges = calibration_module.EXCESS_EDGES
    contribution = torch.zeros(NUM_ENGINE_BUCKETS, calibration_module.CALIBRATION_WIDTH, dtype=torch.float64)
    contribution[:, 0] = 30000.0 + 200000.0 * scale
    contribution[:, 3] = 30000.0
    contribution[:, 4 + edges.index(0.5)] = 30000.0
    unlikely = calibration_module.UNLIKELY_HISTOGRAM
    contribution[:, unlikely + edges.index(1.0)] = 199994.0 * scale
    contribution[:, unlikely + max(i for i, e in enumerate(edges) if e <= tail_at)] = 6.0 * scale
    for _ in range(3):
        calibration.update(contribution, kept_rows=rows)
    return calibration


def test_a_quiet_unlikely_tail_read_from_fewer_tokens_is_not_carried_through_a_restart():
    """A run with few tokens no side found likely per sample reads their tail from fewer of them
    (:func:`rollout_guard.calibration.unlikely_min_tokens`: 20,000 at the 4 per sample here, which hold ~40,000),
    which bounds the healthy rows a tail too rare to show may flag only for that run's share per sample; the next
    setting may have many more per sample (measured on the fidelity benchmark's pooled dense-7B-tail stream: a
    quiet reading of 4.7 nats from a T0.7/top_p0.9 setting carried into the next one flagged 11 judgements of
    resampled healthy rows). Such a reading holds in its own setting and is not carried; one from
    UNLIKELY_MIN_TOKENS is."""
    config = GuardConfig(**ONLY_DETECTOR)
    sparse = quiet_unlikely_calibration(config, 1.2, scale=0.1, rows=20000.0)
    assert 10_000 <= sparse._unlikely_min_tokens() < sparse._unlikely[0][0] < calibration_module.UNLIKELY_MIN_TOKENS
    assert all(math.isfinite(t) for t in sparse.threshold_values()[3])  # judged in its own setting
    sparse.restart()
    assert all(math.isinf(t) for t in sparse.threshold_values()[3])  # not carried
    full = quiet_unlikely_calibration(config, 1.2)
    full.restart()
    assert full.threshold_values()[3] == [config.spike_excess] * NUM_ENGINE_BUCKETS


@pytest.mark.parametrize(("tail_at", "carried"), [(1.2, True), (8.0, False)])
def test_a_restart_carries_a_quiet_unlikely_tail_threshold_at_spike_excess(tail_at, carried):
    """Tokens no side found likely are judged only once a bucket holds UNLIKELY_MIN_TOKENS of them (100,000: a
    heavy healthy tail must have had the chance to show); a restart (a change of the sampling settings) emptied
    that memory, so for the next ~10 steps of a pooled stream a garbage low engine logprob there went unjudged
    (measured on the fidelity benchmark's top-k = 5 streams: a third of the isolated spikes missed). The
    threshold in use before the restart carries through, at least ``spike_excess``, as the spike thresholds'
    do; a heavy tail (not judged) carries nothing. It survives a checkpoint."""
    config = GuardConfig(**ONLY_DETECTOR)
    calibration = quiet_unlikely_calibration(config, tail_at)
    before = calibration.threshold_values()[3]
    assert all(math.isfinite(t) for t in before) is carried, before
    calibration.restart()
    assert calibration.calibrated_flags() == [False] * NUM_ENGINE_BUCKETS
    after = calibration.threshold_values()[3]
    if carried:
        assert after == [max(config.spike_excess, t) for t in before]
    else:
        assert all(math.isinf(t) for t in after)
    restored = Calibration(config)
    restored.load_state_dict(calibration.state_dict())
    assert restored.threshold_values()[3] == after


def test_a_heavy_tail_read_after_a_quiet_one_is_what_the_next_restart_carries():
    """A quiet setting, a restart (4 nats carried), then a setting whose tokens no side found likely show a heavy
    tail (read: +inf, not judged): the next restart carries +inf, not the older quiet threshold."""
    config = GuardConfig(**ONLY_DETECTOR)
    calibration = quiet_unlikely_calibration(config, 1.2)
    calibration.restart()
    assert calibration.threshold_values()[3] == [config.spike_excess] * NUM_ENGINE_BUCKETS
    heavy = quiet_unlikely_calibration(config, 8.0)
    for _ in range(3):
        calibration.update(torch.tensor(heavy._sums, dtype=torch.float64) / 3, kept_rows=1000.0)
    assert calibration.calibrated_flags() == [True] * NUM_ENGINE_BUCKETS
    assert all(math.isinf(t) for t in calibration.threshold_values()[3]), "read from this setting's own tail"
    calibration.restart()
    assert all(math.isinf(t) for t in calibration.threshold_values()[3])


def warmed_on_a_quiet_stream(config: GuardConfig, generator: torch.Generator, steps: int,
                             setting: str) -> RolloutGuard:
    """A guard fed ``steps`` quiet steps of :func:`unlikely_tokens_stream` (256 rows of 64 tokens, half of them no
    side found likely) under ``setting``: no row flagged, and those tokens judged (a finite threshold)."""
    guard = RolloutGuard(config)
    for step in range(1, steps + 1):
        assert not guard.inspect(unlikely_tokens_stream(generator, 256, 64, 0.0), step=step,
                                 sampling=(setting,)).suspect.any()
    assert math.isfinite(guard.calibration.threshold_values()[3][0])
    return guard


def test_after_a_change_a_garbage_low_engine_logprob_on_an_unlikely_token_is_judged_at_once():
    """The same through the guard: a quiet stream of tokens half of which no side found likely, 20 steps, then a
    change of the sampling settings; in the step right after it, one row's unlikely token gets an engine logprob
    5 nats below the trainer's: flagged (the kept reading, at its 4-nat minimum), and nothing else in the ten steps
    after the change. With the kept histogram emptied at the change the row is not judged there."""
    config = GuardConfig(**ONLY_DETECTOR, drift_threshold=None, calibration_warmup_tokens=2000)
    generator = torch.Generator().manual_seed(23)
    guard = warmed_on_a_quiet_stream(config, generator, 20, "top_k=0")
    state = guard.state_dict()
    garbage = with_garbage_low_engine_logprob(unlikely_tokens_stream(generator, 256, 64, 0.0), 5, 5.0)
    assert guard.inspect(garbage, step=21, sampling=("top_k=5",)).suspect.nonzero().flatten().tolist() == [5]
    flagged = sum(int(guard.inspect(unlikely_tokens_stream(generator, 256, 64, 0.0), step=step,
                                    sampling=("top_k=5",)).suspect.sum()) for step in range(22, 32))
    assert flagged == 0
    forgetful = RolloutGuard(config)
    forgetful.load_state_dict(state)
    forgetful.calibration.restart()
    forgetful.calibration._unlikely = [[0.0] * len(bucket) for bucket in forgetful.calibration._unlikely]
    forgetful.sampling = ("top_k=5",)
    assert not forgetful.inspect(garbage, step=21, sampling=("top_k=5",)).suspect.any()


def test_a_stream_that_changes_setting_every_two_steps_judges_unlikely_tokens_from_what_it_kept():
    """The fidelity benchmark's pooled streams change their sampling setting every 2–5 steps, and each change
    restarts the calibration. No setting then holds UNLIKELY_MIN_TOKENS tokens no side found likely of its own
    (8,192 here at most: the first step of each visit re-learns the centre and feeds nothing), so with the
    histogram emptied at each restart such tokens were never judged (llama top-k = 5: 5 of 1,000 isolated spikes
    missed). The histogram is kept across restarts: once it holds UNLIKELY_MIN_TOKENS of them (from step 27
    here), they are judged at ``spike_excess`` (4 nats) in every setting; a 5-nat garbage low engine logprob is
    caught, no healthy row is flagged. Fails with the histogram emptied at a restart (nothing judged: checked)."""
    config = GuardConfig(**ONLY_DETECTOR, drift_threshold=None, calibration_warmup_tokens=2000)
    generator = torch.Generator().manual_seed(29)
    guard = RolloutGuard(config)
    flagged = 0
    for step in range(1, 31):
        flagged += int(guard.inspect(unlikely_tokens_stream(generator, 256, 64, 0.0), step=step,
                                     sampling=(f"setting {(step - 1) // 2 % 3}",)).suspect.sum())
        assert guard.calibration._unlikely_fresh[0] < calibration_module.UNLIKELY_MIN_TOKENS
    assert flagged == 0
    assert guard.calibration.threshold_values()[3][0] == config.spike_excess
    garbage = with_garbage_low_engine_logprob(unlikely_tokens_stream(generator, 256, 64, 0.0), 7, 5.0)
    assert guard.inspect(garbage, step=31, sampling=("setting 0",)).suspect.nonzero().flatten().tolist() == [7]


def test_after_a_quiet_setting_a_heavy_unlikely_tail_is_read_from_the_kept_tokens_within_a_few_steps():
    """The price of judging a new setting's tokens no side found likely by what an earlier, quiet setting showed:
    the new one's healthy 1–18-nat tail there (4 in 1,000 such tokens) is flagged until the reading sees it. Its
    tokens below the threshold in use (4 nats) join the kept histogram, and 4 of them past ``spike_excess`` make
    it heavy (+inf, not judged): within 6 steps here, 73 of 12,800 healthy rows flagged. With the threshold in use
    before the restart carried frozen until the new setting read 100,000 such tokens of its own, 16 steps and 249
    rows (checked)."""
    config = GuardConfig(**ONLY_DETECTOR, drift_threshold=None, calibration_warmup_tokens=2000)
    generator = torch.Generator().manual_seed(3)
    guard = warmed_on_a_quiet_stream(config, generator, 30, "quiet")
    flagged = [int(guard.inspect(unlikely_tokens_stream(generator, 256, 64, 0.004), step=step,
                                 sampling=("heavy",)).suspect.sum()) for step in range(31, 81)]
    assert sum(flagged[6:]) == 0 and sum(flagged) < 100, flagged
    assert math.isinf(guard.calibration.threshold_values()[3][0])


def test_a_checkpoint_from_before_the_kept_unlikely_memory_counts_its_tokens_as_the_settings_own():
    """A state saved before the histogram of tokens no side found likely was kept across restarts has no
    ``unlikely_fresh``: its histogram then held only the tokens since its last restart, so they count as the
    setting's own and the thresholds read are the same as before the save."""
    config = GuardConfig(**ONLY_DETECTOR)
    calibration = quiet_unlikely_calibration(config, 1.2)
    state = calibration.state_dict()
    del state["unlikely_fresh"]
    restored = Calibration(config)
    restored.announced = True  # the guard's, from its sampling settings
    restored.load_state_dict(state)
    assert restored._unlikely_fresh == [bucket[0] for bucket in calibration._unlikely]
    assert restored.threshold_values() == calibration.threshold_values()


def flagged_while_calibrating(guard: RolloutGuard, healthy, steps: int = 30) -> int:
    """Healthy rows ``guard`` flags while it judges ``healthy()``'s batches at steps 1 … ``steps``, told SETTINGS."""
    return sum(int(guard.inspect(healthy(), step=step, sampling=SETTINGS).suspect.sum())
               for step in range(1, steps + 1))


def symmetric_candidates(generator: torch.Generator, batch: int, length: int, sigma: float) -> RolloutEvidence:
    """Healthy rows in the bucket [−3, −1.5) (every token a candidate), d ~ N(0, σ²) on both sides; at its lower
    edge, where the surprise weight is 1 (rollout_guard.statistics.surprise_weight), so thresholds read in nats."""
    engine = torch.full((batch, length), -3.0)
    return RolloutEvidence(mask=torch.ones(batch, length, dtype=torch.long), engine_logprobs=engine,
                           trainer_logprobs=engine - sigma * torch.randn(batch, length, generator=generator))


def test_a_light_tailed_bucket_reads_its_spike_threshold_near_its_data():
    """Healthy spread σ = 0.35 nats (a top-k = 20 run's renormalisation offsets end near 4.5 σ). Read from the
    bins' upper edges at 1 % and 10 % and extrapolated over 3.5 decades, the spike threshold sat near 6 σ and a
    2-nat spike beyond the centre went unseen; read inside the bins at 0.1 % and 1 % (2.5 decades) it sits near
    5 σ and catches it. Healthy rows flagged over 30 steps (7,680 rows): within the false-alarm budget (0.5 per
    1,000 rows: ~4)."""
    config = GuardConfig(**ONLY_DETECTOR, drift_threshold=None)
    guard = RolloutGuard(config)
    generator = torch.Generator().manual_seed(24)
    flagged = flagged_while_calibrating(guard, lambda: symmetric_candidates(generator, 256, 64, 0.35))
    threshold = guard.calibration.threshold_values()[2][1]
    assert flagged <= 4
    assert 4.6 * 0.35 < threshold < 1.95, threshold
    report = guard.inspect(spiked(symmetric_candidates(generator, 256, 64, 0.35), 9, 2.0), step=31, sampling=SETTINGS)
    assert report.suspect.nonzero().flatten().tolist() == [9]


def surprise_scaled_candidates(generator: torch.Generator, batch: int, length: int, sigma: float) -> RolloutEvidence:
    """Healthy rows in the top bucket (engine logprob in [−0.5, −0.01]), d ~ N(0, (σ (1 + s))²) with ``s`` the
    token's surprise: healthy mismatch grows with it (the fidelity benchmark's hybrid-7B noise model)."""
    engine = -0.01 - 0.49 * torch.rand(batch, length, generator=generator)
    trainer = engine - sigma * (1 - engine) * torch.randn(batch, length, generator=generator)
    return RolloutEvidence(mask=torch.ones(batch, length, dtype=torch.long), engine_logprobs=engine,
                           trainer_logprobs=trainer)


def test_a_likely_token_is_held_to_the_spread_of_its_own_surprise():
    """Healthy spread σ (1 + s) in the bucket [−0.5, 0] (σ = 0.3: 0.3 nats at s = 0, 0.45 at its lower edge). The
    calibrated threshold is read from w · |x| (statistics.surprise_weight, here 1.5 / (1 + s)), so a spike of 0.85
    of it (2.31 nats read here, the spike 1.96) is caught at engine −0.02 (w = 1.47; 6.4 σ of the healthy noise
    there) and not at −0.5 (w = 1; 4.4 σ, about where the bucket's healthy tail ends). Read from |x| and judged on
    |x| (before), the first went unseen: the threshold sat where the bucket's least likely tokens end. Healthy rows
    flagged over 30 steps (7,680 rows): within the false-alarm budget (0.5 per 1,000 rows: ~4)."""
    config = GuardConfig(**ONLY_DETECTOR, drift_threshold=None)
    guard = RolloutGuard(config)
    generator = torch.Generator().manual_seed(26)
    flagged = flagged_while_calibrating(guard, lambda: surprise_scaled_candidates(generator, 256, 64, 0.3))
    assert flagged <= 4
    assert guard.calibration.calibrated_flags()[3] and guard.calibration.threshold_values()[4][3] == 1.0
    centre, threshold = guard.calibration.threshold_values()[0][3], guard.calibration.threshold_values()[2][3]
    evidence = surprise_scaled_candidates(generator, 8, 64, 0.3)
    engine, trainer = evidence.engine_logprobs.clone(), evidence.trainer_logprobs.clone()
    trainer[:2] = engine[:2] - centre  # no noise on the rows that carry a spike
    for row, at in ((0, -0.02), (1, -0.5)):
        engine[row, 7] = at
        trainer[row, 7] = at - centre - 0.85 * threshold
    report = guard.inspect(RolloutEvidence(evidence.mask, engine, trainer), step=31, sampling=SETTINGS)
    assert report.suspect.tolist() == [True] + [False] * 7, threshold


def test_a_short_row_is_judged_by_its_own_budget_and_a_long_one_too(monkeypatch):
    """The false-alarm budget is per sample: a row of n spike candidates gets the threshold read at
    α = β / 1000 / n (statistics.spike_per_row), not the mean row's. Calibrated on 64-token rows (σ = 0.35 nats),
    a spike between the two thresholds fires in a 4-token row and not in the mean row's threshold; one between
    the mean row's and a 512-token row's fires only with the mean row's. Without the per-row reading both verdicts
    flip. Healthy rows of every length stay clean."""
    from rollout_guard.statistics import spike_per_row

    config = GuardConfig(**ONLY_DETECTOR, drift_threshold=None, changepoint_budget=None)  # the spike rules alone
    guard = RolloutGuard(config)
    generator = torch.Generator().manual_seed(25)
    for step in range(1, 31):
        guard.inspect(symmetric_candidates(generator, 256, 64, 0.35), step=step, sampling=SETTINGS)
    mean_row = guard.calibration.threshold_values()[2][1]
    scaling = guard.calibration.row_scaling()
    assert scaling is not None and float(scaling.slope[1]) > 0
    short, long = spike_per_row(torch.tensor(guard.calibration.threshold_values()[2]), scaling,
                                torch.tensor([4.0, 512.0]))[:, 1].tolist()
    assert short < mean_row - 0.05 and long > mean_row + 0.05, (short, mean_row, long)
    evidence = symmetric_candidates(generator, 8, 512, 0.35)
    mask = evidence.mask.clone()
    mask[0, 4:] = 0  # a 4-token row
    mask[2, 4:] = 0  # another, healthy
    trainer = evidence.engine_logprobs.clone()  # no noise on the rows that carry a spike
    trainer[2:] = evidence.trainer_logprobs[2:]
    trainer[0, 1] -= (short + mean_row) / 2
    trainer[1, 300] -= (mean_row + long) / 2
    evidence = RolloutEvidence(mask, evidence.engine_logprobs, trainer)
    state = guard.state_dict()
    assert guard.inspect(evidence, step=31, sampling=SETTINGS).suspect.tolist() == [True] + [False] * 7
    alike = RolloutGuard(config)
    alike.load_state_dict(state)
    monkeypatch.setattr(Calibration, "row_scaling", lambda self, device="cpu": None)
    assert alike.inspect(evidence, step=31, sampling=SETTINGS).suspect.tolist() == [False, True] + [False] * 6


@pytest.mark.parametrize(("length", "size", "fires"), [(256, 4.5, True), (2048, 4.5, False), (2048, 7.0, True)])
def test_an_uncalibrated_spike_threshold_rises_with_the_length_of_the_rows(length, size, fires):
    """In the first step nothing is calibrated, and ``spike_excess`` (4 nats) was measured on rows of up to 256
    tokens: a row 8 times as long has 8 times the chances to cross it by chance (measured with ``fidelity.py
    --stitch 8``: 0.21–0.30 % of the clean rows in the hybrid-7B-tail streams, five of seven in the first two
    steps, the other two in a bucket with too few candidates, as in the few-candidates test above). One
    token per row that the trainer finds likely (−0.5 nats) and the engine does not, ``size`` nats apart: in
    256-token rows 4.5 nats fires as before; in 2,048-token rows the threshold is 4 + 0.9 · ln 8 = 5.87 nats, so
    4.5 does not and 7 still does."""
    config = GuardConfig(**ONLY_DETECTOR)
    engine = torch.full((32, length), -0.2)
    trainer = engine - 0.01
    trainer[:, 100] = -0.5
    engine[:, 100] = -0.5 - size  # below −3 nats: a candidate on the trainer's side only
    report = RolloutGuard(config).inspect(RolloutEvidence(torch.ones(32, length, dtype=torch.long), engine, trainer),
                                          step=1, sampling=SETTINGS)
    assert bool(report.suspect.all()) is fires and bool(report.suspect.any()) is fires


def test_the_spread_metric_shows_where_the_runs_noise_lives():
    """``calibration/spread_b<k>``: the sd of the kept tokens' d around their bucket's centre, per engine bucket —
    a quiet bucket of sure tokens (σ = 0.05 nats) and a noisy one of unlikely tokens (σ = 0.5) read as such, the
    buckets without tokens NaN, and every bucket NaN before its centre is set (fewer than 2,000 kept tokens). Fails
    if the metric reads another bucket's spread, or the variance not its root."""
    guard = RolloutGuard(GuardConfig(**ONLY_DETECTOR))
    generator = torch.Generator().manual_seed(21)
    for step, rows in enumerate([16, 64, 64, 64, 64], start=1):  # 512 tokens per bucket first: no centre yet
        engine = torch.cat([torch.full((rows, 32), -0.2), torch.full((rows, 32), -2.0)], dim=1)  # buckets 3 and 1
        sigma = torch.cat([torch.full((rows, 32), 0.05), torch.full((rows, 32), 0.5)], dim=1)
        trainer = engine - sigma * torch.randn(engine.shape, generator=generator)
        report = guard.inspect(RolloutEvidence(mask=torch.ones_like(engine, dtype=torch.long), engine_logprobs=engine,
                                               trainer_logprobs=trainer.clamp(max=-0.01)), step=step,
                               sampling=SETTINGS)
        if step == 1:
            assert all(math.isnan(report.metrics[f"calibration/spread_b{k}"]) for k in range(4))
    metrics = report.metrics
    assert metrics["calibration/spread_b3"] == pytest.approx(0.05, rel=0.1)
    assert metrics["calibration/spread_b1"] == pytest.approx(0.5, rel=0.1)
    assert math.isnan(metrics["calibration/spread_b0"]) and math.isnan(metrics["calibration/spread_b2"])
