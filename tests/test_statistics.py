import math

import pytest
import torch

from rollout_guard import RolloutGuard
from rollout_guard.detector import Detector
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.statistics import COLUMN, DELTA_BIN_EDGES, NUM_DELTA_BINS, histogram_quantile, summarise

NAN = float("nan")


def summarised(evidence: RolloutEvidence) -> tuple[torch.Tensor, torch.Tensor]:
    judgement = Detector().judge(evidence.engine_logprobs, evidence.trainer_logprobs, evidence.mask)
    return summarise(evidence, judgement)


def sample_statistics(evidence: RolloutEvidence) -> torch.Tensor:
    return summarised(evidence)[0]


def delta_histogram(evidence: RolloutEvidence) -> torch.Tensor:
    return summarised(evidence)[1]


def hand_case() -> RolloutEvidence:
    # Row 0: clean except one 2-nat disagreement; its pad (engine 0.0, trainer -5.0) must never count.
    # Row 1: the AI21 signature on token 0 (engine confident, trainer -6), a NaN engine logprob on token 2.
    engine = torch.tensor([[-0.1, -0.2, -0.3, 0.0], [-0.01, -0.02, NAN, 0.0]])
    trainer = torch.tensor([[-0.1, -2.2, -0.3, -5.0], [-6.0, -0.02, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    return RolloutEvidence(mask=mask, engine_logprobs=engine, trainer_logprobs=trainer)


def col(stats: torch.Tensor, name: str) -> list[float]:
    return stats[:, COLUMN[name]].tolist()


def test_hand_computed_rows():
    stats = sample_statistics(hand_case())
    assert col(stats, "tokens") == [3, 3]
    assert col(stats, "compared_tokens") == [3, 2]
    assert col(stats, "max_abs_delta") == pytest.approx([2.0, 5.99], abs=1e-5)
    assert col(stats, "mean_abs_delta") == pytest.approx([2.0 / 3, 5.99 / 2], abs=1e-5)
    assert col(stats, "seq_log_ratio") == pytest.approx([-2.0, -5.99], abs=1e-5)
    # k3 = (r - 1) - log r with log r = trainer - engine
    k3 = lambda lr: math.expm1(lr) - lr  # noqa: E731
    assert col(stats, "kl_k3") == pytest.approx([k3(-2.0) / 3, k3(-5.99) / 2], rel=1e-5)
    assert col(stats, "engine_max_logprob") == pytest.approx([-0.1, -0.01])  # the pad's 0.0 is not a max
    assert col(stats, "engine_mean_logprob") == pytest.approx([-0.2, -0.015])
    assert col(stats, "trainer_max_logprob") == pytest.approx([-0.1, -0.02])
    assert col(stats, "trainer_mean_logprob") == pytest.approx([-2.6 / 3, -7.02 / 3])
    # where the disagreement starts: row 0's 2-nat trainer-favouring token, row 1's 6-nat engine-favouring one
    assert col(stats, "onset_token") == [1, 0]
    assert col(stats, "onset_engine_logprob") == pytest.approx([-0.2, -0.01])
    assert col(stats, "onset_trainer_logprob") == pytest.approx([-2.2, -6.0])
    assert col(stats, "noise_scale") == pytest.approx([0.25, 0.25], abs=0.01)  # about the prior: 5 tokens read
    score = col(stats, "score")
    assert score[1] > math.log(1000) > score[0]  # the engine-favouring 6 nats over the threshold, not the other
    assert col(stats, "nonfinite_engine_tokens") == [0, 1]
    assert col(stats, "nonfinite_trainer_tokens") == [0, 0]
    assert all(math.isnan(v) for v in col(stats, "injected"))


def test_padding_only_row_is_nan_not_zero():
    evidence = RolloutEvidence(
        mask=torch.tensor([[0, 0], [1, 0]]),
        engine_logprobs=torch.tensor([[0.0, 0.0], [-0.5, 0.0]]),
        trainer_logprobs=torch.tensor([[0.0, 0.0], [-0.5, 0.0]]),
    )
    stats = sample_statistics(evidence)
    assert col(stats, "tokens") == [0, 1]
    for name in ("max_abs_delta", "mean_abs_delta", "seq_log_ratio", "kl_k3", "engine_max_logprob", "engine_mean_logprob"):
        assert math.isnan(col(stats, name)[0]), name
    assert col(stats, "engine_max_logprob")[1] == pytest.approx(-0.5)
    assert col(stats, "onset_token")[0] == -1 and math.isnan(col(stats, "score")[0])
    assert col(stats, "onset_token")[1] == 0


def test_missing_engine_gives_confidence_only():
    evidence = RolloutEvidence(mask=torch.ones(1, 3, dtype=torch.long),
                               trainer_logprobs=torch.tensor([[-0.1, -0.4, float("inf")]]))
    stats = sample_statistics(evidence)
    assert math.isnan(col(stats, "max_abs_delta")[0]) and math.isnan(col(stats, "engine_max_logprob")[0])
    assert col(stats, "trainer_max_logprob") == pytest.approx([-0.1])
    assert col(stats, "nonfinite_trainer_tokens") == [1]
    assert col(stats, "nonfinite_engine_tokens") == [0]
    assert math.isnan(col(stats, "score")[0]) and col(stats, "onset_token") == [-1]


def test_injected_labels_pass_through():
    evidence = hand_case()
    labelled = RolloutEvidence(evidence.mask, evidence.engine_logprobs, evidence.trainer_logprobs, injected=torch.tensor([True, False]))
    assert col(sample_statistics(labelled), "injected") == [1.0, 0.0]


def test_histogram_counts_compared_tokens_in_the_right_bins():
    counts = delta_histogram(hand_case())
    assert counts.shape == (NUM_DELTA_BINS,)
    assert counts.sum().item() == 5  # 3 + 2 compared tokens; pads and the NaN token excluded
    zero_bin = 0  # [0, 1e-6)
    assert counts[zero_bin].item() == 3  # exact agreements
    for value in (2.0, 5.99):
        index = int(torch.searchsorted(DELTA_BIN_EDGES, torch.tensor(value, dtype=torch.float64), right=True)) - 1
        assert counts[index].item() == 1
        assert DELTA_BIN_EDGES[index] <= value < DELTA_BIN_EDGES[index + 1]


def test_histogram_quantile_is_within_a_bin_of_the_truth():
    values = torch.logspace(-5, 1, 1000)
    evidence = RolloutEvidence(
        mask=torch.ones(1, 1000, dtype=torch.long), engine_logprobs=torch.zeros(1, 1000), trainer_logprobs=-values.unsqueeze(0)
    )
    estimate = histogram_quantile(delta_histogram(evidence), 0.99)
    truth = torch.quantile(values.double(), 0.99).item()
    assert truth / 1.34 <= estimate <= truth * 1.34
    assert math.isnan(histogram_quantile(torch.zeros(NUM_DELTA_BINS), 0.99))


def test_step_metrics_weight_by_tokens_and_skip_nan():
    metrics = RolloutGuard().inspect(hand_case(), step=0).metrics
    assert metrics["tokens"] == 6 and metrics["compared_tokens"] == 5
    assert metrics["max_abs_delta"] == pytest.approx(5.99, abs=1e-5)
    assert metrics["mean_abs_delta"] == pytest.approx((2.0 + 5.99) / 5, abs=1e-5)
    assert metrics["p99_abs_delta"] <= metrics["max_abs_delta"]
    assert metrics["engine_max_logprob"] == pytest.approx(-0.01)
    assert metrics["engine_mean_logprob"] == pytest.approx((-0.6 - 0.03) / 5)
    assert metrics["nonfinite_engine_tokens"] == 1
    assert metrics["max_score"] > math.log(1000)
    assert math.isnan(metrics["injected"])
