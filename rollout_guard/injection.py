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


class ContextPool:
    """Recent prompts (token ids) across generation calls: where a foreign context comes from.

    Stale engine state is another request's state, so the foreign context should be another real prompt. With
    TRL's defaults a generation batch can be a single group (every row the same prompt); the pool then offers a
    prompt from an earlier step. Only on the very first call of such a run is there none: the row's own prompt
    with its body shuffled (its last quarter, e.g. a chat template's assistant header, kept in place) stands in,
    so the engine still writes fluent text about the wrong content instead of stopping at once.
    """

    def __init__(self, capacity: int = 256, seed: int = 0) -> None:
        self.capacity = capacity
        self.prompts: list[tuple[int, ...]] = []
        self.generator = torch.Generator().manual_seed(seed)

    def add(self, prompts: Sequence[Sequence[int]]) -> None:
        for prompt in dict.fromkeys(tuple(p) for p in prompts):
            if prompt not in self.prompts:
                self.prompts.append(prompt)
        del self.prompts[: max(len(self.prompts) - self.capacity, 0)]

    def foreign(self, own: Sequence[int], batch: Sequence[Sequence[int]], row: int, group_size: int) -> list[int]:
        """The prompt of the same position in the next group if it differs, else a different prompt from the pool,
        else the own prompt with its body shuffled."""
        own = list(own)
        other = list(batch[(row + group_size) % len(batch)])
        if other != own:
            return other
        candidates = [index for index, prompt in enumerate(self.prompts) if list(prompt) != own]
        if candidates:
            pick = candidates[int(torch.randint(len(candidates), (1,), generator=self.generator))]
            return list(self.prompts[pick])
        return shuffled_body(own, self.generator)


def shuffled_body(prompt: Sequence[int], generator: torch.Generator) -> list[int]:
    """The prompt with its first three quarters permuted (the last quarter, at least one token, kept in place);
    never the prompt itself when it has two different body tokens.

    >>> out = shuffled_body([1, 2, 3, 4, 9], torch.Generator().manual_seed(0))
    >>> out[-1], sorted(out[:-1]), out != [1, 2, 3, 4, 9]
    (9, [1, 2, 3, 4], True)
    """
    prompt = list(prompt)
    body = max(len(prompt) - max(len(prompt) // 4, 1), 0)
    if body < 2 or len(set(prompt[:body])) < 2:
        return prompt[::-1]
    order = torch.randperm(body, generator=generator).tolist()
    shuffled = [prompt[i] for i in order]
    if shuffled == prompt[:body]:
        shuffled = shuffled[1:] + shuffled[:1]
    return shuffled + prompt[body:]


def foreign_context(prompts: Sequence[Sequence[int]], row: int, group_size: int,
                    pool: ContextPool | None = None) -> list[int]:
    """The prompt of the same position in the next group (another request); without one, a prompt from ``pool``
    (earlier steps) or the own prompt with its body shuffled (:class:`ContextPool`)."""
    return (pool or ContextPool()).foreign(prompts[row], prompts, row, group_size)


def plan_injection(prompts: Sequence[Sequence[int]], selected: torch.Tensor, group_size: int,
                   pool: ContextPool | None = None) -> InjectionPlan:
    """Which context each row is generated from; ``pool`` (updated with this call's prompts afterwards) offers
    foreign prompts from earlier calls."""
    pool = pool if pool is not None else ContextPool()
    rows = selected.tolist()
    contexts = [pool.foreign(prompts[row], prompts, row, group_size) if chosen else list(prompts[row])
                for row, chosen in enumerate(rows)]
    pool.add(prompts)
    return InjectionPlan(selected=selected.clone(), contexts=contexts)
