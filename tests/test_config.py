import dataclasses
import inspect
import math
from pathlib import Path

import pytest

from rollout_guard.config import GuardConfig
from rollout_guard.errors import GuardConfigError


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("mode", "quarantine-ish"),
        ("false_alarm_budget", 0.0),
        ("false_alarm_budget", 1.0),
        ("false_alarm_budget", 5),  # a count, not a share
        ("false_alarm_budget", float("nan")),
        ("false_alarm_budget", True),
        ("false_alarm_budget", None),
        ("ceiling_delta", -1.0),
        ("ceiling_delta", 0),
        ("ceiling_delta", float("inf")),
        ("ceiling_delta", True),
        ("tolerance_delta", -1e-9),
        ("tolerance_delta", float("nan")),
        ("tolerance_delta", float("inf")),
        ("tolerance_delta", False),
        ("tolerance_delta", "0"),
        ("chart_every_steps", 0),
        ("max_quarantine_share", True),
        ("alert_jump", True),
        ("alert_min_share", True),
        ("output_dir", 123),
        ("compute_trainer_logprobs", "no"),
        ("compute_trainer_logprobs", 0),
        ("compare_on_engine_support", 1),
        ("alert_jump", float("inf")),
        ("evidence_samples_per_step", -1),
        ("evidence_samples_per_step", 2.0),
        ("evidence_samples_per_step", True),
        ("evidence_samples_per_step", None),
        ("max_consecutive_failures", 0),
        ("max_consecutive_failures", 2.0),
        ("max_consecutive_failures", True),
    ],
)
def test_invalid_values_name_the_field_and_the_fix(field, value):
    with pytest.raises(GuardConfigError) as error:
        GuardConfig(**{field: value})
    assert error.value.field == field
    assert f"GuardConfig.{field}=" in str(error.value) and ": " in str(error.value)


def test_none_turns_the_ceiling_off_and_defaults_are_valid():
    config = GuardConfig(ceiling_delta=None)
    assert config.ceiling_delta is None and config.quarantines
    assert not GuardConfig(mode="monitor").quarantines


def test_every_field_is_documented_with_a_unit_and_default():
    source = inspect.getsource(GuardConfig)
    for field in dataclasses.fields(GuardConfig):
        start = source.index(f"    {field.name}:")
        doc = source[start : source.index('"""', source.index('"""', start) + 3)]
        assert "Default" in doc, field.name


def test_few_fields_and_few_of_them_tune_detection():
    names = [field.name for field in dataclasses.fields(GuardConfig)]
    assert len(names) <= 24
    detection = {"false_alarm_budget", "ceiling_delta", "tolerance_delta", "compare_on_engine_support",
                 "compute_trainer_logprobs"}
    assert detection <= set(names) and len(detection) <= 6


def test_borderline_values_are_accepted():
    GuardConfig(false_alarm_budget=1e-12)
    GuardConfig(false_alarm_budget=1 - 1e-9)
    GuardConfig(output_dir=Path("somewhere"), ceiling_delta=1e-9, max_quarantine_share=1, alert_jump=1)
    GuardConfig(compute_trainer_logprobs=False)
    GuardConfig(evidence_samples_per_step=0)  # statistics only
    GuardConfig(tolerance_delta=0.0)  # zero tolerance: any difference
