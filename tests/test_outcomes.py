"""The step's outcome metrics: TRL's own importance-sampling correction next to the verdict, and the rewards of the
suspect rows; in the run's totals, the console summary and the HTML report."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from rollout_guard.config import GuardConfig
from rollout_guard.outputs.console import ConsoleSink, summary_lines
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.guard import GuardTotals, RolloutGuard
from rollout_guard.outcomes import IS_MODES, is_correction_metrics, is_correction_rows, reward_metrics
from rollout_guard.outputs.report import build_report
from rollout_guard.outputs.sinks import LocalFilesSink


def trl_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16's importance-sampling ratio (GRPOTrainer._generate_and_score_completions), as it writes it."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    sequence = mode in ("sequence_mask", "sequence_truncate")
    ratio = torch.exp(diff.sum(dim=-1, keepdim=True) if sequence else diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return ratio, torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio, ratio.masked_fill((ratio < low) | (ratio > high), value=0.0)


@pytest.mark.parametrize("mode", IS_MODES)
@pytest.mark.parametrize(("clip_min", "clip_max"), [(None, 3.0), (0.5, 2.0), (0.2, None)])
def test_corrected_tokens_are_those_whose_ratio_trl_changes(mode, clip_min, clip_max):
    generator = torch.Generator().manual_seed(0)
    sampling = -3 * torch.rand(64, 12, generator=generator)
    old = sampling + 0.6 * torch.randn(64, 12, generator=generator)
    sampling[5, 3] = math.nan  # TRL counts a NaN engine logprob as a perfect match
    mask = (torch.arange(12) < torch.randint(1, 13, (64, 1), generator=generator)).long()
    raw, applied = trl_ratio(old, sampling, mask, mode, clip_min, clip_max)
    changed = (applied != raw).expand(64, 12) & mask.bool()
    rows = is_correction_rows(old, sampling, mask, mode, clip_min, clip_max)
    assert rows[:, 0].tolist() == changed.sum(dim=1).double().tolist()
    assert rows[:, 1].tolist() == mask.sum(dim=1).double().tolist()
    assert 0 < int(changed.any(dim=1).sum()) < 64, "the batch has corrected and untouched rows"


def test_an_unknown_mode_names_the_modes():
    with pytest.raises(ValueError, match="sequence_mask"):
        is_correction_rows(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), mode="sequence")


def test_the_overlap_splits_rows_into_both_only_trl_and_only_the_guard():
    rows = torch.tensor([[3.0, 3.0], [0.0, 2.0], [1.0, 4.0], [0.0, 5.0], [2.0, 2.0]])
    suspect = torch.tensor([True, True, False, False, True])
    metrics = is_correction_metrics(rows, suspect)
    assert metrics["trl_is/corrected_rows"] == 3 and metrics["trl_is/corrected_row_share"] == 0.6
    assert (metrics["trl_is/both"], metrics["trl_is/only_trl"], metrics["trl_is/only_guard"]) == (2, 1, 1)
    assert metrics["trl_is/corrected_tokens"] == 6 and metrics["trl_is/corrected_token_share"] == 6 / 16


def test_reward_metrics_compare_suspect_rows_with_the_others_and_their_group_median():
    # groups of 4; group 0's median is 0.5 (even size: the mean of the middle two), group 1's 0.25
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.5, 1.0])
    suspect = torch.tensor([True, True, False, False, False, False, True, False])
    metrics = reward_metrics(rewards, 4, suspect)
    assert metrics["reward/suspect_mean"] == pytest.approx(0.5)  # 1.0, 0.0, 0.5
    assert metrics["reward/not_suspect_mean"] == pytest.approx(2.0 / 5)
    assert metrics["reward/suspect_above_group_median"] == pytest.approx(2 / 3)  # 1.0 > 0.5 and 0.5 > 0.25
    none = reward_metrics(rewards, 4, torch.zeros(8, dtype=torch.bool))
    assert math.isnan(none["reward/suspect_mean"]) and math.isnan(none["reward/suspect_above_group_median"])
    with pytest.raises(ValueError, match="whole groups"):
        reward_metrics(rewards, 3, suspect)


def _guarded_run(directory):
    """Two steps of a guard with local files, each step's outcome metrics added as the TRL adapter adds them."""
    config = GuardConfig()
    guard = RolloutGuard(config)
    sinks = [LocalFilesSink(directory, config), ConsoleSink(directory)]
    for step in (1, 2):
        engine = torch.full((8, 4), -0.1)
        trainer = engine.clone()
        trainer[1] = -12.0  # row 1 suspect
        report = guard.inspect(RolloutEvidence(torch.ones(8, 4, dtype=torch.long), engine, trainer), step=step)
        rows = torch.tensor([[4.0, 4.0], [4.0, 4.0]] + [[0.0, 4.0]] * 5 + [[4.0, 4.0]])  # rows 0, 1, 7 corrected
        report.metrics.update(is_correction_metrics(rows, report.suspect))
        report.metrics.update(reward_metrics(torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), 4, report.suspect))
        guard.totals.add_outcomes(report.metrics)
        for sink in sinks:
            sink.on_step(report, guard)
    return guard, sinks


def test_the_console_summary_and_the_report_show_trls_correction_and_the_rewards(tmp_path, caplog):
    guard, sinks = _guarded_run(tmp_path)
    lines = "\n".join(summary_lines(guard))
    assert "TRL's importance-sampling correction zeroed or clipped 6 of 16 rollouts (37.50%)" in lines
    assert "both it and the guard: 2, only TRL: 4, only the guard: 0" in lines
    assert "reward: suspect rollouts 1 on average, the others 0.571; 100% of the suspect ones above" in lines
    with caplog.at_level(logging.INFO, logger="rollout_guard"):
        for sink in sinks:
            sink.on_end(guard)
    assert "only the guard: 0" in caplog.text
    page = build_report(tmp_path).read_text()
    assert "own correction and the rewards of suspect rollouts</h2>" in page
    assert "zeroed or clipped 6 of 16 rollouts" in page and "<th>reward/suspect_above_group_median</th>" in page


def test_outcome_totals_survive_a_checkpoint():
    totals = GuardTotals()
    totals.add_outcomes({"trl_is/rows": 8.0, "trl_is/both": 1.0, "suspect": 2.0, "samples": 8.0,
                         "reward/suspect_mean": 0.5, "reward/not_suspect_mean": 0.25,
                         "reward/suspect_above_group_median": 0.5})
    restored = GuardTotals.from_dict(totals.to_dict())
    assert restored.outcomes == totals.outcomes and restored.outcomes["reward/suspect_sum"] == 1.0
    assert GuardTotals.from_dict({}).outcomes == {}
