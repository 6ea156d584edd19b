"""TRL's own settings against the guard, with real TRL (GRPOTrainer) and the tiny model, run in its own process.

    python tests/integrations/trl_matrix.py SCENARIO --out DIR --model MODEL_DIR

Scenarios (each saves ``result.pt``, or ``result-rank<N>.pt`` under several processes):

* ``matrix``: transformers rollouts (``TransformersRollouts``, engine logprobs without vLLM), one process. Two reward
  functions with weights that return ``None`` for some samples, ``steps_per_generation=4`` with
  ``gradient_accumulation_steps=2`` (TRL then computes old logprobs), ``beta > 0``, ``mask_truncated_completions``,
  tool masks (``env_mask``: the first two completion tokens of every rollout are "tool output"), stale-context
  injection. The four advantage settings of TRL — ``scale_rewards`` group, batch, none with
  ``sum_then_normalize``, and ``normalize_then_sum`` — take turns, one per generation (as four runs would, in one).
* ``loss``: vLLM colocate (CPU build), importance-sampling correction on, ``beta > 0``; NaN and ±inf written into
  TRL's batch (trainer, engine and reference logprobs, IS ratio) of a few rows, plus stale-context injection. For
  every TRL loss type, the loss and gradient of the guarded batch are compared with those of the batch without the
  quarantined rows.
* ``span`` (two processes): groups spanning processes (6 rows per process, groups of 4), injection; at step 3 one
  process loses the reward matrix (every process must skip the step), at step 4 one process's replica of TRL's
  advantages differs (every process must raise).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
import traceback
from dataclasses import replace
from pathlib import Path

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
ROW_MEAN_LOSSES = ("grpo", "dr_grpo", "sapo", "luspo")  # divide by the number of rows in the micro-batch
ADVANTAGE_SETTINGS = [("group", "sum_then_normalize"), ("batch", "sum_then_normalize"), ("none", "sum_then_normalize"),
                      ("group", "normalize_then_sum")]


def without_rows(batch: dict, keep) -> dict:
    """The batch with only the rows ``keep`` (a (B,) bool tensor); per-batch values (num_items_in_batch) kept."""
    rows = keep.shape[0]
    return {key: value[keep] if hasattr(value, "dim") and value.dim() >= 1 and value.shape[0] == rows else value
            for key, value in batch.items()}


def loss_and_gradient(trainer, batch: dict):
    import torch

    model = trainer.model
    model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(model, {k: v.clone() if hasattr(v, "clone") else v for k, v in batch.items()})
    loss.backward()
    gradient = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), gradient.detach().clone()


def removed_rows_comparison(trainer, raw: dict, guarded: dict, quarantined) -> dict:
    """For each TRL loss type: loss and gradient of the guarded batch, of the guarded batch without the quarantined
    rows (the reference), and of TRL's raw batch (the control). TRL divides ``grpo``/``sapo``/``luspo``/``dr_grpo``
    by the micro-batch's row count, which counts a quarantined row as it counts a row TRL masks itself (a truncated
    completion with ``mask_truncated_completions``): for those the reference is scaled by kept rows / rows."""
    saved = (trainer.loss_type, trainer.importance_sampling_level)
    keep = ~quarantined
    results = {}
    for loss_type in LOSS_TYPES:
        trainer.loss_type = loss_type
        trainer.importance_sampling_level = "sequence" if loss_type == "luspo" else saved[1]
        scale = float(keep.sum()) / keep.numel() if loss_type in ROW_MEAN_LOSSES else 1.0
        loss, gradient = loss_and_gradient(trainer, guarded)
        reference_loss, reference_gradient = loss_and_gradient(trainer, without_rows(guarded, keep))
        raw_loss, raw_gradient = loss_and_gradient(trainer, raw)
        results[loss_type] = {
            "loss": loss, "gradient": gradient, "reference_loss": reference_loss * scale,
            "reference_gradient": reference_gradient * scale, "raw_loss": raw_loss,
            "raw_gradient_finite": bool(raw_gradient.isfinite().all()),
        }
    trainer.loss_type, trainer.importance_sampling_level = saved
    return results


def prompts_dataset(count: int, seed: int):
    from datasets import Dataset

    from rollout_guard.testing.tiny_model import TinyModelRecipe, copy_prompt, random_letters

    rng = random.Random(seed)
    return Dataset.from_list([{"prompt": copy_prompt(random_letters(rng, TinyModelRecipe()))} for _ in range(count)])


def copy_accuracy(prompts, completions, **_):
    """Copy reward, but ``None`` (TRL: NaN) for five-letter prompts."""
    from rollout_guard.testing.tiny_model import copy_reward

    return [None if len(p) == 6 else copy_reward(p, c) for p, c in zip(prompts, completions, strict=True)]


def brevity(prompts, completions, **_):
    """A second objective: shorter is better; ``None`` for completions over 6 characters (so some samples have
    no reward at all)."""
    return [None if len(c) > 6 else 1.0 - len(c) / 10 for c in completions]


class WithToolMask:
    """A rollout_func that also returns TRL's ``env_mask``: the first two completion tokens of every rollout
    are external (tool output), masked out of the loss."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(self, prompts, trainer):
        out = self.inner(prompts, trainer)
        out["env_mask"] = [[0 if i < 2 else 1 for i in range(len(ids))] for ids in out["completion_ids"]]
        return out


def corrupt_with_nonfinite(trainer) -> list:
    """Wrap TRL's batch building (inside the guard) to write NaN/±inf into a few rows: trainer logprob NaN, −inf
    and +inf, engine logprob +inf and NaN, reference logprob NaN, importance-sampling ratio inf. Returns the list
    that collects, per generation, the rows written."""
    import torch

    original = trainer._generate_and_score_completions
    written: list = []

    def corrupting(inputs):
        batch = original(inputs)
        if not trainer.model.training:
            return batch
        mask = batch["completion_mask"] * batch.get("tool_mask", 1)
        rows = [int(r) for r in torch.nonzero(mask.sum(1) >= 3).flatten()[:4]]
        old, engine = batch["old_per_token_logps"], batch["sampling_per_token_logps"]
        old[rows[0], 0] = math.nan
        old[rows[1], 1] = -math.inf
        old[rows[2], 2] = math.inf
        engine[rows[2], 0] = math.inf
        engine[rows[3], 1] = math.nan
        batch["ref_per_token_logps"][rows[3]] = math.nan
        batch["importance_sampling_ratio"][rows[1]] = math.inf
        written.append(torch.zeros(mask.shape[0], dtype=torch.bool).index_fill_(0, torch.tensor(rows), True))
        return batch

    trainer._generate_and_score_completions = corrupting
    return written


def run(name: str, out: Path, model: str, steps: int) -> None:
    import torch
    from accelerate import PartialState
    from trl import GRPOConfig, GRPOTrainer

    from rollout_guard import GuardConfig
    from rollout_guard.integrations.hf_rollouts import TransformersRollouts
    from rollout_guard.integrations.trl import GroupSettings, attach_guard, inject_stale_context

    state = PartialState(cpu=True)
    settings = dict(output_dir=str(out / "trainer"), max_steps=steps, num_generations=4, max_completion_length=8,
                    learning_rate=5e-4, use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", report_to="none",
                    seed=0, disable_tqdm=True, ddp_timeout=90)
    guard_config = GuardConfig(max_quarantine_share=0.95)
    rollouts = None
    reward_funcs = [copy_accuracy]
    if name == "matrix":
        settings.update(per_device_train_batch_size=8, steps_per_generation=4, gradient_accumulation_steps=2, beta=0.04,
                        mask_truncated_completions=True, reward_weights=[1.0, 0.5], use_vllm=False)
        rollouts = WithToolMask(TransformersRollouts(stale_context_rate=0.25, seed=1))
        reward_funcs = [copy_accuracy, brevity]
    elif name == "loss":
        from rollout_guard.integrations.vllm_cpu import enable_trl_colocate_on_vllm_cpu

        enable_trl_colocate_on_vllm_cpu()
        settings.update(per_device_train_batch_size=16, beta=0.04, use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64,
                        max_completion_length=12)
        reward_funcs = [copy_accuracy, brevity]
    elif name == "span":
        settings.update(per_device_train_batch_size=6, use_vllm=False)
        rollouts = TransformersRollouts(stale_context_rate=0.3, seed=2)
        reward_funcs = [copy_accuracy, brevity]
    else:
        raise ValueError(name)

    trainer = GRPOTrainer(model=model, reward_funcs=reward_funcs, args=GRPOConfig(**settings), train_dataset=prompts_dataset(256, 5),
                          rollout_func=rollouts)
    written = corrupt_with_nonfinite(trainer) if name == "loss" else None  # inside the guard: the guard sees it
    guarded = attach_guard(trainer, guard_config, keep_steps=True)
    if name == "loss":
        inject_stale_context(trainer, rate=0.25, seed=0)
    used_settings: list = []
    faults: dict = {}
    guarded_generate = trainer._generate_and_score_completions

    def outermost(inputs):
        if not trainer.model.training:
            return guarded_generate(inputs)
        step = trainer.state.global_step + 1
        if name == "matrix":  # a new advantage setting for each generation, in TRL and in the guard alike
            trainer.scale_rewards, trainer.multi_objective_aggregation = ADVANTAGE_SETTINGS[len(used_settings) % 4]
            guarded.settings = GroupSettings.of(trainer)
            used_settings.append((trainer.scale_rewards, trainer.multi_objective_aggregation))
        if name == "span" and state.process_index == 1 and step == 4:  # this process's replica differs from TRL
            # one group of the whole global batch (12 rows): differs from TRL's groups of 4 whenever the step's
            # rewards differ at all (scale_rewards="none" did not when every group's rewards were equal: TRL's and
            # the replica's advantages were then all 0, as at step 4 with transformers 5.17)
            guarded.settings = replace(guarded.settings, group_size=3 * guarded.settings.group_size)
            faults["replica"] = step
        return guarded_generate(inputs)

    trainer._generate_and_score_completions = outermost
    if name == "span":
        guarded_rewards = trainer._calculate_rewards

        def losing_rewards(*args, **kwargs):  # step 3, one process: the guard does not see the reward matrix
            rewards = guarded_rewards(*args, **kwargs)
            if state.process_index == 1 and trainer.state.global_step + 1 == 3:
                guarded._rewards_per_func = None
                faults["rewards"] = 3
            return rewards

        trainer._calculate_rewards = losing_rewards

    started, error = time.perf_counter(), None
    try:
        trainer.train()
    except Exception as caught:  # noqa: BLE001 - saved for the test, then raised again
        error = f"{type(caught).__name__}: {caught}"
        traceback.print_exc()
    kept = guarded.steps
    result = {
        "scenario": name, "error": error, "train_seconds": time.perf_counter() - started, "faults": faults,
        "raw": [s.before for s in kept], "guarded": [s.after for s in kept], "rewards": [s.rewards_per_func for s in kept],
        "injected": [s.injected for s in kept], "steps": [s.step for s in kept], "settings": used_settings,
        "reports": [{"suspect": s.report.suspect, "quarantined": s.report.quarantined, "skipped": s.report.skipped,
                     "metrics": dict(s.report.metrics), "check_failed_on": s.report.check_failed_on,
                     "alerts": [a.kind for a in s.report.alerts]} for s in kept],
        "reward_weights": trainer.reward_weights.clone(), "num_generations": trainer.num_generations,
        "guard_dir": str(guarded.output_dir), "global_step": trainer.state.global_step, "summary": guarded.guard.summary(),
        "process_index": state.process_index, "num_processes": state.num_processes, "written": written,
    }
    if name in ("matrix", "loss") and error is None:
        for index, step in enumerate(kept):
            quarantined = step.report.quarantined
            if quarantined.any() and (step.after["advantages"] != 0).any():
                result["loss_step"] = index
                result["losses"] = removed_rows_comparison(trainer, step.before, step.after, quarantined)
                break
    torch.save(result, out / ("result.pt" if state.num_processes == 1 else f"result-rank{state.process_index}.pt"))
    if error is not None:
        raise SystemExit(3)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["matrix", "loss", "span"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=4)
    arguments = parser.parse_args()
    arguments.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    run(arguments.scenario, arguments.out, arguments.model, arguments.steps)
