"""Fault injection, engine-agnostic part: which rollouts to corrupt and which foreign context to use.

The corruption imitates stale engine state (vLLM PR #32118, where a new request read the SSM state another
request left in a recycled cache slot): the engine generates the sample's tokens, and reports their logprobs,
conditioned on a context other than the prompt the sample is attributed to. The trainer then scores those
tokens under the true prompt. The engine-facing parts live in ``rollout_guard.integrations``: ``trl``
(vLLM rollouts in TRL), ``hf_rollouts`` (transformers rollouts) and ``vllm_tools`` (``rollout-guard audit``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class InjectionPlan:
    """Rows to corrupt in one generation call and the context each one is generated from instead."""

    selected: torch.Tensor  # (B,) bool
    contexts: list[list[int]]  # (B,) prompt token ids actually sent to the engine


def choose_rows(batch_size: int, rate: float, generator: torch.Generator) -> torch.Tensor:
    """Independent Bernoulli(rate) draw per row, from a seeded generator (reproducible per call sequence)."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate={rate!r}: use a probability in [0, 1]")
    return torch.rand(batch_size, generator=generator) < rate


def foreign_context(prompts: Sequence[Sequence[int]], row: int, group_size: int) -> list[int]:
    """The prompt of the same position in the next group (another request), or the reversed prompt when that
    is the same text (a batch of one group, or duplicated prompts)."""
    own = list(prompts[row])
    other = list(prompts[(row + group_size) % len(prompts)])
    return other if other != own else own[::-1]


def plan_injection(prompts: Sequence[Sequence[int]], selected: torch.Tensor, group_size: int) -> InjectionPlan:
    rows = selected.tolist()
    contexts = [foreign_context(prompts, row, group_size) if chosen else list(prompts[row]) for row, chosen in enumerate(rows)]
    return InjectionPlan(selected=selected.clone(), contexts=contexts)
