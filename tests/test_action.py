import math

import pytest
import torch

from rollout_guard.action import group_relative_advantages, loss_token_count, mask_quarantined, nanstd


def test_mask_quarantined_zeroes_rows_and_keeps_dtype():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.int32)
    out = mask_quarantined(mask, torch.tensor([False, True, False]))
    assert out.dtype == torch.int32
    assert out.tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0]]


def test_loss_token_count_drops_quarantined_rows():
    assert loss_token_count(torch.tensor([3.0, 5.0, 2.0]), torch.tensor([False, True, False])).item() == 5.0


def test_nanstd_is_bessel_corrected_and_nan_below_two_values():
    values = torch.tensor([[1.0, 2.0, 4.0, math.nan], [3.0, math.nan, math.nan, math.nan]])
    std = nanstd(values, dim=1)
    assert std[0].item() == pytest.approx(torch.tensor([1.0, 2.0, 4.0]).std().item())
    assert math.isnan(std[1].item())


def hand_advantages(rewards: list[float], group: int, excluded: set[int], eps: float = 1e-4) -> list[float]:
    """Reference: per group, baseline and Bessel std over the kept rewards only."""
    out = [0.0] * len(rewards)
    for start in range(0, len(rewards), group):
        kept = [i for i in range(start, start + group) if i not in excluded]
        if len(kept) < 2:
            continue
        values = [rewards[i] for i in kept]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        for i in kept:
            out[i] = (rewards[i] - mean) / (std + eps)
    return out


@pytest.mark.parametrize("excluded", [set(), {0}, {0, 5}, {4, 5, 6}, {0, 1, 2, 3}])
def test_group_advantages_leave_excluded_samples_out_of_the_baseline(excluded):
    rewards = [1.0, 0.0, 1.0, 0.5, 2.0, 0.0, 3.0, 1.0]
    mask = torch.tensor([i in excluded for i in range(len(rewards))])
    got = group_relative_advantages(torch.tensor(rewards).unsqueeze(1), torch.ones(1), group_size=4, excluded=mask)
    assert got.tolist() == pytest.approx(hand_advantages(rewards, 4, excluded), abs=1e-5)
    assert all(got[i].item() == 0.0 for i in excluded)


def test_unscorable_rows_behave_like_excluded_rows():
    rewards = torch.tensor([[1.0], [math.nan], [0.0], [1.0]])
    via_nan = group_relative_advantages(rewards, torch.ones(1), group_size=4)
    via_exclusion = group_relative_advantages(rewards.nan_to_num(7.0), torch.ones(1), group_size=4, excluded=torch.tensor([False, True, False, False]))
    assert torch.equal(via_nan, via_exclusion)


def test_weights_scale_none_and_batch():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    weights = torch.tensor([2.0, 1.0])
    total = torch.tensor([2.0, 1.0, 3.0, 0.0])
    none = group_relative_advantages(rewards, weights, group_size=2, scale_rewards="none")
    assert none.tolist() == pytest.approx([0.5, -0.5, 1.5, -1.5])
    batch = group_relative_advantages(rewards, weights, group_size=2, scale_rewards="batch")
    assert batch.tolist() == pytest.approx((torch.tensor([0.5, -0.5, 1.5, -1.5]) / (total.std() + 1e-4)).tolist(), rel=1e-5)


def test_normalize_then_sum_excludes_before_per_function_statistics():
    rewards = torch.tensor([[1.0, 5.0], [0.0, 1.0], [1.0, 3.0], [100.0, -100.0]])
    excluded = torch.tensor([False, False, False, True])
    got = group_relative_advantages(rewards, torch.ones(2), group_size=4, excluded=excluded, aggregation="normalize_then_sum")
    kept = rewards[:3]
    z = (kept - kept.mean(0)) / (kept.std(0) + 1e-4)
    summed = z.sum(1)
    expected = (summed - summed.mean()) / (summed.std() + 1e-4)
    assert got[:3].tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    assert got[3].item() == 0.0


def test_bad_modes_are_named():
    with pytest.raises(ValueError, match="scale_rewards"):
        group_relative_advantages(torch.ones(2, 1), torch.ones(1), 2, scale_rewards="grp")
    with pytest.raises(ValueError, match="aggregation"):
        group_relative_advantages(torch.ones(2, 1), torch.ones(1), 2, aggregation="sum")
