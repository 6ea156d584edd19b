"""Worker for test_trl_attach's two-process strict-mode case: run with ``accelerate launch --num_processes 2`` (CPU,
gloo).

Each process trains a real TRL GRPOTrainer (the tiny copy policy, transformers rollouts) with ``strict=True``; the
main process's only sink fails on its first ``on_step`` (a disk that fills up), which happens on rank 0 alone: sinks
run on the main process. Each rank writes (``rank<r>.pt``) what it raised and at which step, or that it finished.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch

from rollout_guard.outputs.sinks import Sink

STEPS = 4


class _FullDisk(Sink):
    def __init__(self) -> None:
        self.failed = False

    def on_records(self, records, guard) -> None:  # noqa: ANN001
        pass

    def on_step(self, report, guard) -> None:  # noqa: ANN001
        if not self.failed:
            self.failed = True
            raise OSError("disk full (test)")

    def on_end(self, guard) -> None:  # noqa: ANN001
        pass


def main(model_dir: str, out: str) -> None:
    from accelerate import PartialState

    from rollout_guard import GuardConfig
    from rollout_guard.integrations.trl import attach_guard
    from tests.integrations.test_trl_attach import make_trainer

    state = PartialState(cpu=True)
    trainer = make_trainer(Path(model_dir), Path(out) / "trainer", max_steps=STEPS, ddp_timeout=60)
    attach_guard(trainer, GuardConfig(strict=True, max_quarantine_share=None, output_dir=str(Path(out) / "guard")),
                 sinks=[_FullDisk()])
    result = {"rank": state.process_index, "error": None}
    try:
        trainer.train()
    except Exception as error:  # noqa: BLE001 - what each rank raised is the result
        cause = error.__cause__
        result.update(error=type(error).__name__, message=str(error), step=trainer.state.global_step,
                      cause=type(cause).__name__ if cause is not None else None,
                      traceback=traceback.format_exc())
    result["finished_step"] = trainer.state.global_step
    torch.save(result, Path(out) / f"rank{state.process_index}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
