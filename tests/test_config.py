import dataclasses
import inspect

import pytest

from rollout_guard.config import GuardConfig
from rollout_guard.errors import GuardConfigError


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("mode", "quarantine-ish"),
        ("spike_delta", -1.0),
        ("spike_delta", float("inf")),
        ("mean_delta", 0),
        ("confident_wrong_tokens", 0),
        ("confident_wrong_tokens", 1.5),
        ("nonfinite_engine_tokens", True),
        ("confident_logprob", 0.3),
        ("divergence_delta", 0.0),
        ("chart_every_steps", 0),
    ],
)
def test_invalid_values_name_the_field_and_the_fix(field, value):
    with pytest.raises(GuardConfigError) as error:
        GuardConfig(**{field: value})
    assert error.value.field == field
    assert f"GuardConfig.{field}=" in str(error.value) and ": " in str(error.value)


def test_none_turns_rules_off_and_defaults_are_valid():
    config = GuardConfig(spike_delta=None, mean_delta=None, confident_wrong_tokens=None)
    assert config.spike_delta is None and config.quarantines
    assert not GuardConfig(mode="monitor").quarantines


def test_every_field_is_documented_with_a_unit_and_default():
    source = inspect.getsource(GuardConfig)
    for field in dataclasses.fields(GuardConfig):
        start = source.index(f"    {field.name}:")
        doc = source[start : source.index('"""', source.index('"""', start) + 3)]
        assert "Default" in doc, field.name
