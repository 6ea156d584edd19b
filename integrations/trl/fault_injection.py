"""Fault injection into TRL's vLLM rollouts: the stale-context corruption, for testing the guard end to end."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rollout_guard.errors import GuardError
from rollout_guard.injection import ContextPool, choose_rows, plan_injection


class StaleContextInjector:
    """Corrupts a random subset of rollouts the way stale engine state does.

    Wraps this trainer's vLLM generation: for each selected row, the engine generates (and reports logprobs for)
    the completion from a *foreign* context — the prompt of another request — while TRL attributes it to the
    row's true prompt: the prompt of another group in the batch, or, when the batch is one group (TRL's defaults),
    a prompt from an earlier step (:class:`rollout_guard.injection.ContextPool`). Every row is sent as its own
    request (``n=1``), in colocate and server mode alike.
    ``last_selected`` holds the rows corrupted in the latest generation call (ground truth for scoring).
    ``when``: a fault that depends on engine state: rows are corrupted only in generation calls where ``when()`` is
    true (e.g. after N weight syncs); None: always.
    """

    def __init__(self, trainer: Any, rate: float, seed: int = 0, when: Callable[[], bool] | None = None) -> None:
        if not (isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0.0 <= rate <= 1.0):
            raise GuardError(f"inject_stale_context(rate={rate!r}): use a probability in [0, 1], e.g. rate=0.01")
        if not (isinstance(seed, int) and not isinstance(seed, bool)):
            raise GuardError(f"inject_stale_context(seed={seed!r}): use a whole number")
        if not getattr(trainer, "use_vllm", False):
            raise GuardError("fault injection corrupts vLLM rollouts: set use_vllm=True in GRPOConfig")
        self.trainer = trainer
        self.rate = rate
        self.when = when
        self.generator = torch.Generator().manual_seed(seed * 1000 + trainer.accelerator.process_index)
        self.last_selected: torch.Tensor | None = None
        self.total_injected = 0
        self.pool = ContextPool(seed=seed * 1000 + trainer.accelerator.process_index)
        generation = trainer.vllm_generation
        self._original_generate = generation.generate
        generation.generate = self._generate
        trainer._rollout_guard_injector = self

    def _generate(self, prompts, images=None, num_generations=1, profiler=None):  # noqa: ANN001
        selected = choose_rows(len(prompts), self.rate if self.when is None or self.when() else 0.0, self.generator)
        plan = plan_injection(prompts, selected, group_size=num_generations, pool=self.pool)
        self.last_selected = plan.selected
        self.total_injected += int(plan.selected.sum())
        prompt_ids, completion_ids, logprobs, logprob_token_ids = self._original_generate(
            prompts=plan.contexts, images=images, num_generations=1, profiler=profiler
        )
        return [list(p) for p in prompts], completion_ids, logprobs, logprob_token_ids


def inject_stale_context(trainer: Any, rate: float, seed: int = 0,
                         when: Callable[[], bool] | None = None) -> StaleContextInjector:
    """Turn on fault injection for this trainer (vLLM rollouts): each rollout is corrupted with probability ``rate``
    (only in generation calls where ``when()`` is true, if given)."""
    return StaleContextInjector(trainer, rate=rate, seed=seed, when=when)
