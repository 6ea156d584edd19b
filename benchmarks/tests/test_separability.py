"""The hindsight bound's price of the goal (``benchmarks/separability.py``): the share of clean samples an oracle
must quarantine to catch 99.9 % of the faulty ones, a point of the trade-off curve."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.fidelity_kit.rollouts import Rollouts  # noqa: E402
from benchmarks.separability import Rarity, best_recall, cross_fitted, false_at_goal, trade_off  # noqa: E402


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


def _rows(count: int, generator: torch.Generator, spike: float = 0.0) -> Rollouts:
    """``count`` rows of 20 tokens spread over every engine-logprob bin (0 to −8 nats), d ~ N(0, 0.3) nats: many
    cells, a few sparse (where d crosses a bin edge); ``spike`` added to the first token's d."""
    engine = -torch.rand(count, 20, generator=generator) * 8
    d = torch.randn(count, 20, generator=generator) * 0.3
    d[:, 0] += spike
    return Rollouts(mask=torch.ones(count, 20, dtype=torch.bool), engine=engine, trainer=(engine - d).clamp(max=0),
                    truncated=torch.zeros(count, dtype=torch.bool), step=torch.zeros(count, dtype=torch.long))


def test_the_bound_scores_each_clean_row_without_its_own_tokens():
    """Fresh rows from the clean rows' own distribution are not faults: an honest bound flags about the 0.1 % it
    allows. Scored against all clean tokens, its own included, a clean row's rarest token is never rarer than
    one in N/2, while a fresh row's token past a sparse cell's clean maximum is one in N: the bound called
    0.9 % of fresh clean rows separable (9 times the allowance); leaving each row's own tokens out, 0.15 %."""
    generator = torch.Generator().manual_seed(0)
    clean, fresh = _rows(2000, generator), _rows(2000, generator)
    in_sample = Rarity(clean, extrapolate=False)
    assert best_recall(in_sample.scores(clean), in_sample.scores(fresh)) > 0.005
    out_of_sample = Rarity(clean)
    assert best_recall(out_of_sample.scores(clean, own=clean), out_of_sample.scores(fresh)) < 0.003


def test_past_the_clean_maximum_the_bound_goes_by_how_far():
    """Left out of its own row's tokens, each clean row that holds a cell's largest |d| is past every other
    row's: with rarity alone its rarest token scores as high as any fault's can (1 in N), and with ~50 cells that
    is more clean rows than 0.1 %, so a 3-nat spike on every faulty row is caught only by the sums over many rare
    tokens (14 %). The exponential tail past the largest other clean |d| of the cell (scale: the mean excess of the
    cell's 20 largest) tells them apart."""
    generator = torch.Generator().manual_seed(0)
    clean, spiky = _rows(2000, generator), _rows(2000, generator, spike=3.0)
    saturated = Rarity(clean, extrapolate=False)
    assert best_recall(saturated.scores(clean, own=clean), saturated.scores(spiky)) < 0.2
    extrapolated = Rarity(clean)
    assert best_recall(extrapolated.scores(clean, own=clean), extrapolated.scores(spiky)) > 0.999


def test_the_trade_off_curve_reads_the_best_score_at_each_false_share():
    """Clean scores 0 … 999 on A, all 0 on B; faults at 999.5, 995, 960, 500 on A and 1 on B. At 0.1 % false the
    threshold on A is 998 (one fault above) but B alone separates every fault: 100 % at every share. Without B the
    curve climbs as the oracle may quarantine more: 25 % at 0.1 % (threshold 998), 50 % at 1 % (989), 75 % at 10 %
    (899)."""
    clean = {"A": torch.arange(1000.0), "B": torch.zeros(1000)}
    faulty = {"A": torch.tensor([999.5, 995.0, 960.0, 500.0]), "B": torch.ones(4)}
    assert trade_off(clean, faulty, rates=(0.001, 0.01, 0.1)) == [1.0, 1.0, 1.0]
    assert trade_off({"A": clean["A"]}, {"A": faulty["A"]}, rates=(0.001, 0.01, 0.1)) == [0.25, 0.5, 0.75]


def _guard_run(tmp_path, **fields):
    """A guard results file as ``benchmarks/fidelity.py`` writes it, with ``fields`` changed."""
    import json
    from benchmarks.fidelity import DEFAULT_DATA, REPO
    import glob
    run = {"data": [str(Path(p).relative_to(REPO)) for p in sorted(glob.glob(DEFAULT_DATA))],
           "faults_per_condition": 1000, "step_rows": 256, "seed": 0, "same_support": True, "results": []}
    path = tmp_path / "results-defaults.json"
    path.write_text(json.dumps({**run, **fields}))
    return path


@pytest.mark.parametrize(("fields", "named"), [
    ({"faults_per_condition": 2000}, "--faults-per-condition 2000"),
    ({"seed": 1}, "--seed 1"),
    ({"step_rows": 128}, "--step-rows 128"),
    ({"same_support": False}, "--no-same-support"),
    ({"same_support": None}, "--no-same-support"),  # written before the option existed: the full vocabulary
    ({"noise_shape": "softmax"}, "--noise-shape softmax"),
    ({"data": ["benchmarks/fidelity_data/h200-llama_clean_0.parquet"]}, "other data"),
])
def test_a_guard_run_with_other_draws_is_refused_before_the_data_is_read(tmp_path, monkeypatch, fields, named):
    """The bound prints the guard's recall beside its own for the same rows only if both drew them alike: a guard
    run with another seed, fault count, step size, support or data is refused in one line naming the option, before
    any data is read and with nothing written (before, the two commands' defaults drew 2,000 and 1,000 faults)."""
    from typer.testing import CliRunner
    from benchmarks import separability

    def unread(paths):
        raise AssertionError("data read before the --guard-results check")

    monkeypatch.setattr(separability, "read_tables", unread)
    result = CliRunner().invoke(separability.app, ["--same-support", "--guard-results",
                                                   str(_guard_run(tmp_path, **fields)), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    assert named in " ".join(result.output.split()), result.output
    assert not (tmp_path / "o").exists()


def test_a_guard_run_with_the_same_draws_goes_on_to_the_data(tmp_path, monkeypatch):
    from typer.testing import CliRunner
    from benchmarks import separability

    class Read(Exception):
        pass

    def read(paths):
        raise Read

    monkeypatch.setattr(separability, "read_tables", read)
    result = CliRunner().invoke(separability.app, ["--same-support", "--guard-results", str(_guard_run(tmp_path)),
                                                   "--out", str(tmp_path / "o")])
    assert isinstance(result.exception, Read), result.output


def test_the_two_benchmarks_draw_the_same_number_of_faults_by_default():
    import inspect
    from benchmarks import fidelity, separability
    defaults = [inspect.signature(m.main).parameters["faults_per_condition"].default.default
                for m in (fidelity, separability)]
    assert defaults == [1000, 1000]


def test_the_module_examples_run():
    import doctest
    from benchmarks import separability
    result = doctest.testmod(separability)
    assert result.attempted > 0 and result.failed == 0


def test_the_cross_fitted_bound_counts_each_sample_once_on_the_half_its_rule_did_not_see():
    """Faults drawn from the clean scores' own distribution cannot be told from them: a rule set on one half to
    flag 0.1 % of its clean samples flags about as much of the other half's, and of the faults. Counted on the
    halves the rules did not see, every sample once."""
    generator = torch.Generator().manual_seed(0)
    clean = {name: torch.randn(8000, generator=generator) for name in "ABC"}
    same = {name: torch.randn(4000, generator=generator) for name in "ABC"}
    counts = cross_fitted(clean, same, torch.Generator().manual_seed(1))
    assert (counts["clean"], counts["faulty"]) == (8000, 4000)
    assert counts["caught"] <= 16 and counts["flagged"] <= 24  # ~0.1 % of each, 4 and 8 expected


def test_held_out_the_clean_samples_flagged_are_not_capped_by_the_threshold_that_was_set_on_them():
    """A threshold set on a half flags at most 0.1 % of that half (4 of 4,000) by construction; counted on the
    other half it flags more about half the time: over ten splits, more than 8 of 8,000 at least once (a bound
    that counted the rows it was fitted on could never show it)."""
    generator = torch.Generator().manual_seed(0)
    clean = {name: torch.randn(8000, generator=generator) for name in "ABC"}
    faulty = {name: torch.randn(100, generator=generator) + 10 for name in "ABC"}
    flagged = [cross_fitted(clean, faulty, torch.Generator().manual_seed(seed))["flagged"] for seed in range(10)]
    assert max(flagged) > 8 and min(flagged) <= 8
