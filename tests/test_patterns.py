"""classify_pattern on constructed per-token |Δ| arrays, including the borderline cases of each rule."""

from __future__ import annotations

import doctest
import math

import pytest
import torch

import rollout_guard.patterns as patterns
from rollout_guard.patterns import abs_delta, classify_pattern

LOW = 0.05  # clean bf16 noise
HIGH = 6.0


def profile(length: int, high_at: list[int] | range, high: float = HIGH, low: float = LOW) -> torch.Tensor:
    values = torch.full((length,), low)
    values[list(high_at)] = high
    return values


def test_docstring_examples():
    assert doctest.testmod(patterns).failed == 0


@pytest.mark.parametrize(
    ("delta", "expected"),
    [
        (profile(16, range(16)), "divergent_from_start"),
        (profile(16, range(1, 16)), "divergent_from_start"),  # the first token happened to agree
        (profile(16, range(3, 16)), "divergent_from_start"),  # onset 3 < 0.2 * 16
        (profile(16, range(4, 16)), "late_onset"),  # onset 4 = 0.2 * 16: late
        (profile(40, range(34, 40)), "late_onset"),  # last 15 %
        (profile(20, [17, 18, 19]), "late_onset"),  # a run of 3 to the end
        (profile(20, [19]), "isolated_spikes"),  # one token at the end is a spike, not an onset
        (profile(20, [5]), "isolated_spikes"),
        (profile(20, [2, 9, 15]), "isolated_spikes"),
        (profile(40, [3, 9, 15, 21, 30]), "isolated_spikes"),  # more than 3, but 5 of 37 tail tokens
        (profile(12, []), "not_reproducible"),
        (torch.zeros(0), "not_reproducible"),
        (profile(1, [0]), "divergent_from_start"),
        (profile(4, [0, 1, 2]), "divergent_from_start"),  # a short stale-state sample whose EOS agrees (seen on vLLM)
        (profile(4, [0, 2]), "isolated_spikes"),  # two isolated tokens, though half of the sample
        (profile(20, [5, 6]), "isolated_spikes"),  # a pair, but 2 of 15 tail tokens
        (profile(20, [18, 19]), "late_onset"),  # a pair at the end reads as an onset
    ],
)
def test_shapes(delta, expected):
    assert classify_pattern(delta).name == expected


def test_threshold_is_strict():
    assert classify_pattern(torch.full((8,), 1.0)).name == "not_reproducible"
    assert classify_pattern(torch.full((8,), 1.0001)).name == "divergent_from_start"
    assert classify_pattern(torch.full((8,), 1.0), token_threshold=0.5).name == "divergent_from_start"


def test_persistence_borderline():
    # onset 0, 16 tokens: 8 high (= 0.5 of the tail) is persistent, 7 is not
    eight = profile(16, [0, 2, 4, 6, 8, 10, 12, 14])
    seven = profile(16, [0, 2, 4, 6, 8, 10, 12])
    assert classify_pattern(eight).name == "divergent_from_start"
    assert classify_pattern(seven).name == "isolated_spikes"


def test_spike_count_borderline():
    # a run to the end of exactly spike_max_tokens + 1 tokens: persistent either way; 4 spread tokens: spikes
    assert classify_pattern(profile(30, [26, 27, 28, 29])).name == "late_onset"
    assert classify_pattern(profile(30, [10, 15, 20, 25])).name == "isolated_spikes"
    assert classify_pattern(profile(30, [10, 15, 20, 25]), spike_max_tokens=1, persistence=0.2).name == "late_onset"


def test_fresh_engine_separates_weights_from_state():
    every = torch.full((12,), 2.5)
    assert classify_pattern(every, fresh=torch.full((12,), 2.4)).name == "every_token"
    assert classify_pattern(every, fresh=torch.full((12,), LOW)).name == "divergent_from_start"
    assert classify_pattern(every).name == "divergent_from_start"
    # reproduced from the start, with a token that agrees: still weights or dtype; reproduced late: late onset
    most = profile(12, [0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    assert classify_pattern(most, fresh=most.clone()).name == "every_token"
    late = profile(12, range(6, 12))
    assert classify_pattern(late, fresh=late.clone()).name == "late_onset"
    # reproduces on exactly half of the high tokens counts as reproducing
    half = torch.full((12,), LOW)
    half[:6] = HIGH
    result = classify_pattern(every, fresh=half)
    assert result.fresh_engine_reproduces is True and result.name == "every_token"
    less = half.clone()
    less[5] = LOW
    assert classify_pattern(every, fresh=less).fresh_engine_reproduces is False


def test_nonfinite_engine_logprobs_count_as_high():
    engine = torch.tensor([-0.1, float("nan"), -0.2, -0.1])
    trainer = torch.tensor([-0.1, -0.3, -0.2, -0.1])
    delta = abs_delta(engine, trainer)
    assert math.isinf(delta[1]) and delta[0] == 0
    result = classify_pattern(delta)
    assert result.name == "isolated_spikes" and result.onset == 1 and math.isinf(result.max_abs_delta)
    assert classify_pattern(torch.tensor([float("nan")] * 3)).name == "divergent_from_start"


def test_line_names_pattern_and_cause():
    line = classify_pattern(profile(40, range(34, 40))).line()
    assert line.startswith("pattern: late onset (token 34 of 40, 6 high tokens") and "drift" in line
    assert "not reproducible" in classify_pattern(profile(5, [])).line()


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="replayed"):
        classify_pattern(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="fresh"):
        classify_pattern(torch.zeros(3), fresh=torch.zeros(4))
