"""Worker for test_trl_resume_ranks: run with ``accelerate launch --num_processes 2`` (CPU, gloo).

Each process trains a real TRL GRPOTrainer (the tiny copy policy, transformers rollouts, some rollouts corrupted)
with an output directory of its own, ``<out>/rank<r>``, as on nodes without a shared filesystem: only the main
process writes the guard's state into its checkpoint. ``first``: 2 steps, checkpoint at step 2. ``resume``: resumes
from ``<out>/rank<r>/checkpoint-2`` and trains to step 4. Each rank then writes its guard's state (``rank<r>.pt``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

CHECKPOINT_STEP, STEPS = 2, 4


def main(model_dir: str, out: str, phase: str) -> None:
    from accelerate import PartialState

    from rollout_guard import GuardConfig
    from rollout_guard.integrations.hf_rollouts import TransformersRollouts
    from rollout_guard.integrations.trl import attach_guard
    from tests.integrations.test_trl_attach import make_trainer

    state = PartialState(cpu=True)
    mine = Path(out) / f"rank{state.process_index}"
    steps = CHECKPOINT_STEP if phase == "first" else STEPS
    trainer = make_trainer(Path(model_dir), mine, rollouts=TransformersRollouts(stale_context_rate=0.3, seed=5),
                           max_steps=steps, save_strategy="steps", save_steps=CHECKPOINT_STEP, ddp_timeout=60)
    if phase == "resume" and str(trainer.args.device) == "cpu:0":
        # transformers loads the optimizer with map_location=args.device when there are several processes, and
        # torch.load does not take "cpu:0"
        trainer.args.__dict__["_setup_devices"] = torch.device("cpu")
    guarded = attach_guard(trainer, GuardConfig(max_quarantine_share=None, output_dir=str(mine / "guard")))
    trainer.train(resume_from_checkpoint=str(mine / f"checkpoint-{CHECKPOINT_STEP}") if phase == "resume" else None)
    guard = guarded.guard
    torch.save({"totals": guard.totals.to_dict(), "detector": guard.detector.state_dict(),
                "alerts": guard.alerts.state_dict()}, Path(out) / f"rank{state.process_index}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:4])
