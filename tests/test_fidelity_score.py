"""The fidelity replay's scoring: resampled clean rows keep the row they were drawn from, so their flagged
judgements are reported per distinct row and with an interval that counts a row judged many times once
(:func:`benchmarks.fidelity_kit.score.clustered_rate`)."""

from __future__ import annotations

import doctest
import glob
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.fidelity import conditions, preset, synthetic_faults  # noqa: E402
from benchmarks.fidelity_kit import score  # noqa: E402
from benchmarks.fidelity_kit.rollouts import fixed_subset, read_tables  # noqa: E402

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
    figures = score.figures(judged, preset("defaults"))["clean"]["resampled"]
    assert figures["judged"] == int(again.sum()) and figures["rows"] == len(origin[again].unique())
    assert figures["rows_flagged"] <= min(figures["false"], figures["rows"])
    assert figures["ci"][0] <= figures["false_rate"] <= figures["ci"][1]
