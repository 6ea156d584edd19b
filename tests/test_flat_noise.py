"""``benchmarks/flat_noise.py``: healthy flat runs (every token the same noise) judged by a told guard, the rows
flagged counted before and after the run's own drift threshold is read."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from typer.testing import CliRunner

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.flat_noise import app  # noqa: E402


def test_a_quiet_flat_run_is_left_alone_and_a_very_noisy_one_is_not(tmp_path):
    """σ = 0.05 nats: nothing flagged in either phase (clean negative); σ = 2 nats on every token of 32-token rows
    (mean |Δ| 1.6 nats, past any published healthy run): the uncalibrated 4-nat spike threshold is 2 σ away, so rows
    are flagged before the run's own thresholds are read (a third of them; so many are never kept that it does not
    read its own drift threshold in 8 steps). Every judged row is counted in exactly one phase."""
    out = tmp_path / "flat.json"
    result = CliRunner().invoke(app, ["--sigmas", "0.05,2.0", "--lengths", "32", "--rows", "256", "--steps", "8",
                                      "--runs", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    quiet, noisy = json.loads(out.read_text())["results"]
    for figures in (quiet, noisy):
        assert sum(figures["judged"].values()) == 256 * 8
    assert quiet["judged"]["before"] > 0 and quiet["judged"]["after"] > 0, quiet  # the quiet run reads its own
    assert sum(quiet["flagged"].values()) == 0 and not quiet["rules"], quiet
    assert noisy["flagged"]["before"] > 0 and noisy["rules"], noisy
    assert "σ 0.05" in result.output and "σ 2.00" in result.output


def test_a_bad_override_is_refused_before_any_run():
    result = CliRunner().invoke(app, ["--set", "no_such_field=1"])
    assert result.exit_code != 0 and "no_such_field=1" in result.output
