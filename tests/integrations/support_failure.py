"""Worker for test_trl_support's two-process case: run with ``accelerate launch --num_processes 2`` (CPU, gloo).

Each process trains a real TRL GRPOTrainer (a flat tiny policy sampled with top_k = 5, transformers rollouts, no
corruption) with the guard comparing on the engine's support; the support hook fails from step ``FAIL`` on rank 1
only (an out-of-memory in the LM-head projection, which one process can meet and the other not). Each rank writes
(``rank<r>.pt``) what the test compares across ranks: every step's report and metrics, and the guard's state.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

STEPS, FAIL, FAILING_RANK = 6, 4, 1


def main(model_dir: str, out: str) -> None:
    from accelerate import PartialState

    import rollout_guard.integrations.trl.support as support
    from rollout_guard import GuardConfig
    from rollout_guard.integrations.trl import attach_guard
    from tests.integrations.test_trl_attach import make_trainer

    state = PartialState(cpu=True)
    trainer = make_trainer(Path(model_dir), Path(out) / "trainer", top_k=5, max_steps=STEPS,
                           per_device_train_batch_size=64, num_generations=16, ddp_timeout=120)
    working = support.token_log_mass

    def failing_on_one_rank(*args, **kwargs):
        if state.process_index == FAILING_RANK and trainer.state.global_step >= FAIL - 1:
            raise RuntimeError("out of memory in the LM-head projection")
        return working(*args, **kwargs)

    support.token_log_mass = failing_on_one_rank
    guarded = attach_guard(trainer, GuardConfig(output_dir=str(Path(out) / "guard")), keep_steps=True)
    trainer.train()
    steps = [{"skipped": s.report.skipped, "suspect": s.report.suspect, "check_flags": s.report.check_flags,
              "metrics": {k: v for k, v in s.report.metrics.items() if not k.endswith("seconds")},
              "evidence": s.evidence} for s in guarded.steps]
    torch.save({"rank": state.process_index, "steps": steps, "failures": guarded.guard.totals.failures,
                "support": guarded.support is not None,
                "resets": guarded.guard.noise_resets, "state": guarded.guard.state_dict()},
               Path(out) / f"rank{state.process_index}.pt")
    state.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
