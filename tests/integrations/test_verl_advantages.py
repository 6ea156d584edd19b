"""The verl adapter's batch functions against real verl (``make test-verl``): rows left out get no vote in any group
baseline, for the group estimators verl ships, checked against hand-computed references and against verl run on a
batch built without those rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed here: `make test-verl` runs these tests")

from verl import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo.core_algos import AdvantageEstimator  # noqa: E402
from verl.trainer.ppo.ray_trainer import compute_advantage  # noqa: E402

from rollout_guard.errors import GuardInputError  # noqa: E402
from rollout_guard.integrations.verl import (advantages_without, evidence_of, neutral_rows,  # noqa: E402
                                             rejected_whole, trajectory_of, thin_groups, widen_to_trajectories)
from rollout_guard.integrations.verl.trainer import MIN_KEPT  # noqa: E402

GROUP = 4
EPSILON = 1e-6  # verl's GRPO epsilon


def make_batch(scores: list[float], lengths: list[int], width: int = 6) -> DataProto:
    """A padded verl batch as ``_compute_advantage`` sees it: groups of GROUP consecutive rows share a uid, each row's
    outcome reward sits on its last response token."""
    rows = len(scores)
    mask = torch.zeros(rows, width)
    rewards = torch.zeros(rows, width)
    for row, (score, length) in enumerate(zip(scores, lengths, strict=True)):
        mask[row, :length] = 1
        rewards[row, length - 1] = score
    uid = np.array([f"prompt{row // GROUP}" for row in range(rows)], dtype=object)
    return DataProto.from_dict(tensors={"response_mask": mask, "token_level_rewards": rewards},
                               non_tensors={"uid": uid})


def verl_advantages(estimator: str, norm: bool = True):
    config = AlgoConfig(adv_estimator=estimator, norm_adv_by_std_in_grpo=norm)

    def compute(data: DataProto, kept: torch.Tensor) -> DataProto:
        return compute_advantage(data, adv_estimator=estimator, num_repeat=GROUP, norm_adv_by_std_in_grpo=norm,
                                 config=config)

    return compute


SCORES = [1.0, 0.0, 100.0, 0.5, 0.2, 0.9, 0.4, -3.0, 1.0, 1.0, 0.0, 7.0]
LENGTHS = [3, 6, 2, 4, 5, 1, 6, 3, 2, 2, 4, 6]
EXCLUDED = torch.tensor([False, False, True, False, False, True, True, True, False, False, False, True])


def kept_groups() -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for row in range(len(SCORES)):
        if not EXCLUDED[row]:
            groups.setdefault(row // GROUP, []).append(row)
    return groups


def hand_grpo(norm: bool) -> torch.Tensor:
    """GRPO on the kept rows only: (score − group mean) / (group std + ε); a group of one: mean 0, std 1 (verl's
    convention); excluded rows 0."""
    out = torch.zeros(len(SCORES))
    for rows in kept_groups().values():
        values = torch.tensor([SCORES[row] for row in rows])
        mean, std = (values.mean(), values.std()) if len(rows) > 1 else (torch.tensor(0.0), torch.tensor(1.0))
        for row, value in zip(rows, values, strict=True):
            out[row] = (value - mean) / (std + EPSILON) if norm else value - mean
    return out


def hand_rloo() -> torch.Tensor:
    """RLOO on the kept rows only: score − mean of the group's other kept rows (a group of one: the score)."""
    out = torch.zeros(len(SCORES))
    for rows in kept_groups().values():
        for row in rows:
            others = [SCORES[other] for other in rows if other != row]
            out[row] = SCORES[row] - (sum(others) / len(others) if others else 0.0)
    return out


def per_row(data: DataProto) -> torch.Tensor:
    """Each row's advantage at its first token (outcome estimators give one value per row)."""
    return data.batch["advantages"][:, 0]


@pytest.mark.parametrize("norm", [True, False], ids=["grpo", "grpo_without_std"])
def test_grpo_advantages_leave_the_excluded_rows_out_of_their_group_baseline(norm):
    data = advantages_without(make_batch(SCORES, LENGTHS), EXCLUDED, verl_advantages(AdvantageEstimator.GRPO, norm))
    torch.testing.assert_close(per_row(data), hand_grpo(norm), rtol=1e-5, atol=1e-5)


def test_rloo_advantages_leave_the_excluded_rows_out_of_the_leave_one_out_mean():
    data = advantages_without(make_batch(SCORES, LENGTHS), EXCLUDED, verl_advantages(AdvantageEstimator.RLOO))
    torch.testing.assert_close(per_row(data), hand_rloo(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("estimator", [AdvantageEstimator.GRPO, AdvantageEstimator.RLOO,
                                       AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE, AdvantageEstimator.GPG,
                                       AdvantageEstimator.OPO, AdvantageEstimator.GRPO_PASSK,
                                       AdvantageEstimator.GRPO_VECTORIZED, AdvantageEstimator.RLOO_VECTORIZED,
                                       AdvantageEstimator.REINFORCE_PLUS_PLUS])
def test_every_estimator_gives_kept_rows_what_verl_gives_a_batch_without_the_excluded_rows(estimator):
    compute = verl_advantages(estimator)
    excluded = thin_groups(EXCLUDED, [f"prompt{row // GROUP}" for row in range(len(SCORES))],
                           MIN_KEPT.get(estimator.value, 1))
    guarded = advantages_without(make_batch(SCORES, LENGTHS), excluded, compute)
    kept = [row for row in range(len(SCORES)) if not excluded[row]]
    alone = make_batch([SCORES[row] for row in kept], [LENGTHS[row] for row in kept])
    alone.non_tensor_batch["uid"] = np.array([f"prompt{row // GROUP}" for row in kept], dtype=object)
    reference = compute(alone, torch.arange(len(kept)))
    for key in ("advantages", "returns"):
        torch.testing.assert_close(guarded.batch[key][kept], reference.batch[key], rtol=1e-5, atol=1e-5)
        assert not guarded.batch[key][excluded].any(), key
    assert not guarded.batch["response_mask"][excluded].any()
    torch.testing.assert_close(guarded.batch["response_mask"][kept], alone.batch["response_mask"])


def test_a_rejected_sibling_with_a_large_reward_moves_verls_own_advantages_but_not_the_guarded_ones():
    scores, lengths = [1.0, 0.0, 100.0, 1.0], [2, 2, 2, 2]
    rejected = torch.tensor([False, False, True, False])
    compute = verl_advantages(AdvantageEstimator.GRPO)
    plain = make_batch(scores, lengths)
    plain.batch["response_mask"][rejected] = 0  # what verl's rollout_rs does: the row's reward still votes
    verl_alone = per_row(compute(plain, torch.arange(4)))
    guarded = per_row(advantages_without(make_batch(scores, lengths), rejected, compute))
    kept = torch.tensor([1.0, 0.0, 1.0])
    expected = (kept - kept.mean()) / (kept.std() + EPSILON)
    torch.testing.assert_close(guarded[~rejected], expected, rtol=1e-5, atol=1e-5)
    assert verl_alone[0] < 0 < guarded[0]  # the accepted row with reward 1 gets a negative advantage from verl alone


def test_nothing_excluded_is_verls_own_computation():
    compute = verl_advantages(AdvantageEstimator.GRPO)
    guarded = advantages_without(make_batch(SCORES, LENGTHS), torch.zeros(len(SCORES), dtype=torch.bool), compute)
    plain = compute(make_batch(SCORES, LENGTHS), torch.arange(len(SCORES)))
    assert torch.equal(guarded.batch["advantages"], plain.batch["advantages"])
    assert torch.equal(guarded.batch["response_mask"], plain.batch["response_mask"])


def test_every_row_excluded_gives_zero_advantages_and_an_empty_mask():
    compute = verl_advantages(AdvantageEstimator.GRPO)
    data = advantages_without(make_batch(SCORES, LENGTHS), torch.ones(len(SCORES), dtype=torch.bool), compute)
    assert not data.batch["advantages"].any() and not data.batch["response_mask"].any()


def test_rows_of_several_processes_keep_their_order():
    """verl's driver sees the batch of every data-parallel rank concatenated; rows excluded in the middle of the
    batch leave every other row's advantage at its own index."""
    scores = SCORES * 3
    lengths = LENGTHS * 3
    excluded = torch.cat([EXCLUDED, torch.zeros(len(SCORES), dtype=torch.bool), EXCLUDED])
    data = make_batch(scores, lengths)
    data.non_tensor_batch["uid"] = np.array([f"prompt{row // GROUP}" for row in range(len(scores))], dtype=object)
    guarded = per_row(advantages_without(data, excluded, verl_advantages(AdvantageEstimator.GRPO)))
    torch.testing.assert_close(guarded[: len(SCORES)], hand_grpo(True), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(guarded[2 * len(SCORES):], hand_grpo(True), rtol=1e-5, atol=1e-5)


def test_evidence_leaves_the_trainer_side_out_in_bypass_mode():
    tensors = {"response_mask": torch.ones(2, 3), "rollout_log_probs": -torch.rand(2, 3),
               "old_log_probs": -torch.rand(2, 3)}
    two_sided = evidence_of(tensors, bypass=False)
    assert two_sided.has_engine and two_sided.has_trainer
    one_sided = evidence_of(tensors, bypass=True)
    assert one_sided.has_engine and not one_sided.has_trainer
    with pytest.raises(GuardInputError, match="response_mask"):
        evidence_of({"rollout_log_probs": torch.zeros(2, 3)}, bypass=False)


def test_a_quarantined_turn_takes_its_whole_agent_loop_trajectory_out():
    keys = ["u1_0_0", "u1_0_1", "u1_1_0", "u2_0_0"]
    assert trajectory_of(keys) == ["u1_0", "u1_0", "u1_1", "u2_0"]
    widened = widen_to_trajectories(torch.tensor([False, True, False, False]), trajectory_of(keys))
    assert widened.tolist() == [True, True, False, False]
    with pytest.raises(GuardInputError, match="batch.keys"):
        trajectory_of(["no-trajectory"])


def test_rows_rejected_whole_by_verl_are_told_from_rows_that_were_empty():
    before = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    after = torch.tensor([[0, 0, 0], [1, 0, 0], [0, 0, 0]])
    assert rejected_whole(before, after).tolist() == [True, False, False]


def policy_loss(name: str, values: dict[str, torch.Tensor], log_prob: torch.Tensor, agg: str) -> torch.Tensor:
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    config = FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                             policy_loss=PolicyLossConfig(loss_mode=name, dro_beta=0.1))
    loss, *_ = get_policy_loss_fn(name)(
        old_log_prob=values["old_log_probs"], log_prob=log_prob, advantages=values["advantages"],
        response_mask=values["response_mask"], loss_agg_mode=agg, config=config,
        rollout_is_weights=values["rollout_is_weights"])
    return loss


def loss_and_gradient(name: str, agg: str, bad_value: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's policy loss ``name`` over 4 rows whose row 1 is excluded: its per-row floats hold ``bad_value``
    (None: ordinary values) before the guard's neutral fill."""
    generator = torch.Generator().manual_seed(0)
    rows, width = 4, 5
    log_prob = (-torch.rand(rows, width, generator=generator)).requires_grad_()
    tensors = {
        "old_log_probs": log_prob.detach() - 0.05 * torch.rand(rows, width, generator=generator),
        "rollout_log_probs": log_prob.detach() - 0.05 * torch.rand(rows, width, generator=generator),
        "ref_log_prob": log_prob.detach() - 0.05 * torch.rand(rows, width, generator=generator),
        "rollout_is_weights": 1 + 0.1 * torch.rand(rows, width, generator=generator),
        "advantages": torch.randn(rows, 1, generator=generator).expand(rows, width).clone(),
        "response_mask": torch.ones(rows, width),
    }
    excluded = torch.tensor([False, True, False, False])
    if bad_value is not None:
        for key in ("old_log_probs", "rollout_log_probs", "ref_log_prob", "rollout_is_weights"):
            tensors[key][1] = bad_value
    data = DataProto.from_dict(tensors=tensors)
    data.batch["response_mask"][excluded] = 0
    data.batch["advantages"][excluded] = 0
    neutral_rows(data, excluded)
    loss = policy_loss(name, dict(data.batch.items()), log_prob, agg)
    loss.backward()
    return loss.detach(), log_prob.grad


def policy_losses() -> list[str]:
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    return sorted(POLICY_LOSS_REGISTRY)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("name", policy_losses())
def test_an_excluded_row_adds_nothing_to_any_policy_loss_or_gradient_whatever_its_values(name, agg):
    clean_loss, clean_gradient = loss_and_gradient(name, agg, None)
    for bad in (1e5, -1e5, math.inf, -math.inf, math.nan):
        loss, gradient = loss_and_gradient(name, agg, bad)
        assert torch.isfinite(loss) and torch.isfinite(gradient).all(), (name, agg, bad)
        assert not gradient[1].any(), (name, agg, bad)
        torch.testing.assert_close(loss, clean_loss)
        torch.testing.assert_close(gradient, clean_gradient)
