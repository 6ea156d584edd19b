"""Zero-tolerance mode (GuardConfig.tolerance_delta) on a real bitwise-identical pair: the tiny model's fp32
forward pass computed twice, once as the engine and once as the trainer."""

from __future__ import annotations

import random

import pytest
import torch

from rollout_guard.config import GuardConfig
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.guard import RolloutGuard
from rollout_guard.verdict import RULE_BIT, rule_names


@pytest.fixture(scope="module")
def identical_pair(tiny_model_dir):
    """(engine, trainer, mask): each completion token's logprob from two separate fp32 forward passes of the tiny
    copy model over the same 16 copy prompts and their answers (nats, (16, T))."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_guard.testing.tiny_model import TinyModelRecipe, copy_prompt, random_letters

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    rng = random.Random(0)
    letters = [random_letters(rng, TinyModelRecipe()) for _ in range(16)]
    prompts = [tokenizer(copy_prompt(text)).input_ids for text in letters]
    answers = [tokenizer(text + tokenizer.eos_token, add_special_tokens=False).input_ids for text in letters]
    width = max(len(p) + len(a) for p, a in zip(prompts, answers, strict=True))
    ids = torch.full((16, width), tokenizer.pad_token_id)
    completion = torch.zeros(16, width, dtype=torch.bool)
    for row, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        ids[row, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        completion[row, len(prompt): len(prompt) + len(answer)] = True
    attention = (ids != tokenizer.pad_token_id) | completion

    def logprobs() -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attention.long()).logits[:, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)

    engine, trainer = logprobs(), logprobs()
    return engine, trainer, completion[:, 1:]


def test_a_bitwise_identical_pair_flags_nothing_under_zero_tolerance(identical_pair):
    engine, trainer, mask = identical_pair
    assert torch.equal(engine, trainer) and mask.sum() > 50, "the two fp32 passes agree bit for bit"
    report = RolloutGuard(GuardConfig(tolerance_delta=0.0)).inspect(RolloutEvidence(mask, engine, trainer), step=1)
    assert not report.suspect.any() and report.metrics["rule/tolerance"] == 0


def test_one_token_off_by_more_than_the_tolerance_is_flagged_under_its_own_rule(identical_pair):
    engine, trainer, mask = identical_pair
    engine = engine.clone()
    row, column = 5, int(torch.nonzero(mask[5])[2])
    engine[row, column] += 2e-4  # 0.2 millinats, far inside any run's healthy noise
    evidence = RolloutEvidence(mask, engine, trainer)
    report = RolloutGuard(GuardConfig(tolerance_delta=1e-4)).inspect(evidence, step=1)
    assert torch.nonzero(report.suspect).flatten().tolist() == [row]
    assert rule_names(int(report.reasons[row])) == ["tolerance"] and report.metrics["rule/tolerance"] == 1
    within = RolloutGuard(GuardConfig(tolerance_delta=3e-4)).inspect(evidence, step=1)
    assert not within.suspect.any(), "a difference within the tolerance is kept"
    default = RolloutGuard(GuardConfig()).inspect(evidence, step=1)
    assert not default.suspect.any() and not (default.reasons & RULE_BIT["tolerance"]).any(), \
        "without zero tolerance the score and the ceiling keep such a row"
