"""Batched re-scoring: same logprobs as the per-sample loop, with one forward pass per batch, rows in input order."""

from __future__ import annotations

import random

import pytest
import torch

from rollout_guard.integrations.rescoring import length_batches, rescore, rescore_per_sample


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def rollouts(count: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, 31) for _ in range(rng.randint(1, 12))] for _ in range(count)]
    completions = [[rng.randrange(4, 31) for _ in range(rng.randint(0, 20))] for _ in range(count)]
    return prompts, completions


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_batched_matches_the_per_sample_loop_with_few_forward_passes(model, temperature):
    prompts, completions = rollouts(40)
    assert any(len(c) == 0 for c in completions)
    calls = []
    handle = model.register_forward_hook(lambda module, args, output: calls.append(1))
    try:
        batched = rescore(model, prompts, completions, temperature, max_batch_tokens=256, max_batch_rows=16)
    finally:
        handle.remove()
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    assert len(calls) == len(length_batches(lengths, 256, 16)) < len(prompts) // 4
    reference = rescore_per_sample(model, prompts, completions, temperature)
    for got, want, completion in zip(batched, reference, completions, strict=True):
        assert len(got) == len(want) == len(completion)
        assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5)


def test_length_batches_respect_both_limits_and_keep_every_row():
    rng = random.Random(1)
    lengths = [rng.randint(1, 50) for _ in range(200)]
    batches = length_batches(lengths, max_batch_tokens=300, max_batch_rows=7)
    assert sorted(i for batch in batches for i in batch) == list(range(200))
    for batch in batches:
        assert len(batch) <= 7 and (len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 300)
    assert length_batches([500], max_batch_tokens=10, max_batch_rows=4) == [[0]]  # longer than the budget: alone


def test_mismatched_rows_raise(model):
    with pytest.raises(ValueError, match="prompts and completions"):
        rescore(model, [[5, 6]], [[7], [8]])
