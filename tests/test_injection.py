import pytest
import torch

from rollout_guard.injection import ContextPool, choose_rows, foreign_context, plan_injection


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
    assert foreign_context([[1, 2], [1, 2]], 1, group_size=2) == [2, 1]  # too short to shuffle a body


def test_a_single_group_batch_takes_a_real_prompt_from_an_earlier_step():
    """TRL's defaults make a generation batch one group: the foreign context must still be another real prompt
    (a reversed prompt would make the copy model answer with a lone EOS)."""
    pool = ContextPool(seed=0)
    first = plan_injection([[5, 6, 7, 8, 9, 0]] * 4, torch.tensor([True, False, False, False]), group_size=4, pool=pool)
    body = first.contexts[0]
    assert body != [5, 6, 7, 8, 9, 0] and body[-1] == 0 and sorted(body[:-1]) == [5, 6, 7, 8, 9]
    second = plan_injection([[1, 2, 3]] * 4, torch.tensor([False, True, False, True]), group_size=4, pool=pool)
    assert second.contexts == [[1, 2, 3], [5, 6, 7, 8, 9, 0], [1, 2, 3], [5, 6, 7, 8, 9, 0]]
    assert pool.prompts == [(5, 6, 7, 8, 9, 0), (1, 2, 3)]


def test_plan_replaces_only_selected_rows():
    prompts = [[1], [2], [3], [4]]
    plan = plan_injection(prompts, torch.tensor([False, True, False, False]), group_size=2)
    assert plan.contexts == [[1], [4], [3], [4]]
    assert plan.selected.tolist() == [False, True, False, False]
