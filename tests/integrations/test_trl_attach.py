"""Attach-time checks on a real TRL GRPOTrainer (transformers rollouts, no vLLM), in this process."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import torch

from rollout_guard.errors import GuardError
from rollout_guard.outputs.sinks import Sink


def make_trainer(model_dir, out, rollouts=None, **overrides):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rollout_guard.integrations.hf_rollouts import TransformersRollouts
    from rollout_guard.testing.tiny_model import TinyModelRecipe, copy_prompt, copy_reward, random_letters

    rng = random.Random(0)
    dataset = Dataset.from_list([{"prompt": copy_prompt(random_letters(rng, TinyModelRecipe()))} for _ in range(16)])
    settings = dict(output_dir=str(out), max_steps=1, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                    use_vllm=False, use_cpu=True, bf16=False, report_to="none", save_strategy="no", disable_tqdm=True)
    settings.update(overrides)

    def copy_accuracy(prompts, completions, **_):
        return [copy_reward(p, c) for p, c in zip(prompts, completions, strict=True)]

    return GRPOTrainer(model=str(model_dir), reward_funcs=copy_accuracy, args=GRPOConfig(**settings), train_dataset=dataset,
                       rollout_func=rollouts or TransformersRollouts())


@pytest.fixture(scope="module")
def trainer(tiny_model_dir, tmp_path_factory):
    return make_trainer(tiny_model_dir, tmp_path_factory.mktemp("attach"))


def test_a_mode_string_instead_of_a_config_names_the_fix(trainer):
    from rollout_guard.integrations.trl import attach_guard

    with pytest.raises(GuardError, match=r"config='monitor'.*GuardConfig\(mode='monitor'\)"):
        attach_guard(trainer, "monitor")
    with pytest.raises(GuardError, match="sinks"):
        attach_guard(trainer, sinks="local")
    assert getattr(trainer, "_rollout_guard", None) is None, "nothing attached by a rejected call"


@pytest.mark.parametrize("rate", [2, -0.1, float("nan"), True, "0.1"])
def test_an_impossible_injection_rate_fails_at_once(trainer, rate):
    from rollout_guard.integrations.trl import inject_stale_context

    with pytest.raises(GuardError, match=r"inject_stale_context\(rate=.*\[0, 1\]"):
        inject_stale_context(trainer, rate=rate)


def test_sampling_that_changes_the_support_is_announced_at_attach(tiny_model_dir, tmp_path, caplog):
    from rollout_guard import GuardConfig
    from rollout_guard.integrations.trl import attach_guard

    truncated = make_trainer(tiny_model_dir, tmp_path / "top_p", top_p=0.9, top_k=5)
    with caplog.at_level(logging.WARNING, logger="rollout_guard"):
        attach_guard(truncated, GuardConfig(output_dir=str(tmp_path / "guard")))
    said = [r.getMessage() for r in caplog.records if "processed" in r.getMessage() or "top_p" in r.getMessage()]
    assert len(said) == 1 and "top_k=5, top_p=0.9" in said[0] and "on the same support" in said[0]
    assert truncated._rollout_guard.support is not None  # compared on the engine's support
    caplog.clear()
    offset = make_trainer(tiny_model_dir, tmp_path / "offset", top_p=0.9, top_k=5)
    with caplog.at_level(logging.WARNING, logger="rollout_guard"):
        attach_guard(offset, GuardConfig(output_dir=str(tmp_path / "guard2"), compare_on_engine_support=False))
    said = [r.getMessage() for r in caplog.records if "processed" in r.getMessage() or "top_p" in r.getMessage()]
    assert len(said) == 1 and "top_p=0.9" in said[0] and "0.105 nat" in said[0] and "top_k=5" in said[0]
    assert offset._rollout_guard.support is None  # the offset stays for the detector's centres


def test_default_sampling_says_nothing(trainer):
    from rollout_guard.integrations.trl.sampling import processed_logprobs_warning, support_changes

    assert support_changes(trainer) == [] and processed_logprobs_warning(trainer) is None


def test_the_sampling_settings_handed_to_the_guard_change_when_a_setting_does(trainer):
    """What ``guard_batch`` passes as ``sampling`` each step (a change starts the detector's noise over): strings,
    so that the guard's JSON checkpoint gives back an equal tuple."""
    import json as json_module

    from rollout_guard.integrations.trl.sampling import sampling_settings

    before = sampling_settings(trainer)
    assert f"temperature={trainer.args.temperature!r}" in before and all(isinstance(v, str) for v in before)
    assert tuple(json_module.loads(json_module.dumps(list(before)))) == before
    owner = trainer if hasattr(trainer, "top_k") else trainer.args  # TRL copies the setting onto the trainer
    old_top_k = owner.top_k
    owner.top_k = 20
    try:
        after = sampling_settings(trainer)
    finally:
        owner.top_k = old_top_k
    assert after != before and "top_k=20" in after
    assert sampling_settings(trainer) == before


def test_circuit_breaker_can_raise_after_writing_everything(tiny_model_dir, tmp_path):
    """With on_ceiling="raise", trainer.train() raises once records, metrics and summary are written."""
    from rollout_guard import CircuitBreakerTripped, GuardConfig, read_records
    from rollout_guard.integrations.hf_rollouts import TransformersRollouts
    from rollout_guard.integrations.trl import attach_guard

    trainer = make_trainer(tiny_model_dir, tmp_path / "trainer", rollouts=TransformersRollouts(stale_context_rate=0.9, seed=3),
                           max_steps=4)
    guarded = attach_guard(trainer, GuardConfig(max_quarantine_share=0.5, on_ceiling="raise", output_dir=str(tmp_path / "guard")))
    with pytest.raises(CircuitBreakerTripped, match="rollout_guard stopped training: .* above max_quarantine_share=0.5"):
        trainer.train()
    assert trainer.state.global_step == 0, "raised inside the first step, before its update"
    guard_dir = Path(guarded.output_dir)
    summary = json.loads((guard_dir / "summary.json").read_text())
    assert summary["stopped"].startswith("rollout_guard stopped training") and summary["steps"] == 1
    assert [json.loads(line)["step"] for line in (guard_dir / "metrics.jsonl").read_text().splitlines()] == [1]
    records = list(read_records(guard_dir / "quarantine"))
    assert len(records) == summary["suspect"] > 4 and {r.step for r in records} == {1}


def test_the_default_circuit_breaker_stop_ends_train_with_an_exception_said_once(tiny_model_dir, tmp_path, caplog):
    """With the default on_ceiling="stop", the step that trips the breaker trains, training ends, and
    trainer.train() raises CircuitBreakerTripped (a script's save_model after it does not run); the reason is in
    the exception only, not repeated in the log."""
    from rollout_guard import CircuitBreakerTripped, GuardConfig
    from rollout_guard.integrations.hf_rollouts import TransformersRollouts
    from rollout_guard.integrations.trl import attach_guard

    trainer = make_trainer(tiny_model_dir, tmp_path / "trainer",
                           rollouts=TransformersRollouts(stale_context_rate=0.9, seed=3), max_steps=4)
    guarded = attach_guard(trainer, GuardConfig(output_dir=str(tmp_path / "guard")))
    with caplog.at_level(logging.INFO, logger="rollout_guard"), pytest.raises(CircuitBreakerTripped) as raised:
        trainer.train()
    assert trainer.state.global_step == 1, "the step that tripped the breaker trained; no later step did"
    message = str(raised.value)
    assert message.startswith("rollout_guard stopped training: ") and "above max_quarantine_share=0.5" in message
    assert "Training ended cleanly after step 1 of 4" in message
    assert not [r.getMessage() for r in caplog.records if "above max_quarantine_share" in r.getMessage()]
    summary = json.loads((Path(guarded.output_dir) / "summary.json").read_text())
    assert summary["stopped"] in message and summary["steps_over_ceiling"] == 1


class _RecordingSink(Sink):
    """Remembers what reached it; ``fail_on``: events that raise; ``gate``: on_step waits until it is set, then
    0.5 s more (a slow disk or tracker that the test controls)."""

    def __init__(self, fail_on: tuple[str, ...] = (), gate=None) -> None:  # noqa: ANN001
        self.fail_on, self.gate = fail_on, gate
        self.records, self.steps, self.ended = [], [], False

    def on_records(self, records, guard):
        if "on_records" in self.fail_on:
            raise OSError("disk full (test)")
        self.records.extend(records)

    def on_step(self, report, guard):
        import time

        if self.gate is not None:
            assert self.gate.wait(60), "the test never opened the gate"
            time.sleep(0.5)
        if "on_step" in self.fail_on:
            raise OSError("tracker down (test)")
        self.steps.append((report.step, guard.totals.steps, dict(report.metrics)))

    def on_end(self, guard):
        self.ended = True


def test_full_evidence_for_the_worst_k_statistics_for_all(tiny_model_dir, tmp_path):
    """With evidence_samples_per_step=2 every suspect sample still gets a record, the two worst of
    each step (the documented order, on the gathered report) with tokens decoded in one batch exactly as one by
    one, the rest without tokens; metrics carry overhead_seconds ≥ guard_seconds."""
    from transformers import AutoTokenizer

    from rollout_guard import GuardConfig, read_records
    from rollout_guard.integrations.hf_rollouts import TransformersRollouts
    from rollout_guard.integrations.trl import attach_guard
    from rollout_guard.selection import worst_suspects

    trainer = make_trainer(tiny_model_dir, tmp_path / "trainer", rollouts=TransformersRollouts(stale_context_rate=0.9, seed=3),
                           max_steps=2)
    guarded = attach_guard(trainer, GuardConfig(evidence_samples_per_step=2, max_quarantine_share=None,
                                                output_dir=str(tmp_path / "guard")), keep_steps=True)
    trainer.train()
    records = list(read_records(Path(guarded.output_dir) / "quarantine"))
    suspects = sum(int(step.report.metrics["suspect"]) for step in guarded.steps)
    assert len(records) == suspects > 2 * len(guarded.steps), "a record for every suspect sample"
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    for step in guarded.steps:
        mine = [r for r in records if r.step == step.step]
        assert sorted(r.global_row for r in mine) == torch.nonzero(step.report.suspect).flatten().tolist()
        full = [r for r in mine if r.full_evidence]
        assert {r.global_row for r in full} == set(worst_suspects(step.report.samples, step.report.reasons, 2).tolist())
        for record in full:
            assert record.completion_ids and len(record.engine_logprobs) == len(record.completion_ids)
            assert record.completion_tokens == [tokenizer.decode([t]) for t in record.completion_ids]
            assert record.completion_text == tokenizer.decode(record.completion_ids)
            assert record.prompt_text == tokenizer.decode(record.prompt_ids)
        for record in mine:
            if not record.full_evidence:
                assert record.rules and record.stats["max_abs_delta"] > 0 and record.reward is not None
                assert record.completion_ids == [] and record.engine_logprobs is None and record.completion_tokens == []
    lines = [json.loads(line) for line in (Path(guarded.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(line["overhead_seconds"] >= line["guard_seconds"] > 0 for line in lines)


def test_checkpoint_waits_for_the_writer(tiny_model_dir, tmp_path, monkeypatch):
    """The guard's checkpoint state is saved only after the background writer wrote every step before it: the
    sink finishes a step only 0.5 s after the checkpoint's save began, and the state file must still come after."""
    import threading

    from rollout_guard import GuardConfig
    from rollout_guard.integrations.hf_rollouts import TransformersRollouts
    from rollout_guard.integrations.trl import attach_guard
    from rollout_guard import checkpoint as checkpoint_state

    trainer = make_trainer(tiny_model_dir, tmp_path / "trainer", rollouts=TransformersRollouts(stale_context_rate=0.5, seed=3),
                           max_steps=2, save_strategy="steps", save_steps=1)
    gate = threading.Event()
    sink = _RecordingSink(gate=gate)
    guarded = attach_guard(trainer, GuardConfig(max_quarantine_share=None, output_dir=str(tmp_path / "guard")), sinks=[sink])
    seen_at_save = []
    original_state, original_save = checkpoint_state.save_state, guarded.save_state

    def state_file_written(guard, checkpoint_dir, global_step=None):
        seen_at_save.append((global_step, [step for step, _, _ in sink.steps]))
        return original_state(guard, checkpoint_dir, global_step)

    def save_state(checkpoint_dir, global_step=None):
        gate.set()  # the sink may finish the pending step now (0.5 s later)
        try:
            return original_save(checkpoint_dir, global_step)
        finally:
            gate.clear()

    monkeypatch.setattr(checkpoint_state, "save_state", state_file_written)
    guarded.save_state = save_state
    trainer.train()
    assert seen_at_save == [(1, [1]), (2, [1, 2])]
    assert sink.ended and [totals for _, totals, _ in sink.steps] == [1, 2], "each step saw the guard as it stood then"


@pytest.mark.parametrize("strict", [True, False])
def test_a_failing_sink_surfaces_on_the_training_thread(tiny_model_dir, tmp_path, strict):
    from rollout_guard import GuardConfig
    from rollout_guard.integrations.hf_rollouts import TransformersRollouts
    from rollout_guard.integrations.trl import attach_guard

    trainer = make_trainer(tiny_model_dir, tmp_path / "trainer", rollouts=TransformersRollouts(stale_context_rate=0.9, seed=3),
                           max_steps=2)
    sink = _RecordingSink(fail_on=("on_records",))
    guarded = attach_guard(trainer, GuardConfig(max_quarantine_share=None, strict=strict, output_dir=str(tmp_path / "guard")),
                           sinks=[sink])
    if strict:
        with pytest.raises(OSError, match="disk full"):
            trainer.train()
        return
    trainer.train()
    assert guarded.guard.totals.output_failures == 2, "one failed on_records per step, counted on the training thread"
    assert guarded.guard.totals.failures == 0, "both steps were judged"
    assert [step for step, _, _ in sink.steps] == [1, 2] and sink.ended


def test_a_strict_output_failure_on_the_main_process_stops_every_process_together(tiny_model_dir, tmp_path):
    """Two CPU processes (gloo), ``strict=True``; the sink fails once, on rank 0 (sinks run on the main process
    only). The failure travels in the next step's gather and both ranks raise the same GuardError at the same step,
    rank 0's with the sink's error as its cause. (Before, rank 0 alone raised the OSError, and rank 1 went on into
    the loss's collectives, waiting for a process that had left.)"""
    from tests.integrations.strict_output_failure import STEPS
    from tests.processes import launch

    done = launch(Path(__file__).with_name("strict_output_failure.py"), tiny_model_dir, tmp_path, processes=2,
                  env={"TRL_EXPERIMENTAL_SILENCE": "1"})
    log = (done.stdout + done.stderr)[-6000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    for result in ranks:
        assert result["error"] == "GuardError", (result, log)
        assert "failed on process(es) [0]" in result["message"], result["message"]
        assert result["step"] < STEPS, "raised during training, not after it"
    assert ranks[0]["step"] == ranks[1]["step"], "both processes stopped at the same step"
    assert ranks[0]["cause"] == "OSError" and "disk full" in ranks[0]["message"]
    assert ranks[1]["cause"] is None and "disk full" not in ranks[1]["message"]


LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
EXTREMES = (1e5, -1e5, float("nan"), float("inf"), float("-inf"))


def loss_row_keys() -> set[str]:
    """Every batch key TRL's GRPO loss reads (``_compute_loss``'s ``inputs[...]`` and ``inputs.get(...)``), from
    the installed TRL's source, less token ids, masks and multimodal inputs: the per-row floats."""
    import inspect
    import re

    from trl import GRPOTrainer

    read = set(re.findall(r"inputs(?:\[|\.get\()\"(\w+)\"", inspect.getsource(GRPOTrainer._compute_loss)))
    assert {"advantages", "old_per_token_logps", "ref_per_token_logps"} <= read, read
    not_floats = {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask", "num_items_in_batch",
                  "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                  "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids"}
    return read - not_floats


def test_a_quarantined_row_adds_nothing_to_any_loss_or_gradient_whatever_its_values(tiny_model_dir, tmp_path):
    """A real TRL batch (beta > 0; vLLM's importance-sampling correction and the off-policy mask switched on for the
    loss, so that it reads every per-row float key) with one row quarantined: writing ±1e5, NaN or ±inf into every
    per-row float key of that row before the quarantine action leaves every loss type's loss and gradient exactly
    those of the same batch with that row's values ordinary (and finite)."""
    from rollout_guard import GuardConfig
    from rollout_guard.integrations.trl import attach_guard
    from rollout_guard.integrations.trl.batch import NEUTRAL_FILL, quarantine_batch

    keys = loss_row_keys()
    assert keys <= set(NEUTRAL_FILL) | {"advantages"}, f"a per-row float the loss reads has no neutral fill: {keys}"
    trainer = make_trainer(tiny_model_dir, tmp_path / "trainer", beta=0.04, off_policy_mask_threshold=0.5,
                           num_iterations=2)  # TRL then computes old logprobs
    guarded = attach_guard(trainer, GuardConfig(mode="monitor", output_dir=str(tmp_path / "guard")), keep_steps=True)
    trainer.train()
    step = guarded.steps[0]
    raw, rewards = dict(step.before), step.rewards_per_func
    rows, width = raw["completion_mask"].shape
    generator = torch.Generator().manual_seed(0)
    raw["sampling_per_token_logps"] = raw["old_per_token_logps"] - 0.01 * torch.rand(rows, width, generator=generator)
    raw["importance_sampling_ratio"] = 1 + 0.1 * torch.rand(rows, width, generator=generator)
    assert keys <= set(raw), keys - set(raw)
    quarantined_row = 1
    report = step.report
    report.local_quarantined = torch.zeros(rows, dtype=torch.bool)
    report.local_quarantined[quarantined_row] = True
    report.quarantined = report.local_quarantined.clone()

    def with_row(value: float) -> dict:
        batch = {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in raw.items()}
        for key in keys:
            batch[key][quarantined_row] = value
        return quarantine_batch(batch, report, rewards, guarded.settings)

    def loss_and_gradient(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        trainer.model.zero_grad()
        loss = trainer._compute_loss(trainer.model, batch)
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])

    saved = (trainer.loss_type, trainer.importance_sampling_level, trainer.use_vllm,
             trainer.vllm_importance_sampling_correction)
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True  # the loss reads the IS ratio
    try:
        for loss_type in LOSS_TYPES:
            trainer.loss_type = loss_type
            trainer.importance_sampling_level = "sequence" if loss_type == "luspo" else "token"
            ordinary_loss, ordinary_gradient = loss_and_gradient(with_row(-0.5))
            assert torch.isfinite(ordinary_loss) and torch.isfinite(ordinary_gradient).all(), loss_type
            for value in EXTREMES:
                loss, gradient = loss_and_gradient(with_row(value))
                assert torch.equal(loss, ordinary_loss), (loss_type, value, loss, ordinary_loss)
                assert torch.equal(gradient, ordinary_gradient), (loss_type, value)
    finally:
        (trainer.loss_type, trainer.importance_sampling_level, trainer.use_vllm,
         trainer.vllm_importance_sampling_correction) = saved
