import pytest
import torch

from rollout_guard.injection import choose_rows, foreign_context, plan_injection


def test_rows_follow_the_rate_and_the_seed():
    first = choose_rows(10_000, 0.1, torch.Generator().manual_seed(3))
    second = choose_rows(10_000, 0.1, torch.Generator().manual_seed(3))
    assert torch.equal(first, second)
    assert 0.08 < first.float().mean().item() < 0.12
    assert not choose_rows(50, 0.0, torch.Generator()).any() and choose_rows(50, 1.0, torch.Generator()).all()
    with pytest.raises(ValueError, match="rate"):
        choose_rows(3, 1.5, torch.Generator())


def test_foreign_context_comes_from_another_group_or_is_reversed():
    prompts = [[1, 2], [1, 2], [3, 4, 5], [3, 4, 5]]
    assert foreign_context(prompts, 0, group_size=2) == [3, 4, 5]
    assert foreign_context(prompts, 3, group_size=2) == [1, 2]
    assert foreign_context([[1, 2, 3], [1, 2, 3]], 1, group_size=2) == [3, 2, 1]


def test_plan_replaces_only_selected_rows():
    prompts = [[1], [2], [3], [4]]
    plan = plan_injection(prompts, torch.tensor([False, True, False, False]), group_size=2)
    assert plan.contexts == [[1], [4], [3], [4]]
    assert plan.selected.tolist() == [False, True, False, False]
