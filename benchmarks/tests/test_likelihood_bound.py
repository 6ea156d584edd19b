"""The likelihood-ratio test of ``benchmarks/likelihood_bound.py``: it finds a late onset that the noise model
hides from per-token rarity, and finds nothing where there is nothing to find or where the lag has the other sign."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.fidelity_kit import noise, zoo  # noqa: E402
from benchmarks.fidelity_kit.rollouts import Rollouts  # noqa: E402
from benchmarks.likelihood_bound import (LAGS, LEARNED_EDGES, bound, learned_noise, measured_mismatch,  # noqa: E402
                                        row_log_lr, suffix_log_lr)

SIGMA0 = 0.15  # nats: the broad part's scale per unit of surprise (the hybrid-7B model's is 0.14–0.18)


def _clean(count: int, generator: torch.Generator, length: int = 40) -> Rollouts:
    """Rows whose engine logprobs spread over −2.5 … −0.1 nats, the trainer agreeing to 0.01 nats (a quiet
    small model): the noise model then puts all the mismatch there is."""
    engine = -0.1 - 2.4 * torch.rand(count, length, generator=generator)
    trainer = engine - 0.01 * torch.randn(count, length, generator=generator)
    return Rollouts(mask=torch.ones(count, length, dtype=torch.bool), engine=engine, trainer=trainer.clamp(max=-1e-6),
                    truncated=torch.zeros(count, dtype=torch.bool), step=torch.zeros(count, dtype=torch.long))


def _noise(generator: torch.Generator):
    fitted = {"sigma0": SIGMA0, "tail_rate": 0.0, "tail_max": 18.0}
    return lambda rows: noise.heavy_tail(rows, generator, fitted)


def _scores(rows: Rollouts, base) -> torch.Tensor:
    return row_log_lr(rows, base, SIGMA0)


def test_a_late_onset_is_found_at_a_thousandth_of_clean_rows_and_fresh_clean_rows_are_not():
    generator = torch.Generator().manual_seed(0)
    apply = _noise(generator)
    fit = _clean(4000, generator)
    base = measured_mismatch(fit)
    clean = _scores(apply(fit), base)
    threshold = float(clean.sort(descending=True).values[4])  # 0.1 % of 4,000 above it
    faulty = apply(zoo.late_onset(_clean(1000, generator), generator))
    assert float((_scores(faulty, base) > threshold).double().mean()) >= 0.99
    fresh = _scores(apply(_clean(4000, generator)), base)  # nothing to find: about the 0.1 % allowed
    assert float((fresh > threshold).double().mean()) < 0.005


def test_a_lag_of_the_other_sign_is_not_what_the_test_looks_for():
    """The fault's lag is the engine above the trainer (d > 0, the stale-state signature); the same rows with
    the two sides swapped on the corrupted tokens score as clean ones do."""
    generator = torch.Generator().manual_seed(1)
    apply = _noise(generator)
    fit = _clean(4000, generator)
    base = measured_mismatch(fit)
    threshold = float(_scores(apply(fit), base).sort(descending=True).values[4])
    source = _clean(1000, generator)
    lagging = zoo.late_onset(source, generator)
    corrupted = lagging.engine != source.engine
    swapped = replace(lagging, engine=torch.where(corrupted, lagging.trainer, lagging.engine),
                      trainer=torch.where(corrupted, lagging.engine, lagging.trainer))
    assert float((_scores(apply(lagging), base) > threshold).double().mean()) >= 0.99
    assert float((_scores(apply(swapped), base) > threshold).double().mean()) < 0.01


def test_tokens_the_test_does_not_read_change_nothing():
    """Tokens the engine put below −3 nats (where the tail model's healthy 1–18-nat jumps live) and padding are
    not read: a row with such a token, whatever its mismatch, scores as the row without it."""
    later = torch.randn(1, 4, 3, generator=torch.Generator().manual_seed(2))
    first = torch.randn(1, 4, 3, generator=torch.Generator().manual_seed(3))
    judged = torch.tensor([[True, False, True, True]])
    moved = later.clone()
    moved[0, 1] += 50.0
    assert suffix_log_lr(moved, first + torch.tensor([0.0, 50.0, 0.0, 0.0])[None, :, None], judged) == \
        pytest.approx(float(suffix_log_lr(later, first, judged)))
    assert suffix_log_lr(later[:, [0, 2, 3]], first[:, [0, 2, 3]], torch.ones(1, 3, dtype=torch.bool)) == \
        pytest.approx(float(suffix_log_lr(later, first, judged)))
    assert suffix_log_lr(later, first, torch.zeros(1, 4, dtype=torch.bool)) == -math.inf


def test_the_bound_counts_every_clean_row_once_with_a_threshold_set_on_the_other_half():
    generator = torch.Generator().manual_seed(4)
    clean = _clean(4001, generator)
    figures = bound(clean, {}, _noise(generator), SIGMA0, 500, generator)
    assert figures["clean_rows"] == 4001 and len(figures["thresholds_log_lr"]) == 2
    assert figures["false"] < 20  # 0.1 % of each half expected: 4 in all
    assert figures["late_onset"]["rows"] == 500
    assert figures["late_onset"]["caught"] >= 495
    assert figures["late_onset"]["caught_at_own_threshold"] >= 495


def test_a_threshold_set_on_the_rows_it_counts_would_flag_none_of_them():
    """With fewer than 1,000 rows a half's 0.1 % point is its highest score, so counted in sample no clean row is
    ever above it (``own_false``, every time); counted on the other half, a row lies above it about as often as
    the held half's highest score beats the fitted half's (about once per half: ~20 in 10 draws of two halves)."""
    flagged = 0
    for seed in range(10):
        generator = torch.Generator().manual_seed(10 + seed)
        figures = bound(_clean(200, generator), {}, _noise(generator), SIGMA0, 10, generator)
        assert figures["clean_rows"] == 200
        assert figures["own_false"] == 0
        flagged += figures["false"]
    assert flagged >= 5


def test_the_noise_read_from_noisy_clean_rows_is_the_models_broad_part():
    """``learned_noise`` reads per 0.25-nat engine bin what the model put there: sd σ0 (1 + |e|) over the quiet
    rows' 0.01 nats (to 4 % in every bin the rows fill, but the top one: a trainer near 0 nats is clamped), mean ~0."""
    generator = torch.Generator().manual_seed(5)
    mean, sd = learned_noise(_noise(generator)(_clean(4000, generator)))
    middle = (LEARNED_EDGES[:-1] + LEARNED_EDGES[1:]) / 2
    filled = (middle > -2.5) & (middle < -0.25)  # the rows' engine logprobs lie in −2.5 … −0.1
    expected = (SIGMA0 ** 2 * (1 + middle.abs()) ** 2 + 0.01 ** 2).sqrt()
    assert torch.allclose(sd[1:-1][filled], expected[filled], rtol=0.04)
    assert float(mean[1:-1][filled].abs().max()) < 0.01


def test_the_learned_noise_ranks_rows_as_the_model_does_where_the_model_is_true():
    """Where the noise is the model's, the test told no σ0 ranks clean and late-onset rows as the test told it:
    rank correlation over 0.98 (0.84 and 0.93 with every token's sd read as 0.5 nats instead)."""
    generator = torch.Generator().manual_seed(7)
    apply = _noise(generator)
    fit = _clean(2000, generator)
    learned, measured = learned_noise(apply(fit)), measured_mismatch(fit)
    for rows in (apply(_clean(500, generator)), apply(zoo.late_onset(_clean(500, generator), generator))):
        ranks = torch.stack([row_log_lr(rows, learned, None).argsort().argsort().double(),
                             row_log_lr(rows, measured, SIGMA0).argsort().argsort().double()])
        assert float(torch.corrcoef(ranks)[0, 1]) > 0.98


@pytest.mark.parametrize("lag", ["fault", "generic"])
def test_with_the_noise_learned_and_either_lag_a_late_onset_is_still_found(lag):
    """Told no σ0 (the noise read from noisy clean rows) and, with ``generic``, not the fault's own lag profile,
    the test still finds 99 % of late-onset rows at a threshold that fresh clean rows pass about 0.1 % of the time."""
    generator = torch.Generator().manual_seed(6)
    apply = _noise(generator)
    fit = apply(_clean(4000, generator))
    base = learned_noise(fit)
    threshold = float(row_log_lr(fit, base, None, LAGS[lag]).sort(descending=True).values[4])
    faulty = apply(zoo.late_onset(_clean(1000, generator), generator))
    assert float((row_log_lr(faulty, base, None, LAGS[lag]) > threshold).double().mean()) >= 0.99
    fresh = row_log_lr(apply(_clean(4000, generator)), base, None, LAGS[lag])
    assert float((fresh > threshold).double().mean()) < 0.005


def test_the_module_examples_run():
    import doctest
    from benchmarks import likelihood_bound
    result = doctest.testmod(likelihood_bound)
    assert result.attempted > 0 and result.failed == 0


def test_data_that_matches_nothing_is_one_line_naming_the_option(tmp_path):
    from typer.testing import CliRunner
    from benchmarks import likelihood_bound
    result = CliRunner().invoke(likelihood_bound.app, ["--data", str(tmp_path / "none-*.parquet"),
                                                       "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    assert "--data" in result.output and "matches no file" in " ".join(result.output.split())
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("arguments, option", [(["--noise", "guessed"], "--noise"), (["--lag", "late"], "--lag"),
                                               (["--noise-shape", "softmax"], "--noise-shape"),
                                               (["--noise", "learned", "--noise-shape", "round"], "--noise-shape")])
def test_a_bad_option_is_one_line_naming_it_before_data_is_read(tmp_path, arguments, option):
    """The model's σ0 (1 + |e|) is the surprise shape: another shape needs the noise learned."""
    from typer.testing import CliRunner
    from benchmarks import likelihood_bound
    result = CliRunner().invoke(likelihood_bound.app, [*arguments, "--data", str(tmp_path / "none-*.parquet"),
                                                       "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    assert option in result.output and "matches no file" not in result.output
    assert not (tmp_path / "o").exists()
