"""`benchmarks/fidelity_summary.py`: the totals of a fidelity results file, and the committed result's figures that
`docs/fidelity.md` quotes."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.fidelity_kit.results_file import read_results  # noqa: E402
from benchmarks.fidelity_summary import below_goal, summary  # noqa: E402

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "fidelity"
CURRENT = "defaults-seed0-share0.001-faults1000"


def condition(name: str, late: tuple[int, bool], false: int, rate: float, flagged: int) -> dict:
    return {"condition": name, "figures": {
        "clean": {"rows": 1000, "false": false, "false_rate": rate,
                  "resampled": {"judged": 5000, "false": flagged, "false_rate": flagged / 5000}},
        "late_onset": {"rows": 1000, "caught": late[0], "pass": late[1]},
        "real_stale_weights": {"rows": 128, "caught": 0, "pass": False}}}


def test_totals_sum_over_conditions_and_the_worst_share_is_the_largest():
    """Two conditions: rows missed and false rows add up, the worst shares are each condition's largest, a cell
    counts at the goal by its own ``pass`` (999 of 1,000 passes, 998 does not), a kind outside the totals (stale
    weights: not corruption) still counts as a cell below the goal."""
    results = {"seed": 3, "faults_per_condition": 1000, "stitch": 1, "results": [
        condition("a", (999, True), 1, 0.001, 2), condition("b", (998, False), 0, 0.0, 7)]}
    s = summary(results)
    assert s["missed"]["late_onset"] == 3 and s["missed"]["isolated_spikes"] == 0
    assert (s["false"], s["worst_false"], s["flagged"], s["worst_flagged"]) == (1, 0.001, 9, 7 / 5000)
    assert (s["cells"], s["of"]) == (1, 4)
    assert below_goal(results) == [("a", "real_stale_weights", 0, 128), ("b", "late_onset", 998, 1000),
                                   ("b", "real_stale_weights", 0, 128)]


def test_the_committed_result_gives_the_figures_the_docs_quote():
    """``docs/fidelity.md``'s totals row is the committed result's: seed 0, defaults, 1,000 faults per kind and
    condition, its cells at the goal and its false quarantines."""
    s = summary(read_results(RESULTS / f"{CURRENT}.json"))
    assert (s["seed"], s["faults"], s["stitch"]) == (0, 1000, 1)
    docs = (RESULTS.parents[2] / "docs" / "fidelity.md").read_text()
    row = next(line for line in docs.splitlines() if line.startswith(f"| `benchmarks/results/fidelity/{CURRENT}"))
    assert f"| {s['cells']} of {s['of']} |" in row and f"| {s['false']:,} ({100 * s['worst_false']:.3f} %) |" in row


def test_results_are_read_by_the_name_written_from_a_gzipped_copy():
    """The results folder keeps its JSON gzipped; the name a README gives (``NAME.json``) reads ``NAME.json.gz``,
    and a name that matches neither is an error, not an empty result (and the module's doctest runs)."""
    import doctest

    import pytest

    from benchmarks.fidelity_kit import results_file

    assert not (RESULTS / f"{CURRENT}.json").exists() and (RESULTS / f"{CURRENT}.json.gz").exists()
    assert read_results(RESULTS / f"{CURRENT}.json") == read_results(RESULTS / f"{CURRENT}.json.gz")
    with pytest.raises(FileNotFoundError):
        read_results(RESULTS / "no-such-run.json")
    assert doctest.testmod(results_file).failed == 0
