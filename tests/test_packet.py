"""The step's aggregates give the same per-step metrics as reducing the whole sample table row by row."""

from __future__ import annotations

import math

import pytest
import torch

from rollout_guard import GuardConfig, RolloutEvidence, RolloutGuard
from rollout_guard.packet import aggregate, step_metrics
from rollout_guard.statistics import COLUMN, NUM_DELTA_BINS, SAMPLE_COLUMNS, histogram_quantile
from rollout_guard.verdict import RULE_BIT, RULES


def step_aggregates(samples: torch.Tensor, histogram: torch.Tensor) -> dict[str, float]:
    """The per-step numbers reduced from the whole table (the reference the packet's aggregates must equal)."""
    table = samples.double()

    def column(name: str) -> torch.Tensor:
        return table[:, COLUMN[name]]

    def maximum(name: str) -> float:
        values = column(name)[~torch.isnan(column(name))]
        return float(values.max()) if values.numel() else math.nan

    def mean(name: str, weight: torch.Tensor) -> float:
        keep = ~torch.isnan(column(name)) & (weight > 0)
        return float((column(name) * weight)[keep].sum() / weight[keep].sum()) if keep.any() else math.nan

    compared = column("compared_tokens")
    metrics = {name: float(column(name).sum()) for name in
               ("tokens", "compared_tokens", "nonfinite_engine_tokens", "nonfinite_trainer_tokens")}
    metrics.update({name: maximum(name) for name in ("max_abs_delta", "engine_max_logprob", "trainer_max_logprob")})
    metrics["max_score"] = maximum("score")
    metrics["mean_abs_delta"] = mean("mean_abs_delta", compared)
    metrics["kl_k3"] = mean("kl_k3", compared)
    metrics["engine_mean_logprob"] = mean("engine_mean_logprob", column("tokens") - column("nonfinite_engine_tokens"))
    metrics["trainer_mean_logprob"] = mean("trainer_mean_logprob",
                                           column("tokens") - column("nonfinite_trainer_tokens"))
    metrics["p99_abs_delta"] = min(histogram_quantile(histogram, 0.99), metrics["max_abs_delta"])
    return metrics


def random_table(rows: int, seed: int, labelled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    samples = torch.rand(rows, len(SAMPLE_COLUMNS), generator=generator, dtype=torch.float64) * 10
    for name in ("tokens", "compared_tokens", "nonfinite_engine_tokens", "nonfinite_trainer_tokens"):
        samples[:, COLUMN[name]] = torch.randint(0, 50, (rows,), generator=generator).double()
    samples[:, COLUMN["engine_max_logprob"]] *= -1
    nan = torch.rand(rows, len(SAMPLE_COLUMNS), generator=generator) < 0.2  # statistics with no token to stand on
    samples[nan] = math.nan
    samples[:, COLUMN["injected"]] = (torch.rand(rows, generator=generator) < 0.3).double() if labelled else math.nan
    reasons = torch.randint(0, 1 << len(RULES), (rows,), generator=generator, dtype=torch.int32)
    reasons[torch.rand(rows, generator=generator) < 0.6] = 0
    return samples, reasons


@pytest.mark.parametrize("labelled", [False, True])
@pytest.mark.parametrize("quarantines", [False, True])
def test_aggregates_match_the_table(labelled, quarantines):
    samples, reasons = random_table(40, seed=3, labelled=labelled)
    histogram = torch.zeros(NUM_DELTA_BINS, dtype=torch.int64)
    histogram[30] = 7
    metrics = step_metrics(aggregate(samples, reasons), 40, histogram, quarantines)
    expected = step_aggregates(samples, histogram)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-12, nan_ok=True), key
    suspect = reasons != 0
    assert metrics["suspect"] == float(suspect.sum())
    assert metrics["quarantined"] == (float(suspect.sum()) if quarantines else 0.0)
    for name in RULES:
        assert metrics[f"rule/{name}"] == float(((reasons & RULE_BIT[name]) != 0).sum()), name
    kept = samples[:, COLUMN["max_abs_delta"]][~suspect] if quarantines else samples[:, COLUMN["max_abs_delta"]]
    assert metrics["kept_max_abs_delta"] == float(kept[~torch.isnan(kept)].max())
    if labelled:
        injected = samples[:, COLUMN["injected"]] == 1
        assert (metrics["caught"], metrics["missed"], metrics["false_alarms"]) == (
            float((injected & suspect).sum()), float((injected & ~suspect).sum()), float((~injected & suspect).sum()))
    else:
        assert "caught" not in metrics and math.isnan(metrics["injected"])


def test_an_empty_table_has_no_maxima_and_zero_sums():
    empty = aggregate(torch.zeros(0, len(SAMPLE_COLUMNS), dtype=torch.float64), torch.zeros(0, dtype=torch.int32))
    assert math.isnan(empty["max_abs_delta"]) and math.isnan(empty["kept_max_score"])
    assert empty["tokens"] == empty["suspect"] == empty["mean_abs_delta_den"] == 0.0


def test_guard_metrics_equal_the_table_reduction():
    """End to end through RolloutGuard.inspect: the metrics it logs equal step_aggregates over its report."""
    generator = torch.Generator().manual_seed(5)
    engine = -torch.rand(12, 30, generator=generator) * 3
    trainer = engine + 0.1 * torch.randn(12, 30, generator=generator)
    trainer[2, 5:] -= 8.0
    engine[4, 3] = math.nan
    mask = (torch.arange(30).unsqueeze(0) < torch.randint(0, 31, (12, 1), generator=generator)).long()
    report = RolloutGuard(GuardConfig()).inspect(RolloutEvidence(mask=mask, engine_logprobs=engine, trainer_logprobs=trainer), step=1)
    for key, value in step_aggregates(report.samples, report.delta_histogram).items():
        assert report.metrics[key] == pytest.approx(value, rel=1e-9, nan_ok=True), key
    assert report.metrics["suspect"] == float(report.suspect.sum()) >= 1
