"""The hindsight bound's price of the goal (``benchmarks/separability.py``): the share of clean samples an oracle
must quarantine to catch 99.9 % of the faulty ones, the point of the trade-off curve the README quotes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.separability import best_recall, false_at_goal  # noqa: E402


def test_the_price_of_the_goal_is_the_clean_share_at_or_above_the_faults_lowest_thousandth():
    """2,000 faulty samples score 10 … 11.999 except two at 0.5 and 1.5; the goal lets 2 of them go (0.1 %), so the
    threshold is the third lowest, 10.002, and the clean samples (0 … 9.999) pay nothing. A third low fault moves
    the threshold to 1.5: 8,500 of 10,000 clean samples score at least that."""
    clean = {"A": torch.arange(10000.0) / 1000}
    faulty = torch.arange(2000.0) / 1000 + 10
    faulty[:2] = torch.tensor([0.5, 1.5])
    assert false_at_goal(clean, {"A": faulty}) == 0.0
    faulty[2] = 0.25
    assert false_at_goal(clean, {"A": faulty}) == pytest.approx(8500 / 10000)


def test_the_price_takes_the_cheapest_score_and_is_zero_where_the_bound_reaches_the_goal():
    clean = {"A": torch.zeros(1000), "B": torch.zeros(1000)}
    faulty = {"A": torch.zeros(1000), "B": torch.ones(1000)}  # A cannot tell them apart, B can
    assert false_at_goal(clean, faulty) == 0.0
    assert best_recall({"A": clean["A"], "B": clean["B"], "C": torch.zeros(1000)},
                       {"A": faulty["A"], "B": faulty["B"], "C": torch.zeros(1000)}) == 1.0
    assert false_at_goal({"A": clean["A"]}, {"A": faulty["A"]}) == 1.0  # inseparable: every clean sample
