"""The docstring examples of the core's pure functions run (formula, shapes and a doctest, torchmetrics style)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ("rollout_guard.statistics", "rollout_guard.packet", "rollout_guard.patterns", "rollout_guard.action",
           "rollout_guard.console", "rollout_guard.extras", "rollout_guard.injection", "rollout_guard.support",
           "rollout_guard.selection", "rollout_guard.verdict", "rollout_guard.detector.score",
           "rollout_guard.detector.noise", "rollout_guard.detector.detector")


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
