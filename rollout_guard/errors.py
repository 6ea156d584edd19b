"""Errors that name the offending field and the fix."""

from __future__ import annotations


class GuardError(Exception):
    """Base class of the guard's own errors."""


class GuardConfigError(GuardError, ValueError):
    """A configuration value is invalid."""

    def __init__(self, field: str, value: object, fix: str) -> None:
        self.field = field
        super().__init__(f"GuardConfig.{field}={value!r} is invalid: {fix}.")


class GuardInputError(GuardError, ValueError):
    """A batch handed to the guard is structurally wrong (shape, dtype, device, missing key)."""

    def __init__(self, field: str, problem: str, fix: str) -> None:
        self.field = field
        super().__init__(f"rollout_guard input '{field}': {problem}. Fix: {fix}.")


class CircuitBreakerTripped(GuardError):
    """Raised from ``trainer.train()`` when too many rollouts of a step were suspect (the engine is broken), with
    ``GuardConfig(on_ceiling="stop")`` (the default: after that step's update, at the end of training) or
    ``"raise"`` (inside that step); the guard's records and summary are written first."""
