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
        # issue 9 point 9: wrong order, −inf thresholds, True for a number
        ("doubtful_logprob", -0.1),  # above confident_logprob (ln 0.5): a token would be both confident and doubtful
        ("doubtful_logprob", float("-inf")),
        ("confident_logprob", float("-inf")),
        ("spike_delta", True),
        ("mean_delta", True),
        ("max_quarantine_share", True),
        ("alert_jump", True),
        ("alert_min_share", True),
        ("divergence_delta", True),
        # issue 9 point 13: accepted today, wrong
        ("confident_logprob", 0),  # only p = 1 is confident: the rule could never fire
        ("confident_logprob", 0.0),
        ("doubtful_logprob", 0.0),
        ("divergence_delta", float("inf")),
        ("divergence_delta", float("nan")),
        ("output_dir", 123),
        ("compute_trainer_logprobs", "no"),
        ("compute_trainer_logprobs", 0),
        ("alert_jump", float("inf")),
        # issue 12 part 1
        ("evidence_samples_per_step", -1),
        ("evidence_samples_per_step", 2.0),
        ("evidence_samples_per_step", True),
        ("evidence_samples_per_step", None),
        # the drift rule's joint part
        ("joint_margin", -0.1),
        ("joint_margin", float("inf")),
        ("joint_margin", True),
        ("joint_drift_weight", float("nan")),
        ("joint_drift_weight", None),
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


def test_borderline_values_are_accepted():
    import math
    from pathlib import Path

    GuardConfig(confident_logprob=-1e-9, doubtful_logprob=-1e-6)  # just below zero, doubtful just below confident
    GuardConfig(doubtful_logprob=math.log(0.5) - 1e-9)
    GuardConfig(output_dir=Path("somewhere"), spike_delta=1, max_quarantine_share=1, alert_jump=1)
    GuardConfig(compute_trainer_logprobs=False, divergence_delta=1e-9)
    GuardConfig(evidence_samples_per_step=0)  # statistics only
    GuardConfig(joint_margin=0.0, joint_drift_weight=0.0)  # the joint part at its tightest
    GuardConfig(joint_margin=None)  # off


def test_equal_confident_and_doubtful_thresholds_are_rejected():
    with pytest.raises(GuardConfigError) as error:
        GuardConfig(confident_logprob=-1.0, doubtful_logprob=-1.0)
    assert error.value.field == "doubtful_logprob" and "confident_logprob=-1" in str(error.value)
