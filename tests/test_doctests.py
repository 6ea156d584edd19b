"""The docstring examples of the whole package run: every module of ``rollout_guard/`` and of ``integrations/``
(installed as ``rollout_guard.integrations``) that holds a ``>>>`` example, found by walking the source tree."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"rollout_guard": "rollout_guard", "integrations": "rollout_guard.integrations"}


def modules_with_examples() -> list[str]:
    """Dotted import names of the source files under ``ROOTS`` whose text holds a ``>>>`` example."""
    names = []
    for folder, package in ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            if ">>>" not in path.read_text():
                continue
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            names.append(".".join((package, *parts)).removesuffix(".__init__"))
    return names


@pytest.mark.parametrize("name", modules_with_examples())
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} holds '>>>' but doctest found no example in its docstrings"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
