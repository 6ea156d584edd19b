"""Where the twenty-eighth session's change-point prototype still misses late onset: for every late-onset row (the
synthetic kind and the real one) that neither the guard nor the prototype's rule quarantined, the threshold the
rule judged it with, how many kept rows of its setting that threshold was read from (ln 1000 until
``MIN_ROWS``), how many of its tokens sat in a bin the rule could read, and its score.

Runs ``fidelity.py``'s replay with ``changepoint_rule_prototype.ChangepointGuard`` (any fidelity.py option and the
prototype's environment variables apply), prints one line per missed row and writes them to
``DIR/missed-late-onset.json`` beside fidelity's own results.

    python benchmarks/results-2026-12-04-thirtieth/where_prototype_misses.py --same-support --out DIR
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PROTOTYPE = HERE.parent / "results-2026-12-03-twentyeighth"
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(PROTOTYPE))

import changepoint_rule_prototype as proto  # noqa: E402

from benchmarks import fidelity  # noqa: E402

LATE = ("late_onset", "real_late_onset")
MISSED: list[dict] = []
CURRENT = {"condition": None}


class Diagnosed(proto.ChangepointGuard):
    """The prototype, recording each judged step (not phase 2's feed calls, which follow a ``load_state_dict``)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.log: list[dict] = []
        self.feeding = False

    def threshold(self) -> float:
        value = super().threshold()
        self.last = {"threshold": value, "kept_rows": len(self.kept_scores)}
        return value

    def inspect(self, evidence, step: int, sampling=None, **kwargs):
        report = super().inspect(evidence, step=step, sampling=sampling, **kwargs)
        if not self.feeding:
            readable = (self.sums[:, 0] >= proto.MIN_BIN_TOKENS).clone()
            self.log.append({**self.last, **SCORED, "step": step, "sampling": sampling, "suspect": report.suspect,
                             "readable_bins": int(readable.sum())})
        self.feeding = False
        return report

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.feeding = True


SCORED: dict = {}
_scores = proto.scores


def recorded_scores(engine, trainer, mask, sums):
    """:func:`changepoint_rule_prototype.scores`, keeping each row's score and its read tokens for the log."""
    row = _scores(engine, trainer, mask, sums)
    index = torch.bucketize(engine.double(), proto.LEARNED_EDGES)
    readable = (sums[:, 0] >= proto.MIN_BIN_TOKENS)[index] & mask & (engine >= -3.0)
    SCORED.update(score=row, read_tokens=readable.sum(-1), tokens=mask.sum(-1))
    return row


def replay(*args, **kwargs):
    guards: list[Diagnosed] = []

    def make_guard(config):
        guards.append(Diagnosed(copy.copy(config)))
        return guards[-1]

    judged = fidelity_replay(*args, **kwargs, make_guard=make_guard)
    (guard,) = guards
    assert len(guard.log) == len(judged.label), (len(guard.log), len(judged.label))
    for entry, labels in zip(guard.log, judged.label, strict=True):
        for i, label in enumerate(labels):
            if label in LATE and not bool(entry["suspect"][i]):
                row = {"condition": CURRENT["condition"], "label": label, "step": entry["step"], "row": i,
                       "sampling": entry["sampling"], "threshold": round(entry["threshold"], 3),
                       "kept_rows": entry["kept_rows"], "readable_bins": entry["readable_bins"],
                       "score": round(float(entry["score"][i]), 3), "tokens": int(entry["tokens"][i]),
                       "read_tokens": int(entry["read_tokens"][i])}
                MISSED.append(row)
                print("missed", json.dumps(row), flush=True)
    return judged


def named_conditions(*args, **kwargs):
    for item in fidelity_conditions(*args, **kwargs):
        CURRENT["condition"] = item[0]
        yield item


fidelity_replay, fidelity_conditions = fidelity.replay, fidelity.conditions
proto.scores = recorded_scores

if __name__ == "__main__":
    fidelity.replay, fidelity.conditions = replay, named_conditions
    out = Path(sys.argv[sys.argv.index("--out") + 1]) if "--out" in sys.argv else Path("runs/fidelity")
    try:
        fidelity.app(standalone_mode=False)
    finally:
        out.mkdir(parents=True, exist_ok=True)
        (out / "missed-late-onset.json").write_text(json.dumps(MISSED, indent=1) + "\n")
