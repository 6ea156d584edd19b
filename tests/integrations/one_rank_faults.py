"""Worker for test_trl_one_rank_faults: run with ``accelerate launch --num_processes 2`` (CPU, gloo).

For each site in ``SITES`` the two processes train a fresh real TRL GRPOTrainer (the tiny copy policy, transformers
rollouts, half the rollouts corrupted, truncated rows judged, TRL's own trainer logprobs: every collective of the
adapter runs each step) for ``STEPS`` steps; at step ``FAULT_STEP`` rank 1 alone raises a host exception at the
site. Each rank writes (``rank<r>.pt``) per site what it raised, the step it reached and the guard's failure
counts. Collectives time out after ``TIMEOUT_S`` seconds, so a rank left waiting raises instead of hanging.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch

STEPS, FAULT_STEP, TIMEOUT_S = 4, 3, 60
GENERATIONS = STEPS // 2  # num_iterations=2: rollouts generated at steps 1 and 3
SITES = ("truncated_rows", "loss_tokens", "records_context", "records_pickling")


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("cannot pickle this record (test)")


def _inject(guarded, site: str) -> None:  # noqa: ANN001
    """On this process, make ``site`` raise once, at step ``FAULT_STEP``."""
    from rollout_guard.integrations.trl import attach as attach_module

    def due() -> bool:
        return guarded.trainer.state.global_step + 1 == FAULT_STEP

    if site == "truncated_rows":
        original_truncated = guarded._truncated

        def truncated():
            if due():
                raise RuntimeError("tokenizer gone (test)")
            return original_truncated()

        guarded._truncated = truncated
    elif site == "loss_tokens":
        original_tokens = guarded._local_loss_tokens

        def local_loss_tokens(batch):  # noqa: ANN001
            if due():
                raise RuntimeError("no completion_mask (test)")
            return original_tokens(batch)

        guarded._local_loss_tokens = local_loss_tokens
    else:
        original_context = attach_module.add_context_to_records

        def add_context(records, step):  # noqa: ANN001
            if due() and site == "records_context":
                raise RuntimeError("engine context torn (test)")
            original_context(records, step)
            if due():
                records.append(_Unpicklable())

        attach_module.add_context_to_records = add_context


def main(model_dir: str, out: str, *sites: str) -> None:
    """Train once per site (``sites``: those of ``SITES`` to run; none: all)."""
    from accelerate import PartialState

    from rollout_guard import GuardConfig
    from rollout_guard.integrations.hf_rollouts import TransformersRollouts
    from rollout_guard.integrations.trl import attach as attach_module
    from rollout_guard.integrations.trl import attach_guard
    from tests.integrations.test_trl_attach import make_trainer

    state = PartialState(cpu=True, timeout=timedelta(seconds=TIMEOUT_S))
    results = {}
    original_context = attach_module.add_context_to_records
    for site in sites or SITES:
        attach_module.add_context_to_records = original_context
        trainer = make_trainer(Path(model_dir), Path(out) / site, max_steps=STEPS, ddp_timeout=TIMEOUT_S,
                               rollouts=TransformersRollouts(stale_context_rate=0.5, seed=7),
                               mask_truncated_completions=True, num_iterations=2)
        guarded = attach_guard(trainer, GuardConfig(max_quarantine_share=None,
                                                    output_dir=str(Path(out) / site / "guard")))
        assert guarded.judges_truncated and guarded.trl_trainer_logprobs, "every collective of the adapter runs"
        if state.process_index == 1:
            _inject(guarded, site)
        result = {"error": None}
        try:
            trainer.train()
        except Exception as error:  # noqa: BLE001 - what each rank raised is the result
            result["error"] = f"{type(error).__name__}: {error}"
        totals = guarded.guard.totals
        result.update(step=trainer.state.global_step, failures=totals.failures,
                      output_failures=totals.output_failures, steps=totals.steps)
        results[site] = result
        torch.save(results, Path(out) / f"rank{state.process_index}.pt")
        if result["error"] is not None:
            break  # the process group may be gone


if __name__ == "__main__":
    main(*sys.argv[1:])
