"""The fidelity benchmark's ``--set FIELD=VALUE``: a variant of a preset measured from the repo, its bad input refused
in one line naming the field, before any data is read and with nothing written."""

from __future__ import annotations

import doctest
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import fidelity  # noqa: E402
from benchmarks.fidelity import app, preset, with_overrides  # noqa: E402


def test_an_override_changes_that_field_only():
    base = preset("defaults")
    changed = with_overrides(base, ["false_alarm_budget=1e-4", "ceiling_delta=None"])
    assert changed.false_alarm_budget == 1e-4 and changed.ceiling_delta is None
    assert base.false_alarm_budget != 1e-4 and base.ceiling_delta is not None
    assert changed.to_dict() | {"false_alarm_budget": base.false_alarm_budget,
                                "ceiling_delta": base.ceiling_delta} == base.to_dict()
    assert with_overrides(base, []) == base
    result = doctest.testmod(fidelity)  # with_overrides' example, the module's only one
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(("item", "named"), [
    ("no_such_field=1", "no_such_field=1"),
    ("spike_delta=8.0", "spike_delta=8.0"),  # not a GuardConfig field
    ("false_alarm_budget", "false_alarm_budget"),  # no '='
    ("false_alarm_budget=two", "false_alarm_budget=two"),  # not a literal
    ("false_alarm_budget=2.0", "GuardConfig.false_alarm_budget=2.0"),  # refused by GuardConfig itself
])
def test_bad_overrides_are_refused_naming_the_field(item, named):
    with pytest.raises(typer.BadParameter) as error:
        with_overrides(preset("defaults"), [item])
    message = str(error.value)
    assert named in message and "\n" not in message


def test_an_unknown_preset_is_refused_naming_the_known_ones():
    with pytest.raises(typer.BadParameter) as error:
        preset("single-score")
    assert "'single-score'" in str(error.value) and "'defaults'" in str(error.value)


def test_the_command_refuses_a_bad_override_before_reading_data(tmp_path, monkeypatch):
    def unread(paths):  # the data must not be read
        raise AssertionError("data read before the --set check")

    monkeypatch.setattr(fidelity, "read_tables", unread)
    result = CliRunner().invoke(app, ["--data", str(REPO / "benchmarks" / "fidelity_data" / "*.parquet"),
                                      "--set", "ceiling_delta=0", "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "ceiling_delta" in result.output
    assert not (tmp_path / "out").exists()


def test_same_support_renormalises_the_trainer_by_the_engines_kept_mass():
    """``--same-support``: the trainer's logprob moves up by the engine's recorded −log Z where the support cut
    something (plus an error of the condition's own spread), and not at all where it cut nothing."""
    import torch

    from benchmarks.fidelity_kit import noise
    from benchmarks.fidelity_kit.rollouts import Rollouts

    mask = torch.tensor([[True, True, True, False]])
    raw = torch.tensor([[-0.5, -2.0, -1.0, 0.0]])
    engine = torch.tensor([[-0.3, -2.0, -0.6, 0.0]])  # top-k cut 0.2 and 0.4 nats at tokens 0 and 2
    trainer = raw.clone()  # no engine-vs-trainer noise on one support: the error's sd is 0
    rows = Rollouts(mask=mask, engine=engine, trainer=trainer, truncated=torch.tensor([False]), step=torch.tensor([0]))
    moved = noise.on_engine_support(rows, raw, torch.Generator().manual_seed(0))
    torch.testing.assert_close(moved.trainer, torch.tensor([[-0.3, -2.0, -0.6, 0.0]]))
    noisy = Rollouts(mask=mask, engine=engine, trainer=raw + torch.tensor([[0.01, -0.02, 0.03, 0.0]]),
                     truncated=torch.tensor([False]), step=torch.tensor([0]))
    moved = noise.on_engine_support(noisy, raw, torch.Generator().manual_seed(0))
    assert float(moved.trainer[0, 1]) == float(noisy.trainer[0, 1]), "nothing cut at token 1: no shift, no error"
    assert float((moved.trainer - noisy.trainer - (engine - raw))[0, [0, 2]].abs().max()) > 0, "an error where cut"
    flat = noise.topk_high_entropy(rows, torch.Generator().manual_seed(1), same_support=True)
    offset = noise.topk_high_entropy(rows, torch.Generator().manual_seed(1))
    before = (engine - trainer)[mask]
    assert float(((flat.engine - flat.trainer)[mask] - before).abs().max()) < 0.1  # its kept mass cancels, up to the error
    assert float(((offset.engine - offset.trainer)[mask] - before).min()) > 0.9  # −log m ≥ −log 0.4


def _rows_at(levels: list[float], per_level: int = 20_000):
    """Clean rows whose engine and trainer agree exactly, ``per_level`` tokens at each engine logprob of ``levels``
    (one row per level, all above −3 nats: the tail models' rare large tail stays off)."""
    import torch

    from benchmarks.fidelity_kit.rollouts import Rollouts

    engine = torch.tensor(levels).unsqueeze(1).expand(len(levels), per_level).clone()
    return Rollouts(mask=torch.ones_like(engine, dtype=torch.bool), engine=engine, trainer=engine.clone(),
                    truncated=torch.zeros(len(levels), dtype=torch.bool),
                    step=torch.zeros(len(levels), dtype=torch.long))


@pytest.mark.parametrize("shape", ["surprise", "flat", "softmax"])
def test_each_noise_shape_reaches_the_published_mean_with_its_spread_where_it_says(shape):
    """``--noise-shape``: the hybrid-7B model's broad part, fitted to the published mean |Δ| of 0.40 nats in every
    shape, spreads as its scale says: ``surprise`` 1 + s, ``flat`` the same everywhere, ``softmax`` 1 − p (nothing on
    a token the engine is sure of). Fails if a shape's scale is not the one applied, or the fit ignores it."""
    import torch

    from benchmarks.fidelity_kit import noise

    rows = _rows_at([-1.5, -2.2, -2.9])  # far enough below 0 nats that the trainer is not clamped there
    profile = noise.shaped(noise.HYBRID_7B, shape)
    assert profile.name == ("tail_hybrid7b" if shape == "surprise" else f"{shape}_hybrid7b")
    fitted = noise.fit_heavy_tail(rows, torch.Generator().manual_seed(0), profile, step_rows=3)
    moved = noise.heavy_tail(rows, torch.Generator().manual_seed(1), fitted)
    assert noise.describe(moved)["mean_abs_delta"] == pytest.approx(0.40, rel=0.03)
    spread = (moved.engine - moved.trainer).std(dim=1) / fitted["sigma0"]  # per engine level, in units of σ0
    torch.testing.assert_close(spread, noise.SHAPES[shape](torch.tensor([1.5, 2.2, 2.9])), rtol=0.03, atol=0.0)
    sure = noise.heavy_tail(_rows_at([-1e-9]), torch.Generator().manual_seed(2), fitted)
    shift = (sure.engine - sure.trainer).abs()  # its trainer cannot pass 0 nats: only shifts down show
    if shape == "softmax":
        assert float(shift.max()) < 1e-6  # nothing on a token the engine is sure of
    else:
        assert float(shift.mean()) > 0.2 * fitted["sigma0"]


def test_an_unknown_noise_shape_is_refused_before_reading_data(tmp_path, monkeypatch):
    from benchmarks.fidelity_kit import noise

    with pytest.raises(ValueError, match="noise shape 'gaussian'"):
        noise.shaped(noise.DENSE_7B, "gaussian")

    def unread(paths):
        raise AssertionError("data read before the --noise-shape check")

    monkeypatch.setattr(fidelity, "read_tables", unread)
    result = CliRunner().invoke(app, ["--noise-shape", "gaussian", "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "--noise-shape 'gaussian'" in " ".join(result.output.split()) and "softmax" in result.output
    assert not (tmp_path / "out").exists()
