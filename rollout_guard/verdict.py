"""Verdict: the names of the reasons a rollout is suspect (a bitmask per rollout over :data:`RULES`), in words.

The detector (:mod:`rollout_guard.detector`) sets the bits; this module reads them. The verdict does not depend on
the mode: the mode decides what is done with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from rollout_guard.detector import RULE_BIT, RULES

RULE_TEXT = {
    "nonfinite_engine": "a NaN or infinite engine logprob",
    "nonfinite_trainer": "a NaN or infinite trainer logprob",
    "ceiling": "a token whose |engine − trainer| exceeds the absolute ceiling (ceiling_delta)",
    "score": "the row's disagreements are far likelier if the engine is off than under this run's healthy noise "
             "(score over its threshold)",
    "tolerance": "a token whose |engine − trainer| exceeds the zero tolerance of a bitwise-identical stack "
                 "(tolerance_delta)",
}
"""What each rule means, for legends in reports and charts."""


def rule_names(reasons: int) -> list[str]:
    """The rules whose bit is set in ``reasons``.

    >>> rule_names(RULE_BIT["score"] | RULE_BIT["ceiling"])
    ['ceiling', 'score']
    """
    return [name for name in RULES if reasons & RULE_BIT[name]]


def fired_rules(counts: Mapping[str, int]) -> str:
    """The rules that fired, most rollouts first (ties in :data:`RULES` order), each with its count; ``"none"``.

    >>> fired_rules({"score": 3, "ceiling": 1, "nonfinite_engine": 0})
    'score 3, ceiling 1'
    >>> fired_rules({"score": 0})
    'none'
    """
    fired = sorted(((name, int(count)) for name, count in counts.items() if count),
                   key=lambda item: (-item[1], RULES.index(item[0]) if item[0] in RULES else len(RULES)))
    return ", ".join(f"{name} {count}" for name, count in fired) or "none"


def rule_counts(reasons: torch.Tensor) -> dict[str, int]:
    """How many rollouts each rule fired on (a rollout can count under several rules)."""
    bits = torch.tensor([RULE_BIT[name] for name in RULES], dtype=reasons.dtype, device=reasons.device)
    counts = ((reasons.unsqueeze(-1) & bits) != 0).sum(dim=0)
    return dict(zip(RULES, counts.tolist(), strict=True))


def explain(stats: Mapping[str, float | None], rules: list[str], threshold: float) -> str:
    """One sentence on why a rollout was judged as it was, in the user's words, from its row of statistics
    (:data:`rollout_guard.statistics.SAMPLE_COLUMNS`), the rules that fired and the score's threshold (ln Λ).

    >>> stats = {"score": 25.5, "onset_token": 7, "onset_engine_logprob": -3.5, "onset_trainer_logprob": -12.7,
    ...          "noise_scale": 0.25}
    >>> print(explain(stats, ["score"], 6.9))
    suspect: from token 7 (engine -3.5, trainer -12.7 nats) the engine favours it by 9.2 nats, 37 times this run's healthy noise (0.25 nats); score 25.5 over the threshold 6.9
    """
    def number(name: str) -> float:
        value = stats.get(name)
        return math.nan if value is None else float(value)

    if "nonfinite_engine" in rules or "nonfinite_trainer" in rules:
        side = "engine" if "nonfinite_engine" in rules else "trainer"
        return f"suspect: a NaN or infinite {side} logprob"
    onset, score = number("onset_token"), number("score")
    if not math.isfinite(onset) or onset < 0 or not math.isfinite(score):
        return ("suspect" if rules else "kept") + ": no token to compare"
    engine, trainer, scale = number("onset_engine_logprob"), number("onset_trainer_logprob"), number("noise_scale")
    verdict = "suspect" if rules else "kept"
    where = "over" if score > threshold else "under"
    side = "engine" if engine >= trainer else "trainer"
    gap = abs(engine - trainer)
    line = (f"{verdict}: from token {int(onset)} (engine {engine:.3g}, trainer {trainer:.3g} nats) the {side} favours "
            f"it by {gap:.2g} nats, {gap / scale:.0f} times this run's healthy noise ({scale:.2g} nats); "
            f"score {score:.1f} {where} the threshold {threshold:.1f}")
    if "ceiling" in rules:
        line += f"; a token beyond the absolute ceiling (max |Δ| {number('max_abs_delta'):.3g} nats)"
    return line
