"""Test capture: host copies of every guarded step, kept when ``attach_guard(..., keep_steps=True)``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rollout_guard.evidence import RolloutEvidence
from rollout_guard.guard import StepReport


def host_tensors(batch: dict[str, Any] | None) -> dict[str, torch.Tensor]:
    return {key: value.detach().cpu().clone() for key, value in (batch or {}).items()
            if isinstance(value, torch.Tensor)}


@dataclass
class GuardedStep:
    """One guarded generation step on this process, kept when ``attach_guard(..., keep_steps=True)``: for checking
    a setup (the tests and ``examples/two_process_grpo.py`` do), not for long runs (it keeps host copies)."""

    step: int
    before: dict[str, torch.Tensor]  # TRL's batch as it built it
    after: dict[str, torch.Tensor]  # the batch the loss saw
    evidence: dict[str, torch.Tensor]  # mask, engine and trainer logprobs the guard judged
    rewards_per_func: torch.Tensor | None  # all processes' rewards, (N, reward functions)
    injected: torch.Tensor | None  # this process's rows corrupted by a fault injector
    report: StepReport
    overhead_seconds: float


def capture_step(before: dict[str, Any], after: dict[str, Any], report: StepReport, evidence: RolloutEvidence | None,
                 rewards: torch.Tensor | None, injector: Any, overhead_seconds: float) -> GuardedStep:
    return GuardedStep(
        step=report.step, before=host_tensors(before), after=host_tensors(after),
        evidence=host_tensors(None if evidence is None else {
            "mask": evidence.mask, "engine": evidence.engine_logprobs, "trainer": evidence.trainer_logprobs}),
        rewards_per_func=None if rewards is None else rewards.detach().cpu().clone(),
        injected=None if injector is None or injector.last_selected is None else injector.last_selected.clone(),
        report=report, overhead_seconds=overhead_seconds,
    )
