"""Scoring: Wilson intervals, and the replay of clean and faulty rollouts through the guard as training steps."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from benchmarks.fidelity_kit.rollouts import Rollouts, cat
from rollout_guard.config import GuardConfig
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.guard import RolloutGuard
from rollout_guard.verdict import rule_firings

GOAL_RECALL = 0.999  # of corrupted rollouts
GOAL_FALSE_RATE = 0.001  # false quarantines per clean rollout


def wilson(successes: int, total: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score 95 % interval of a binomial proportion.

    .. math:: \\frac{\\hat p + z^2/2n \\pm z\\sqrt{\\hat p(1-\\hat p)/n + z^2/4n^2}}{1 + z^2/n}

    >>> [round(x, 4) for x in wilson(0, 1000)]
    [0.0, 0.0038]
    >>> [round(x, 4) for x in wilson(999, 1000)]
    [0.9944, 0.9998]
    """
    if total == 0:
        return (math.nan, math.nan)
    p = successes / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))


@dataclass
class Judged:
    """Per-sample statistics and verdicts of every judged row, with its label."""

    samples: list[torch.Tensor] = field(default_factory=list)  # (n, columns) per step
    suspect: list[torch.Tensor] = field(default_factory=list)  # (n,) bool
    label: list[list[str]] = field(default_factory=list)  # "clean" or the fault name, per row
    counted: list[torch.Tensor] = field(default_factory=list)  # (n,) bool: counts towards the figures
    tokens: list[torch.Tensor] = field(default_factory=list)  # (n,) tokens per row
    drift: list[torch.Tensor] = field(default_factory=list)  # (n,) the drift threshold each row was judged with

    def add(self, samples: torch.Tensor, suspect: torch.Tensor, labels: list[str], counted: torch.Tensor,
            tokens: torch.Tensor, drift_threshold: float | None = None) -> None:
        self.samples.append(samples)
        self.suspect.append(suspect)
        self.label.append(labels)
        self.counted.append(counted)
        self.tokens.append(tokens)
        self.drift.append(torch.full((len(labels),), math.inf if drift_threshold is None else drift_threshold,
                                     dtype=torch.float64))

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, list[str], torch.Tensor, torch.Tensor]:
        labels = [label for step in self.label for label in step]
        return (torch.cat(self.samples), torch.cat(self.suspect), labels, torch.cat(self.counted),
                torch.cat(self.tokens))

    def drift_thresholds(self) -> torch.Tensor:
        """(N,) float64 nats: the (calibrated) drift threshold each row was judged with."""
        return torch.cat(self.drift)


def _evidence(rows: Rollouts, injected: torch.Tensor, judge_truncated: bool, device: str = "cpu") -> RolloutEvidence:
    mask = rows.mask if judge_truncated else rows.mask & ~rows.truncated.unsqueeze(1)
    return RolloutEvidence(mask=mask.to(device), engine_logprobs=rows.engine.to(device), trainer_logprobs=rows.trainer.to(device),
                           injected=injected.to(device))


def replay(clean: Rollouts, faulty: dict[str, Rollouts], config: GuardConfig, generator: torch.Generator,
           step_rows: int = 256, fault_share: float = 0.02, mask_truncated: bool = False,
           make_guard=None, device: str = "cpu", announce_sampling: bool = True) -> Judged:
    """Feed one noise condition to a fresh guard as a stream of training steps.

    Phase 1 streams every clean row once, in data order, ``step_rows`` per step, with ``fault_share`` of each step
    taken from the faulty pools (round-robin over fault kinds), so calibration sees a realistic fault rate.
    Phase 2 judges the remaining faulty rows, a quarter of each step, beside resampled clean rows that fill the
    step and are not counted (false quarantines are counted on unique clean rows only).
    ``mask_truncated``: TRL's ``mask_truncated_completions=True`` zeroes truncated rows' loss mask before the guard.
    With ``announce_sampling`` the guard is told each phase-1 step's sampling setting, as the TRL adapter does every
    step (the same one throughout for a single-setting condition); a pooled stream (``clean.setting``) changes
    setting between steps: phase 1 cuts its steps where the setting changes; phase 2 mixes settings within a step
    and passes none (the guard carries on with what it was last told).
    """
    guard = make_guard(config) if make_guard is not None else RolloutGuard(config, device=device)
    judged = Judged()
    names = list(faulty)
    cursors = dict.fromkeys(names, 0)
    clean = clean.rows(torch.argsort(clean.step, stable=True))  # data order, so each step is a slice
    per_step_faults = max(1, round(fault_share * step_rows)) if names else 0
    turn = 0

    def take_faults(count: int) -> tuple[list[Rollouts], list[str]]:
        """``count`` faulty rows, round-robin over the fault kinds that have rows left (one slice per kind)."""
        nonlocal turn
        wanted = dict.fromkeys(names, 0)
        for _ in range(count):
            left = [name for name in names if cursors[name] + wanted[name] < len(faulty[name])]
            if not left:
                break
            wanted[left[turn % len(left)]] += 1
            turn += 1
        parts, labels = [], []
        for name, number in wanted.items():
            if number:
                parts.append(faulty[name].rows(slice(cursors[name], cursors[name] + number)))
                labels += [name] * number
                cursors[name] += number
        return parts, labels

    def judge(parts: list[Rollouts], labels: list[str], counted: torch.Tensor, step: int, sampling=None) -> None:
        rows = cat(parts)
        injected = torch.tensor([label != "clean" for label in labels])
        report = guard.inspect(_evidence(rows, injected, not mask_truncated, device), step=step, sampling=sampling)
        judged.add(report.samples, report.suspect, labels, counted, rows.mask.sum(-1), report.drift_threshold)

    step = 0
    clean_step_rows = step_rows - per_step_faults
    setting = clean.setting if clean.setting is not None else torch.zeros(len(clean), dtype=torch.long)
    changes = (torch.nonzero(setting[1:] != setting[:-1]).flatten() + 1).tolist()
    for run_start, run_stop in zip([0, *changes], [*changes, len(clean)], strict=True):  # one setting each
        sampling = (int(setting[run_start]),) if announce_sampling else None  # one setting: the same every step
        for start in range(run_start, run_stop, clean_step_rows):
            index = slice(start, min(start + clean_step_rows, run_stop))
            parts, labels = take_faults(per_step_faults)
            parts = [clean.rows(index), *parts]
            labels = ["clean"] * (index.stop - index.start) + labels
            step += 1
            judge(parts, labels, torch.ones(len(labels), dtype=torch.bool), step, sampling)

    fill = step_rows - step_rows // 4
    while any(cursors[name] < len(faulty[name]) for name in names):
        parts, labels = take_faults(step_rows // 4)
        index = torch.randint(0, len(clean), (fill,), generator=generator)
        counted = torch.tensor([False] * fill + [True] * len(labels))
        step += 1
        judge([clean.rows(index), *parts], ["clean"] * fill + labels, counted, step)
    return judged


def figures(judged: Judged, config: GuardConfig) -> dict[str, dict]:
    """Recall per fault and false quarantines of clean rows, with Wilson intervals and PASS/FAIL, and which rules
    fired on the false quarantines and which would have caught the faults."""
    samples, verdict, labels, counted, tokens = judged.rows()
    firings = rule_firings(samples, config, judged.drift_thresholds())
    out: dict[str, dict] = {}
    for name in sorted(set(labels)):
        rows = torch.tensor([label == name for label in labels]) & counted
        total = int(rows.sum())
        flagged = int((verdict & rows).sum())
        if name == "clean":
            low, high = wilson(flagged, total)
            clean_tokens = int(tokens[rows].sum())
            out[name] = {"rows": total, "tokens": clean_tokens, "false": flagged, "false_rate": flagged / max(total, 1),
                         "ci": [low, high], "false_per_m_tokens": flagged / max(clean_tokens, 1) * 1e6,
                         "pass": flagged / max(total, 1) <= GOAL_FALSE_RATE, "ci_pass": high <= GOAL_FALSE_RATE,
                         "rules": {rule: int((fired & rows).sum()) for rule, fired in firings.items() if (fired & rows).any()}}
        else:
            low, high = wilson(flagged, total)
            out[name] = {"rows": total, "caught": flagged, "recall": flagged / max(total, 1), "ci": [low, high],
                         "pass": flagged / max(total, 1) >= GOAL_RECALL, "ci_pass": low >= GOAL_RECALL,
                         "rules": {rule: int((fired & rows).sum()) for rule, fired in firings.items() if (fired & rows).any()}}
    return out
