"""A prototype, in the benchmark's replay only: the guard plus a change-point rule, to see what the rule would do
inside the guard's own flow (warm-up, changes of setting, faults among the rows it learns from).

Not the library: a wrapper around ``RolloutGuard`` (CPU, pure torch, a per-step host read of its own) that
``fidelity.py``'s replay builds instead of the guard. Per step, after the guard's verdict:

* each row's ln Λ of ``changepoint_every_condition.py`` (generic lag, closed form), with each 0.25-nat engine bin's
  mean and sd read from the tokens of the rows kept in earlier steps since the last change of setting (a bin with
  fewer than ``MIN_BIN_TOKENS`` is not read; tokens below −3 nats and clamped trainer logprobs never are);
* the rule fires above ln 1000 (Markov: ≤ 0.1 % of clean rows if the per-bin Gaussian holds) until ``MIN_ROWS``
  rows have been scored since the change, then above the (1 − ``BUDGET``) point of those rows' scores (every row
  the guard's own rules kept, the ones this rule alone flagged included, so that the reading cannot only fall),
  never above ln 1000;
* a fired row is quarantined as the guard's own are; the rows then kept feed the bins.

    python benchmarks/results-2026-12-03-twentyeighth/changepoint_rule_prototype.py --same-support --out DIR
    (any fidelity.py option; the guard's figures with the rule, in DIR/results-defaults.json; the environment
    variables CHANGEPOINT_BUDGET and CHANGEPOINT_MIN_ROWS change those two constants)
"""

from __future__ import annotations

import copy
import functools
import math
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

import changepoint_every_condition as cp  # noqa: E402

from benchmarks import fidelity  # noqa: E402
from benchmarks.likelihood_bound import LEARNED_CLIP, LEARNED_EDGES, binned_moments, binned_sums  # noqa: E402
from rollout_guard import RolloutGuard  # noqa: E402

MIN_BIN_TOKENS = 200  # tokens a bin needs before it is read
MIN_ROWS = int(os.environ.get("CHANGEPOINT_MIN_ROWS", 2000))  # scored rows since a change of setting before the
# threshold is read from them
BUDGET = float(os.environ.get("CHANGEPOINT_BUDGET", 0.0005))  # the share of kept rows' scores above the read threshold
CEILING = math.log(1000.0)
BINS = len(LEARNED_EDGES) + 1


def scores(engine: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """(B,) ln Λ (:func:`changepoint_every_condition.log_lr`) against the bins' (count, Σx, Σx²) ``sums``, a bin
    read once it holds ``MIN_BIN_TOKENS``; −inf for a row with no read token."""
    mean, sd = binned_moments(sums)
    return cp.log_lr(engine, trainer, mask, mean, sd, readable=sums[:, 0] >= MIN_BIN_TOKENS)


class ChangepointGuard:
    """``RolloutGuard`` and the prototype rule; ``state_dict`` / ``load_state_dict`` cover both (the replay's
    phase 2 judges a step, puts the state back and moves on with fewer faults)."""

    def __init__(self, config, device: str = "cpu") -> None:
        self.guard = RolloutGuard(config, device=device)
        self.sampling = None
        self.sums = torch.zeros(BINS, 3, dtype=torch.float64)
        self.kept_scores = torch.zeros(0, dtype=torch.float64)
        self.fired = 0

    def threshold(self) -> float:
        if len(self.kept_scores) < MIN_ROWS:
            return CEILING
        rank = int(BUDGET * len(self.kept_scores))
        return min(CEILING, float(self.kept_scores.sort(descending=True).values[rank]))

    def inspect(self, evidence, step: int, sampling=None, **kwargs):
        settings = tuple(sampling) if sampling is not None else None
        if settings is not None and self.sampling is not None and settings != self.sampling:
            self.sums.zero_()
            self.kept_scores = torch.zeros(0, dtype=torch.float64)
        self.sampling = settings if settings is not None else self.sampling
        report = self.guard.inspect(evidence, step=step, sampling=sampling, **kwargs)
        engine, trainer = evidence.engine_logprobs.cpu(), evidence.trainer_logprobs.cpu()
        mask = evidence.mask.cpu().bool()
        row = scores(engine, trainer, mask, self.sums)
        fired = row > self.threshold()
        self.fired += int((fired & ~report.suspect).sum())
        others_kept = ~report.suspect
        report.suspect = report.suspect | fired
        report.quarantined = report.quarantined | fired
        self.kept_scores = torch.cat([self.kept_scores, row[others_kept & torch.isfinite(row)]])
        kept = ~report.suspect
        self.sums += binned_sums(engine, trainer, mask & kept[:, None], LEARNED_EDGES, LEARNED_CLIP)
        return report

    def state_dict(self) -> dict:
        return {"guard": self.guard.state_dict(), "sampling": self.sampling, "sums": self.sums.clone(),
                "kept_scores": self.kept_scores.clone(), "fired": self.fired}

    def load_state_dict(self, state: dict) -> None:
        self.guard.load_state_dict(state["guard"])
        self.sampling, self.fired = state["sampling"], state["fired"]
        self.sums, self.kept_scores = state["sums"].clone(), state["kept_scores"].clone()


if __name__ == "__main__":
    fidelity.replay = functools.partial(fidelity.replay, make_guard=lambda config: ChangepointGuard(copy.copy(config)))
    fidelity.app()
