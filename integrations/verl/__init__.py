"""The verl adapter: the guard between verl's old-logprob pass and its advantages (verl 0.9.1, the v1 trainer).

One Hydra override selects a guarded trainer: ``trainer.v1.trainer_mode=guarded_sync`` (or
``guarded_colocate_async``, ``guarded_separate_async``); the ``verl.plugins`` entry point that ``rollout-guard``
installs registers them in every process that imports verl (:mod:`.plugin`). The guard's settings go under
``+rollout_guard.<GuardConfig field>=<value>``. Quarantined rows, and rows verl's own ``rollout_rs`` rejected whole,
are left out of every group baseline (:mod:`.batch`). The modules: :mod:`.batch` (pure functions on verl's batch,
no verl import), :mod:`.guard` (the guard of one run), :mod:`.trainer` (the trainers; imports verl).
"""

from rollout_guard.integrations.verl.batch import (advantages_without, evidence_of, neutral_rows, rejected_whole,
                                                   trajectory_of, thin_groups, widen_to_trajectories)
from rollout_guard.integrations.verl.guard import VerlGuard, guard_config

TESTED_VERL = ("0.9.1",)
"""The verl releases the adapter's tests run against (``make test-verl``)."""

__all__ = ["TESTED_VERL", "VerlGuard", "advantages_without", "evidence_of", "guard_config", "neutral_rows",
           "rejected_whole",
           "trajectory_of", "thin_groups", "widen_to_trajectories"]
