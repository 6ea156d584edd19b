"""The TRL adapter's pure batch transforms add no host sync to a step."""

from __future__ import annotations

import torch
from test_guard import OnDevice

from rollout_guard.config import GuardConfig
from rollout_guard.guard import RolloutGuard
from rollout_guard.integrations.trl import GroupSettings, check_action_inputs, evidence_of, quarantine_batch, replica_differs


def trl_batch() -> dict:
    generator = torch.Generator().manual_seed(0)
    engine = -torch.rand(8, 5, generator=generator)
    trainer = engine + 1e-4 * torch.randn(8, 5, generator=generator)
    trainer[3] = -9.0
    trainer[5, 1] = float("nan")
    batch = {
        "completion_mask": torch.ones(8, 5, dtype=torch.long), "sampling_per_token_logps": engine, "old_per_token_logps": trainer,
        "ref_per_token_logps": trainer.clone(), "importance_sampling_ratio": torch.ones(8, 1),
        "advantages": torch.zeros(8), "num_items_in_batch": torch.tensor(40),
    }
    return {key: value.as_subclass(OnDevice) for key, value in batch.items()}


def test_the_action_and_the_replica_check_stay_on_the_device():
    batch = trl_batch()
    rewards = torch.rand(8, 2, generator=torch.Generator().manual_seed(1)).as_subclass(OnDevice)
    settings = GroupSettings(torch.tensor([1.0, 0.5]), 4, "group", "sum_then_normalize")
    OnDevice.syncs = []
    check_action_inputs(batch, rewards, 8, settings)
    flag = replica_differs(batch, rewards, settings, slice(0, 8))
    report = RolloutGuard(GuardConfig()).inspect(evidence_of(batch), step=1, batch_size=8, check_failed=flag)
    assert OnDevice.syncs == ["cpu"], "the guard's one copy"
    OnDevice.syncs = []
    out = quarantine_batch(batch, report, rewards, settings)
    assert OnDevice.syncs == [], OnDevice.syncs
    assert report.quarantined.tolist() == [False, False, False, True, False, True, False, False]
    assert report.check_failed_on == [0], "zero advantages from TRL against the replica's nonzero ones"
    assert not out["completion_mask"][[3, 5]].any() and out["old_per_token_logps"].isfinite().all()
