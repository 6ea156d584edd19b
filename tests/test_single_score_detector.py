"""rollout_guard.detector: one score per row, its false-alarm bound, the noise it learns, its state."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_guard import RolloutEvidence, RolloutGuard
from rollout_guard.detector import RULE_BIT, Detector, healthy_noise, noise_of, row_scores
from rollout_guard.statistics import SAMPLE_COLUMNS
from rollout_guard.verdict import explain, rule_names
from rollout_guard.detector.noise import NUM_BINS, PRIOR_SCALE, token_histogram
from rollout_guard.detector.score import NUM_REGIONS, later_log_ratio


def laplace(shape: tuple[int, ...], scale: float, seed: int) -> torch.Tensor:
    """Laplace(0, scale) samples by the inverse CDF from a seeded generator."""
    u = torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) - 0.5
    return (-scale * torch.sign(u) * torch.log1p(-2 * u.abs())).float()


def healthy(rows: int, tokens: int, scale: float, seed: int, centre: float = -0.2) -> tuple[torch.Tensor, ...]:
    """(engine, trainer, mask) of healthy rows: engine logprobs in every confidence region, trainer = engine − noise."""
    generator = torch.Generator().manual_seed(seed + 1)
    engine = -torch.rand(rows, tokens, generator=generator) ** 2 * 6.0  # −6 … 0 nats, most near 0
    trainer = engine - laplace((rows, tokens), scale, seed) - centre
    return engine, trainer, torch.ones(rows, tokens, dtype=torch.bool)


def test_the_later_token_ratio_is_the_lag_average_of_the_onset_ratio():
    """The closed form of ln E_g[exp(ℓ(g))], g ~ U(0, D), against a numerical integral, on both sides of 0 and D."""
    b, lag = torch.tensor(0.3, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64)
    g = torch.linspace(0, 2.0, 400_001, dtype=torch.float64)
    for x in (-4.0, -0.1, 0.0, 0.7, 1.99, 2.0, 6.0):
        integral = torch.log(torch.trapezoid(torch.exp((abs(x) - (x - g).abs()) / b), g) / lag)
        closed = float(later_log_ratio(torch.tensor(x, dtype=torch.float64), b, lag))
        assert closed == pytest.approx(float(integral), abs=1e-6)


@pytest.mark.parametrize("tokens", [1, 8, 64, 512])
def test_healthy_rows_at_the_assumed_noise_stay_under_the_budget(tokens):
    """Markov's bound: under the noise the score assumes, at most α of healthy rows score over ln(1/α)."""
    rows = 200_000 // tokens
    x = laplace((rows, tokens), 0.25, seed=tokens)
    scores = row_scores(x, torch.full_like(x, 0.25), torch.ones_like(x, dtype=torch.bool)).score
    for alpha in (1e-2, 1e-3):
        assert float((scores > math.log(1 / alpha)).float().mean()) <= alpha


def test_a_sustained_shift_counts_only_towards_the_engine_and_a_spike_counts_on_both_sides_engine_first():
    """From token 10 on, a nat towards the engine is the stale-state signature (fires), a nat towards the trainer is
    not (kept). One 9-nat spike fires either way (a garbage logprob can fall on both sides), the engine-favouring
    one with the higher score."""
    x = laplace((4, 30), 0.25, seed=3)
    x[0, 10:] += 1.0
    x[1, 10:] -= 1.0
    x[2, 10], x[3, 10] = 9.0, -9.0
    scores = row_scores(x, torch.full_like(x, 0.25), torch.ones_like(x, dtype=torch.bool)).score
    threshold = math.log(1000)
    assert scores[0] > threshold > scores[1]
    assert scores[2] > scores[3] > threshold


@pytest.mark.parametrize("engine_lp, trainer_lp", [
    ([-3.5, -2.0], [-12.7, -4.8]),  # one token the engine gave 3 % and the trainer 3e-6, a further 2.8 nats
    ([-4.0, -6.0, -9.0, -11.0], [-9.0, -15.0, -12.0, -13.0]),  # four tokens 2–9 nats, none either side finds likely
])
@pytest.mark.parametrize("warm", [False, True])
def test_engine_favouring_tokens_neither_side_finds_likely_are_caught(engine_lp, trainer_lp, warm):
    """Rows a corrupted, unconfident engine makes: every disagreement where neither side finds the token likely. They
    are flagged from the first step, and after 500 healthy rows of 0.25-nat noise."""
    detector = Detector()
    if warm:
        engine, trainer, mask = healthy(500, 12, 0.06, seed=5)  # max |x| ≈ 0.25 nats over these tokens
        detector.update(detector.judge(engine, trainer, mask).kept_counts)
    engine, trainer, mask = healthy(64, 12, 0.06, seed=6)
    where = list(range(2, 2 + len(engine_lp)))
    engine[7, where], trainer[7, where] = torch.tensor(engine_lp), torch.tensor(trainer_lp)
    judgement = detector.judge(engine, trainer, mask)
    assert judgement.suspect.nonzero().flatten().tolist() == [7]
    assert judgement.reasons[7] == RULE_BIT["score"] and judgement.onset[7] in where


def test_a_late_onset_of_a_nat_is_caught_where_healthy_noise_is_a_tenth_of_it():
    engine, trainer, mask = healthy(64, 40, 0.1, seed=8)
    trainer[3, 25:] -= 1.0
    judgement = Detector().judge(engine, trainer, mask)
    assert judgement.suspect.nonzero().flatten().tolist() == [3] and 20 <= int(judgement.onset[3]) <= 30


def test_a_run_whose_healthy_tail_is_heavy_learns_it_from_the_trainer_favouring_side():
    """Healthy noise of scale 1.5 nats (a hybrid model's far end): 9-nat engine-favouring tokens are its tail, not a
    fault. The first batch already reads the scale from its own trainer-favouring tokens, and flags at most α."""
    engine, trainer, mask = healthy(2000, 64, 1.5, seed=9)
    judgement = Detector().judge(engine, trainer, mask)
    assert judgement.noise.scale.min() > 1.2
    assert float(judgement.suspect.float().mean()) <= 1e-3


def test_engine_favouring_corruption_does_not_widen_the_noise_it_is_judged_against():
    engine, trainer, mask = healthy(256, 32, 0.1, seed=10)
    clean = Detector().judge(engine, trainer, mask).noise
    trainer[:26] -= torch.rand(26, 32, generator=torch.Generator().manual_seed(1)) * 10  # a tenth of the rows
    burst = Detector().judge(engine, trainer, mask)
    assert torch.allclose(burst.noise.scale, clean.scale, rtol=0.1)  # the median moves a little, the tail does not
    assert burst.suspect[:26].all() and not burst.suspect[26:].any()


def test_the_noise_shrinks_from_the_prior_to_the_run_as_tokens_arrive():
    few, many = (token_histogram(*healthy(rows, 50, 0.05, seed=rows)) for rows in (2, 2000))
    assert healthy_noise(torch.zeros(NUM_REGIONS, NUM_BINS, dtype=torch.float64)).scale.tolist() == [PRIOR_SCALE] * 4
    assert (healthy_noise(few).scale > 0.15).all()  # ~25 tokens a region: still near the prior's 0.25
    assert (healthy_noise(many).scale < 0.08).all()  # ~25,000 a region: the run's own 0.05, bounded from above
    assert (noise_of(many).scale > 0.045).all()


def test_nonfinite_logprobs_and_the_ceiling_fire_on_their_own():
    engine, trainer, mask = healthy(8, 10, 0.05, seed=11)
    engine[1, 3], trainer[2, 4] = math.nan, math.inf
    trainer[3, 5] = engine[3, 5] + 30.0  # trainer-favouring by 30 nats: beyond the ceiling, whatever the direction
    reasons = Detector().judge(engine, trainer, mask).reasons
    assert reasons[1] == RULE_BIT["nonfinite_engine"] and reasons[2] == RULE_BIT["nonfinite_trainer"]
    assert reasons[3] & RULE_BIT["ceiling"] and not reasons[[0, 4, 5, 6, 7]].any()


def test_padding_and_empty_rows_never_count():
    engine, trainer, mask = healthy(4, 10, 0.05, seed=12)
    mask[0] = False
    mask[1, 5:] = False
    engine[1, 5:], trainer[1, 5:] = -1.0, -30.0  # garbage under padding
    judgement = Detector().judge(engine, trainer, mask)
    assert judgement.score[0] == -math.inf and judgement.onset[0] == -1 and not judgement.suspect.any()
    assert judgement.kept_counts.sum() == mask.sum()


def test_the_state_is_a_sum_so_processes_combine_by_adding():
    """Two processes' kept histograms summed give the state one process holding both halves reaches."""
    engine, trainer, mask = healthy(128, 16, 0.1, seed=13)
    whole, parts = Detector(), [Detector(), Detector()]
    whole.update(whole.judge(engine, trainer, mask).kept_counts)
    kept = sum(parts[0].judge(engine[i::2], trainer[i::2], mask[i::2]).kept_counts for i in range(2))
    for detector in parts:
        detector.update(kept)
    for detector in parts:
        assert torch.equal(detector.counts, whole.counts)


def test_reset_and_checkpoint_follow_the_declared_state():
    detector = Detector()
    for seed in range(6):  # 12,000 tokens a region or so: the early level is recorded
        detector.update(detector.judge(*healthy(1000, 48, 0.1, seed=seed)).kept_counts)
    assert set(detector.state_dict()) == set(Detector.STATE) and (detector.early_scale > 0).all()
    restored = Detector()
    restored.load_state_dict(detector.state_dict())
    engine, trainer, mask = healthy(16, 16, 0.1, seed=99)
    assert torch.equal(restored.judge(engine, trainer, mask).score, detector.judge(engine, trainer, mask).score)
    detector.reset()
    assert all(not getattr(detector, name).any() for name in Detector.STATE)
    with pytest.raises(ValueError, match="counts"):
        restored.load_state_dict({"counts": torch.zeros(2), "early_scale": torch.zeros(NUM_REGIONS)})


def test_a_noise_that_grows_over_the_run_is_reported_against_its_early_level():
    detector = Detector()
    for seed in range(6):
        detector.update(detector.judge(*healthy(1000, 48, 0.1, seed=seed)).kept_counts)
    assert (detector.grown() < 1.3).all()
    for seed in range(6, 40):  # a two-sided fault that grows: five times the noise
        detector.update(detector.judge(*healthy(1000, 48, 0.5, seed=seed)).kept_counts)
    assert (detector.grown() > 2.0).all()


def test_the_explanation_names_the_token_and_its_distance_in_noise_scales():
    engine, trainer, mask = healthy(4, 20, 0.05, seed=14)
    engine[2, 9], trainer[2, 9] = -0.2, -6.2
    report = RolloutGuard().inspect(RolloutEvidence(mask, engine, trainer), step=0)

    def line(row: int) -> str:
        stats = dict(zip(SAMPLE_COLUMNS, report.samples[row].tolist(), strict=True))
        return explain(stats, rule_names(int(report.reasons[row])), report.threshold)

    assert line(2).startswith("suspect: from token 9 (engine -0.2, trainer -6.2 nats) the engine favours it by 6")
    assert "over the threshold 6.9" in line(2)
    assert line(0).startswith("kept:") and "under the threshold" in line(0)


def test_a_budget_outside_zero_and_one_is_refused():
    with pytest.raises(ValueError, match="false_alarm_budget"):
        Detector(false_alarm_budget=0.0)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), tokens=st.integers(0, 20), shift=st.floats(-30, 30), seed=st.integers(0, 1000))
def test_the_score_does_not_depend_on_where_the_run_centres_its_noise(rows, tokens, shift, seed):
    """Moving both the tokens and the centre by the same offset changes no score (the score reads x = d − μ)."""
    x = laplace((rows, tokens), 0.3, seed)
    read = torch.rand(rows, tokens, generator=torch.Generator().manual_seed(seed)) > 0.2
    scale = torch.full_like(x, 0.3)
    first = row_scores(x, scale, read)
    assert torch.equal(first.score.isfinite(), read.any(-1))
    assert torch.equal(first.onset >= 0, read.any(-1))
    moved = row_scores((x + shift) - shift, scale, read)
    assert torch.allclose(first.score, moved.score, atol=1e-3, equal_nan=True)


def test_an_offset_of_the_engine_s_processed_logprobs_is_the_centre_from_the_first_step():
    """A top-k cut raises every engine logprob by ~1.5 nats (the log of the kept mass): healthy, two-sided around
    that offset. The first batch, 200 tokens, is judged around its own median: nothing flagged."""
    engine, trainer, mask = healthy(20, 10, 0.05, seed=15)
    judgement = Detector().judge(engine, trainer - 1.5, mask)
    assert not judgement.suspect.any() and (judgement.noise.centre[judgement.noise.tokens > 0] > 1.2).all()


def test_a_corrupted_token_alone_in_its_confidence_region_does_not_centre_that_region_on_itself():
    """The only unlikely token of a short batch, 9.2 nats engine-favouring: its region's median is the token itself,
    so the region's centre leans on every region's median instead, and the row is flagged."""
    engine = torch.full((4, 20), -0.1)
    trainer = engine - laplace((4, 20), 0.02, seed=16)
    engine[2, 7], trainer[2, 7] = -3.5, -12.7
    judgement = Detector().judge(engine, trainer, torch.ones(4, 20, dtype=torch.bool))
    assert judgement.suspect.nonzero().flatten().tolist() == [2] and judgement.noise.centre[0] < 1.0


def test_a_heavy_tail_the_run_shows_on_the_trainer_side_is_not_read_as_a_lag_on_the_engine_side():
    """A run whose unlikely tokens sometimes disagree by 10 nats, on both sides (here: 40 such tokens among its first
    200,000, one in a row). Each side's deep tokens are held to how rare the other side has shown them, so the run
    learns its own tail within a step or two; a lone engine-favouring 9-nat token there is its tail and is kept, the
    same token in a quiet run is flagged."""
    heavy, quiet = Detector(), Detector()
    for seed in range(4):
        engine, trainer, mask = healthy(1000, 50, 0.1, seed=20 + seed)
        quiet.update(quiet.judge(engine, trainer, mask).kept_counts)
        rows = torch.arange(10) * 100  # ten rows, one such token each
        engine[rows[:5], 3], trainer[rows[:5], 3] = -13.0, -3.0  # trainer-favouring by 10 nats, both sides unsure
        engine[rows[5:], 3], trainer[rows[5:], 3] = -3.2, -13.2  # engine-favouring by 10 nats
        heavy.update(heavy.judge(engine, trainer, mask).kept_counts)
    engine, trainer, mask = healthy(64, 50, 0.1, seed=30)
    engine[5, 20], trainer[5, 20] = -3.5, -12.5
    assert not heavy.judge(engine, trainer, mask).suspect[5]
    assert quiet.judge(engine, trainer, mask).suspect.nonzero().flatten().tolist() == [5]


def test_a_heavy_tail_in_the_first_batch_goes_on_past_its_deepest_trainer_favouring_token():
    """A fresh detector (a run's first step, or the first after its sampling changed) whose batch shows a healthy
    two-sided tail on tokens neither side finds likely, as the published 7B runs do: six tokens 1–9 nats to the
    trainer's side, six 1–12 nats to the engine's, one a row. The deepest engine-favouring token lies beyond every
    trainer-favouring one; the tail the batch shows carries on past its deepest token, so that row is kept. The
    same token in a quiet batch is flagged."""
    engine, trainer, mask = healthy(256, 64, 0.05, seed=31)
    quiet_engine, quiet_trainer = engine.clone(), trainer.clone()
    depths = torch.tensor([1.5, 2.5, 4.0, 5.5, 7.0, 9.0, 1.2, 2.0, 3.0, 5.0, 7.5, 12.0])
    rows = torch.arange(12) * 20
    engine[rows, 5] = torch.cat([-4.0 - depths[:6], torch.full((6,), -4.0)])  # trainer-favouring: the engine lower
    trainer[rows, 5] = torch.cat([torch.full((6,), -4.0), -4.0 - depths[6:]])  # engine-favouring: the trainer lower
    assert Detector().judge(engine, trainer, mask).suspect.nonzero().flatten().tolist() == []
    quiet_engine[rows[11], 5], quiet_trainer[rows[11], 5] = -4.0, -16.0
    assert Detector().judge(quiet_engine, quiet_trainer, mask).suspect.nonzero().flatten().tolist() == [int(rows[11])]
