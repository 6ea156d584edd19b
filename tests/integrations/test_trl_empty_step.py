"""An optimizer step with only quarantined rows behind it is skipped, on a real TRL GRPOTrainer (transformers
rollouts, this process)."""

from __future__ import annotations

import copy
import json
import logging
import math
from pathlib import Path

import pytest
import torch

from rollout_guard.integrations.hf_rollouts import TransformersRollouts
from tests.integrations.test_trl_attach import make_trainer


class _NaNRollouts(TransformersRollouts):
    """Transformers rollouts whose engine logprobs are NaN in the generation calls numbered in ``broken`` (1-based):
    every row of those batches is flagged (rule ``nonfinite_engine``)."""

    def __init__(self, broken: set[int]) -> None:
        super().__init__()
        self.broken, self.calls = broken, 0

    def __call__(self, prompts, trainer):  # noqa: ANN001
        output = super().__call__(prompts, trainer)
        self.calls += 1
        if self.calls in self.broken:
            output["logprobs"] = [[math.nan] * len(row) for row in output["logprobs"]]
        return output


def _train(tiny_model_dir, tmp_path, broken, **overrides):  # noqa: ANN001
    """Three optimizer steps with AdamW (weight decay); the parameters and the optimizer's per-parameter state
    after each step."""
    from transformers import TrainerCallback

    from rollout_guard import GuardConfig
    from rollout_guard.integrations.trl import attach_guard

    after: list[tuple[torch.Tensor, dict]] = []

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):  # noqa: ANN001
            parameters = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
            after.append((parameters, copy.deepcopy(optimizer.state_dict()["state"])))

    trainer = make_trainer(tiny_model_dir, tmp_path / "trainer", rollouts=_NaNRollouts(broken), max_steps=3,
                           learning_rate=1e-2, weight_decay=0.1, **overrides)
    trainer.add_callback(Snapshot())
    guarded = attach_guard(trainer, GuardConfig(max_quarantine_share=None, output_dir=str(tmp_path / "guard")))
    trainer.train()
    assert len(after) == 3
    return after, guarded


def _same(first: tuple[torch.Tensor, dict], second: tuple[torch.Tensor, dict]) -> bool:
    (parameters, state), (other_parameters, other_state) = first, second
    return torch.equal(parameters, other_parameters) and state.keys() == other_state.keys() and all(
        torch.equal(torch.as_tensor(value), torch.as_tensor(other_state[index][key]))
        for index, entry in state.items() for key, value in entry.items())


def test_an_optimizer_step_with_every_row_quarantined_leaves_parameters_and_optimizer_state_alone(
        tiny_model_dir, tmp_path, caplog):
    """Step 2's rollouts are all quarantined: its optimizer step is skipped (AdamW's momentum and weight decay would
    move every parameter on a zero gradient), counted in the summary and logged once; steps 1 and 3 train."""
    with caplog.at_level(logging.WARNING, logger="rollout_guard"):
        after, guarded = _train(tiny_model_dir, tmp_path, broken={2})
    assert _same(after[0], after[1]), "parameters or optimizer state changed on the empty step"
    assert not torch.equal(after[1][0], after[2][0]), "the next step trains"
    said = [r.getMessage() for r in caplog.records if "the optimizer step is skipped" in r.getMessage()]
    assert len(said) == 1 and "optimizer step 2" in said[0]
    summary = json.loads((Path(guarded.output_dir) / "summary.json").read_text())
    assert summary["skipped_optimizer_steps"] == 1
    lines = [json.loads(line) for line in (Path(guarded.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [line["empty_batch"] for line in lines] == [0.0, 1.0, 0.0]


@pytest.mark.parametrize(("broken", "skipped"), [({3}, False), ({3, 4}, True)])
def test_with_gradient_accumulation_only_a_step_whose_every_micro_batch_is_empty_is_skipped(
        tiny_model_dir, tmp_path, broken, skipped):
    """Two micro-batches per optimizer step, each from its own generation batch: optimizer step 2 uses generation
    calls 3 and 4. One of them empty: the step trains on the other; both empty: it is skipped."""
    after, guarded = _train(tiny_model_dir, tmp_path, broken=broken, gradient_accumulation_steps=2,
                            steps_per_generation=1, per_device_train_batch_size=4, num_generations=4)
    assert _same(after[0], after[1]) == skipped
    assert guarded.guard.totals.skipped_optimizer_steps == int(skipped)
