import math

import torch

from rollout_guard.config import GuardConfig
from rollout_guard.statistics import COLUMN, SAMPLE_COLUMNS
from rollout_guard.verdict import RULE_BIT, RULES, judge, rule_counts, rule_names


def rows(*overrides: dict) -> torch.Tensor:
    base = {name: 0.0 for name in SAMPLE_COLUMNS}
    base.update(tokens=10, compared_tokens=10, max_abs_delta=1e-3, mean_abs_delta=1e-4, first_divergent_token=-1,
                spike_margin=-5.0)  # its rarest token 5 nats under that token's spike threshold
    table = torch.zeros(len(overrides), len(SAMPLE_COLUMNS))
    for i, override in enumerate(overrides):
        for name, value in {**base, **override}.items():
            table[i, COLUMN[name]] = value
    return table


CONFIG = GuardConfig(spike_delta=8.0, mean_delta=1.0)


def test_each_rule_fires_alone_on_its_evidence():
    samples = rows(
        {},
        {"max_abs_delta": 9.0},
        {"mean_abs_delta": 1.5},
        {"confident_wrong_tokens": 2},
        {"nonfinite_engine_tokens": 1},
        {"nonfinite_trainer_tokens": 3},
        {"spike_margin": 0.01},
        {"drift_cusum": 6.01},
    )
    verdict = judge(samples, CONFIG)
    assert verdict.suspect.tolist() == [False, True, True, True, True, True, True, True]
    assert [rule_names(int(r)) for r in verdict.reasons] == [
        [], ["token_spike"], ["mean_drift"], ["confident_wrong"], ["nonfinite_engine"], ["nonfinite_trainer"],
        ["directional_spike"], ["drift"],
    ]


def test_thresholds_are_strict_or_inclusive_as_documented():
    samples = rows({"max_abs_delta": 8.0}, {"mean_abs_delta": 1.0}, {"confident_wrong_tokens": 1}, {"spike_margin": 0.0},
                   {"drift_cusum": 6.0})
    assert judge(samples, CONFIG).suspect.tolist() == [False] * 5


def test_drift_fires_on_two_near_misses_together_and_not_just_below():
    """The drift rule's joint part: spike margin + 0.25 · (CUSUM − threshold) > −0.4. A worst token 0.2 nats under
    its threshold with a CUSUM 0.8 under the drift threshold sums to exactly −0.4 (does not fire); 0.79 under fires.
    Either one alone as near, the other far, does not; a NaN margin (no token that can fire) never does."""
    assert (CONFIG.joint_margin, CONFIG.joint_drift_weight) == (0.4, 0.25)
    samples = rows({"spike_margin": -0.2, "drift_cusum": 5.2}, {"spike_margin": -0.2, "drift_cusum": 5.21},
                   {"spike_margin": -0.01, "drift_cusum": 0.0}, {"spike_margin": -3.0, "drift_cusum": 5.99},
                   {"spike_margin": math.nan, "drift_cusum": 5.99})
    verdict = judge(samples, CONFIG)
    assert verdict.suspect.tolist() == [False, True, False, False, False]
    assert rule_names(int(verdict.reasons[1])) == ["drift"]
    # with the calibrated drift threshold in use (one per sample) instead of the fixed one
    in_use = torch.tensor([5.3, 5.3, 5.3, 6.0, 6.0])
    assert judge(samples, CONFIG, in_use).suspect.tolist() == [True, True, False, False, False]
    assert not judge(samples, GuardConfig(spike_delta=8.0, mean_delta=1.0, joint_margin=None)).suspect.any()
    assert not judge(samples, GuardConfig(spike_delta=8.0, mean_delta=1.0, spike_excess=None)).suspect.any()


def test_defaults_are_ceilings_above_healthy_heavy_tails():
    """Release 0.1 flagged an 8.5-nat token and a 1.5-nat mean; healthy 7B runs reach 10–18 nats per step and a
    top_k=5 high-entropy policy ≈ 1.5 nats per token: the default ceilings let those pass."""
    samples = rows({"max_abs_delta": 18.0}, {"mean_abs_delta": 2.49}, {"max_abs_delta": 25.01}, {"mean_abs_delta": 2.51})
    assert judge(samples, GuardConfig()).suspect.tolist() == [False, False, True, True]


def test_nan_statistics_never_fire():
    samples = rows({"max_abs_delta": math.nan, "mean_abs_delta": math.nan, "compared_tokens": 0, "spike_margin": math.nan,
                    "drift_cusum": math.nan})
    assert not judge(samples, CONFIG).suspect.any()


def test_disabled_rules_do_not_fire():
    config = GuardConfig(spike_delta=None, mean_delta=None, confident_wrong_tokens=None,
                         nonfinite_engine_tokens=None, nonfinite_trainer_tokens=None, spike_excess=None, drift_threshold=None)
    samples = rows({"max_abs_delta": 50.0, "mean_abs_delta": 50.0, "confident_wrong_tokens": 9, "nonfinite_engine_tokens": 4,
                    "spike_margin": 9.0, "drift_cusum": 90.0})
    assert not judge(samples, config).suspect.any()


def test_several_rules_and_counts():
    samples = rows({"max_abs_delta": 12.0, "mean_abs_delta": 7.0, "confident_wrong_tokens": 5}, {"max_abs_delta": 12.0})
    verdict = judge(samples, CONFIG)
    assert rule_names(int(verdict.reasons[0])) == ["token_spike", "mean_drift", "confident_wrong"]
    counts = rule_counts(verdict.reasons)
    assert counts == {"nonfinite_engine": 0, "nonfinite_trainer": 0, "token_spike": 2, "mean_drift": 1, "confident_wrong": 1,
                      "directional_spike": 0, "drift": 0, "changepoint": 0}
    assert sorted(RULE_BIT.values()) == [1 << i for i in range(len(RULES))]
