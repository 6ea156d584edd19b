"""The fidelity replay's scoring: resampled clean rows keep the row they were drawn from, so their flagged
judgements are reported per distinct row and with an interval that counts a row judged many times once
(:func:`benchmarks.fidelity_kit.score.clustered_rate`); the rules read back from a row's statistics
(:func:`benchmarks.fidelity_kit.score.firings`) are the guard's own."""

from __future__ import annotations

import doctest
import glob
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.fidelity import conditions, preset, synthetic_faults  # noqa: E402
from benchmarks.fidelity_kit import score  # noqa: E402
from benchmarks.fidelity_kit.rollouts import fixed_subset, read_tables  # noqa: E402
from rollout_guard.config import GuardConfig  # noqa: E402
from rollout_guard.evidence import RolloutEvidence  # noqa: E402
from rollout_guard.guard import RolloutGuard  # noqa: E402
from rollout_guard.verdict import RULE_BIT, RULES  # noqa: E402

DATA = sorted(glob.glob(str(REPO / "benchmarks" / "fidelity_data" / "h200-*.parquet")))


def test_docstring_examples():
    result = doctest.testmod(score)
    assert result.attempted >= 5 and result.failed == 0


def test_clustered_interval_is_wider_when_one_row_carries_the_flags():
    flagged = torch.zeros(2000, dtype=torch.bool)
    flagged[:4] = True
    spread = score.clustered_rate(flagged, torch.arange(2000))  # four rows flagged once each
    one_row = torch.arange(2000) % 20  # 20 rows judged 100 times; the four flags on row 0 and ...
    lumped = score.clustered_rate(flagged, torch.where(torch.arange(2000) < 4, 0, one_row))
    assert spread[0] == lumped[0] == 0.002
    assert spread[2] < lumped[2] and lumped[3] < spread[3]
    low, high = score.wilson(4, 2000)
    assert spread[1:3] == pytest.approx((low, high), rel=1e-3)  # independent judgements: the binomial interval


@pytest.mark.parametrize("ceiling", [25.0, None])
def test_the_rules_read_back_from_the_statistics_are_the_guards_bits(ceiling):
    """Each rule of the verdict, row by row, read back from the row's statistics and the step's threshold: a NaN
    engine logprob, an infinite trainer one, a token 30 nats apart (over the ceiling, and the score), a late
    1.5-nat shift (the score alone) and healthy rows (none). Fails if a rule's reading differs from its bit."""
    generator = torch.Generator().manual_seed(0)
    engine = -3 * torch.rand(64, 128, generator=generator)
    trainer = engine + 0.05 * torch.distributions.Laplace(0.0, 1.0).sample((64, 128))
    mask = torch.ones(64, 128, dtype=torch.bool)
    guard = RolloutGuard(GuardConfig(max_quarantine_share=None, ceiling_delta=ceiling))
    for step in range(3):  # healthy steps first: the detector's noise learned
        guard.inspect(RolloutEvidence(mask, engine, trainer), step=step)
    engine, trainer = engine.clone(), trainer.clone()
    engine[0, 5] = float("nan")
    trainer[1, 7] = -float("inf")
    trainer[2, 9] = engine[2, 9] - 30.0
    trainer[3, 60:] -= 1.5
    report = guard.inspect(RolloutEvidence(mask, engine, trainer), step=3)
    fired = score.firings(report.samples, report.threshold, ceiling)
    assert list(fired) == list(RULES)
    for rule in RULES:
        assert torch.equal(fired[rule], (report.reasons & RULE_BIT[rule]) != 0), rule
    assert [fired[rule][row].item() for rule, row in (("nonfinite_engine", 0), ("nonfinite_trainer", 1),
                                                      ("ceiling", 2), ("score", 2), ("score", 3))] == \
        [True, True, ceiling is not None, True, True]
    assert not report.suspect[4:].any()


@pytest.mark.skipif(not DATA, reason="benchmarks/fidelity_data has no rollouts")
def test_every_judged_clean_row_names_the_row_it_is():
    table = fixed_subset(read_tables(DATA), clean_per_source=120, faulty_per_kind=10, seed=0)
    generator = torch.Generator().manual_seed(0)
    name, clean, real, apply, _ = next(iter(conditions(table, seed=0, step_rows=32)))
    faulty = {key: apply(rows) for key, rows in {**synthetic_faults(clean, 40, generator), **real}.items()}
    judged = score.replay(apply(clean), faulty, preset("defaults"), generator, step_rows=32, fault_share=0.05)
    samples, _, labels, counted, tokens = judged.rows()
    origin = judged.origins()
    is_clean = torch.tensor([label == "clean" for label in labels])
    assert ((origin >= 0) == is_clean).all()
    again = is_clean & ~counted
    assert again.any() and (is_clean & counted).any()
    ordered = clean.rows(torch.argsort(clean.step, stable=True))  # the replay's order: origins index it
    assert torch.equal(tokens[is_clean], ordered.mask.sum(-1)[origin[is_clean]])
    unique = origin[is_clean & counted]
    assert torch.equal(unique.sort().values, torch.arange(len(clean)))  # phase 1: every clean row once
    fired = score.firings(samples, judged.thresholds(), preset("defaults").ceiling_delta)
    suspect = judged.rows()[1]
    assert torch.equal(torch.stack(list(fired.values())).any(0), suspect)  # the rules' union is the verdict
    figures = score.figures(judged, preset("defaults"))["clean"]["resampled"]
    assert figures["judged"] == int(again.sum()) and figures["rows"] == len(origin[again].unique())
    assert figures["rows_flagged"] <= min(figures["false"], figures["rows"])
    assert figures["ci"][0] <= figures["false_rate"] <= figures["ci"][1]


@pytest.mark.skipif(not DATA, reason="benchmarks/fidelity_data has no rollouts")
@pytest.mark.parametrize("share, phase1, phase2", [
    (0.01, lambda k: int(k % 6 == 0), lambda k: int(k % 8 == 0)),  # 0.16 and 0.12 of a row a step: one every 6, 8
    (0.1, lambda k: 2, lambda k: 1),  # 1.6 and 1.33 a step: as every published run fed
])
def test_the_stream_feeds_its_share_of_faults_even_below_one_row_a_step(share, phase1, phase2):
    """Phase 1 judges 16 rows a step with its share of faults; phase 2 judges a quarter of faults, then moves the
    guard on with its share beside 12 clean rows. Below half a row a step, one faulty row every few steps (0.01 of
    16 rows: not one a step, which would be 6.25 %), in both phases."""
    table = fixed_subset(read_tables(DATA), clean_per_source=400, faulty_per_kind=10, seed=0)
    generator = torch.Generator().manual_seed(0)
    _, clean, real, apply, _ = max(conditions(table, seed=0, step_rows=16), key=lambda c: len(c[1]))
    faulty = {key: apply(rows) for key, rows in {**synthetic_faults(clean, 40, generator), **real}.items()}
    fed: list[int] = []

    class Recording(RolloutGuard):
        def inspect(self, evidence, **kwargs):
            fed.append(int(evidence.injected.sum()))
            return super().inspect(evidence, **kwargs)

    judged = score.replay(apply(clean), faulty, preset("defaults"), generator, step_rows=16, fault_share=share,
                          make_guard=Recording)
    calls = iter(fed)
    first, moved_on = [], []
    for step, (labels, counted) in enumerate(zip(judged.label, judged.counted, strict=True)):
        fill = labels.count("clean")
        assert next(calls) == len(labels) - fill  # the step as judged
        if counted[:fill].any():  # phase 1: unique clean rows
            first.append((step, len(labels) - fill))
        elif fill == 12:  # phase 2 proper: judged as it stands, then the guard moves on with its share
            moved_on.append((step, next(calls)))
    assert next(calls, None) is None
    assert len(first) >= 7 and len(moved_on) >= 16
    assert [faults for _, faults in first] == [phase1(step) for step, _ in first]
    assert [faults for _, faults in moved_on] == [phase2(step) for step, _ in moved_on]
