"""Attach-time checks on a real TRL GRPOTrainer (built, not trained: no engine starts)."""

from __future__ import annotations

import logging
import random

import pytest

from rollout_guard.errors import GuardError


def make_trainer(model_dir, out, **overrides):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rollout_guard.integrations.hf_rollouts import TransformersRollouts
    from rollout_guard.integrations.tiny_model import TinyModelRecipe, copy_prompt, copy_reward, random_letters

    rng = random.Random(0)
    dataset = Dataset.from_list([{"prompt": copy_prompt(random_letters(rng, TinyModelRecipe()))} for _ in range(16)])
    settings = dict(output_dir=str(out), max_steps=1, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                    use_vllm=False, use_cpu=True, bf16=False, report_to="none", save_strategy="no", disable_tqdm=True)
    settings.update(overrides)

    def copy_accuracy(prompts, completions, **_):
        return [copy_reward(p, c) for p, c in zip(prompts, completions, strict=True)]

    return GRPOTrainer(model=str(model_dir), reward_funcs=copy_accuracy, args=GRPOConfig(**settings), train_dataset=dataset,
                       rollout_func=TransformersRollouts())


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
    assert len(said) == 1 and "top_p=0.9" in said[0] and "0.105 nat" in said[0] and "top_k=5" in said[0]


def test_default_sampling_says_nothing(trainer):
    from rollout_guard.integrations.trl.sampling import processed_logprobs_warning, support_changes

    assert support_changes(trainer) == [] and processed_logprobs_warning(trainer) is None
