"""The supported TRL range and how errors name the installed TRL (pure: needs no TRL)."""

from __future__ import annotations

import logging

import rollout_guard.integrations.trl_versions as trl_versions


def test_a_trl_outside_the_range_is_named_in_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="rollout_guard"):
        assert trl_versions.warn_if_unsupported("1.16.0") and trl_versions.warn_if_unsupported("1.14.0")
        assert not caplog.records
        assert not trl_versions.warn_if_unsupported("1.17.0")
    assert "installed trl 1.17.0; rollout_guard supports trl 1.14–1.16" in caplog.text
    assert "pip install 'trl>=1.14,<1.17'" in caplog.text


def test_the_range_matches_the_trl_extra():
    from pathlib import Path

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert f'trl = ["{trl_versions.REQUIREMENT}"' in pyproject


def test_installed_versions_are_read_from_the_distribution_and_a_missing_one_is_none():
    import pytest

    assert trl_versions.version("pytest") == pytest.__version__
    assert trl_versions.version("no-such-distribution-rollout-guard") is None
