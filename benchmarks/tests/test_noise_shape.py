"""`benchmarks/noise_shape.py`: the spread of real engine-vs-trainer noise per engine-logprob bin, and which of the
fidelity benchmark's noise shapes it follows."""

from __future__ import annotations

import doctest
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import noise_shape  # noqa: E402
from benchmarks.fidelity_kit.noise import SHAPES  # noqa: E402


def test_docstring_examples():
    result = doctest.testmod(noise_shape, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_fit_names_the_shape_the_noise_was_drawn_with(shape):
    """Tokens spread over engine logprobs −10 … 0 with Gaussian noise of sd 0.03 · shape(s): binned and fitted, the
    generating shape has the smallest residual, and its scale comes back within 5 %; the others are off by more."""
    rng = np.random.default_rng(1)
    engine = -rng.exponential(2.0, 400_000).clip(max=10.0)
    scale = SHAPES[shape](torch.from_numpy(-engine)).numpy()
    trainer = engine - 0.03 * scale * rng.standard_normal(engine.size)
    fits = noise_shape.fit_shapes(noise_shape.binned_spread(engine, trainer))
    assert min(fits, key=lambda name: fits[name]["rms_log_residual"]) == shape
    assert fits[shape]["scale"] == pytest.approx(0.03, rel=0.05)
    assert all(fits[other]["rms_log_residual"] > 2 * fits[shape]["rms_log_residual"] + 0.1
               for other in SHAPES if other != shape)


def test_the_repository_s_measured_noise_follows_the_softmax_shape():
    """The committed H200 rollouts (three models, three trainer precisions): the measured spread is nearest the
    softmax shape in every (model, trainer), r ≤ 0.3 against ≥ 0.9 for the surprise shape the tail models use."""
    results = noise_shape.measure()
    assert len(results) == 9
    for r in results:
        fit = r["fit_sd"]
        assert fit["softmax"]["rms_log_residual"] <= 0.3, r["source"]
        assert min(fit["surprise"]["rms_log_residual"], fit["flat"]["rms_log_residual"]) >= 0.9, r["source"]
