"""Which kept rows set the ``changepoint`` threshold: the faults the guard missed, or healthy rows?

Replays the named noise conditions of the fidelity benchmark (``benchmarks/fidelity.py``'s own conditions, synthetic
faults and replay, at the default configuration, told, ``--same-support``) with the guard's change-point histogram
shadowed by label: every kept row's score is also binned into a histogram of faulty rows and one of clean rows, decayed
alike, reset with the real one and put back with it where the replay puts the guard's state back. At each step, beside
the threshold the step is judged with (read from all kept rows), the threshold the same reading gives from the clean
rows alone. It counts the late-onset rows the guard missed that the clean-only reading would have caught, and the
clean rows that reading would have flagged in addition.

Each condition is replayed alone, its faults drawn afresh (``--seed``), so its rows are not those of a full run of
the benchmark at that seed.

    python benchmarks/results-2026-12-05-fortyfirst/what_sets_the_threshold.py --fault-share 0.02 --seed 7
"""

import glob
import json
import sys
from pathlib import Path

import torch
import typer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import rollout_guard.calibration as cal  # noqa: E402
from benchmarks.fidelity import DEFAULT_DATA, _guard, conditions, preset, synthetic_faults  # noqa: E402
from benchmarks.fidelity_kit.rollouts import read_tables  # noqa: E402
from benchmarks.fidelity_kit.score import replay  # noqa: E402
from rollout_guard.statistics import COLUMN  # noqa: E402
from rollout_guard.verdict import RULE_BIT  # noqa: E402

TARGETS = ("h200-hybrid-seed1/+tail_hybrid7b", "h200-llama/+tail_hybrid7b")
EMPTY = [0.0] * cal.NUM_CHANGEPOINT_BINS


class Shadow:
    """The change-point histogram split by label, fed by the same calls as the real one."""

    def __init__(self) -> None:
        self.reset()
        self.labels: dict[int, torch.Tensor] = {}  # id(kept scores) → (n,) bool: faulty

    def reset(self) -> None:
        self.fault, self.fault_rows, self.clean, self.clean_rows = list(EMPTY), 0.0, list(EMPTY), 0.0

    def state(self) -> tuple:
        return list(self.fault), self.fault_rows, list(self.clean), self.clean_rows

    def load(self, state: tuple) -> None:
        self.fault, self.fault_rows, self.clean, self.clean_rows = list(state[0]), state[1], list(state[2]), state[3]


SHADOW = Shadow()
_histogram = cal._decayed_histogram


def _shadowed(histogram, rows, values, edges, decay):
    out = _histogram(histogram, rows, values, edges, decay)
    if edges is cal._CHANGEPOINT_EDGES_HOST:
        if rows == 0.0 and not any(histogram):  # the real one was reset (a restart): so are the shadows
            SHADOW.reset()
        faulty = SHADOW.labels.pop(id(values))
        SHADOW.fault, SHADOW.fault_rows = _histogram(SHADOW.fault, SHADOW.fault_rows, values[faulty], edges, decay)
        SHADOW.clean, SHADOW.clean_rows = _histogram(SHADOW.clean, SHADOW.clean_rows, values[~faulty], edges, decay)
        assert abs(out[1] - SHADOW.fault_rows - SHADOW.clean_rows) < 1e-6 * max(out[1], 1.0)
        assert max(abs(a - b - c) for a, b, c in zip(out[0], SHADOW.fault, SHADOW.clean)) < 1e-6 * max(out[1], 1.0)
    return out


cal._decayed_histogram = _shadowed


def make_guard(config, per_token_offset):
    """A benchmark guard whose calibration's change-point histogram is shadowed by label. Its ``defer`` (the kept
    rows' contributions, applied at once or at the next step) is called after ``inspect`` returns instead of inside
    it, when the rows it scored are known: the next step's threshold is read from the same state either way (checked
    against each report's)."""
    guard = _guard(config, "cpu", per_token_offset)
    records = guard.records = []
    defer, inspect = guard.calibration.defer, guard.inspect
    state_dict, load_state_dict = guard.state_dict, guard.load_state_dict
    postponed = []

    def inspected(evidence, step, **kwargs):
        budget = guard.config.changepoint_budget
        rows = guard.calibration._changepoint_rows
        if rows == 0.0:  # reset since its last update
            SHADOW.reset()
        assert abs(rows - SHADOW.fault_rows - SHADOW.clean_rows) < 1e-6 * max(rows, 1.0)
        reading = cal.changepoint_threshold(guard.calibration._changepoint, rows, budget)
        clean_only = cal.changepoint_threshold(SHADOW.clean, SHADOW.clean_rows, budget)
        above = [sum(h[b] for b in range(len(h)) if cal.CHANGEPOINT_EDGES[b] >= reading)
                 for h in (SHADOW.fault, SHADOW.clean)]
        injected = evidence.injected.bool().cpu()
        restarts = guard.calibration_resets
        report = inspect(evidence, step, **kwargs)
        if guard.calibration_resets != restarts:  # a new sampling setting: judged from a fresh calibration
            SHADOW.reset()
            reading = clean_only = report.changepoint_threshold
            rows, above = 0.0, [0.0, 0.0]
        elif report.changepoint_threshold is not None:
            assert abs(report.changepoint_threshold - reading) < 1e-9, (report.changepoint_threshold, reading)
        (args,) = postponed
        postponed.clear()
        kept = args[4]
        if kept is not None:
            scored = (report.reasons & ~RULE_BIT["changepoint"]) == 0
            assert len(kept) == int(scored.sum())
            SHADOW.labels[id(kept)] = injected[scored]
        defer(*args)
        records.append({"reading": report.changepoint_threshold, "clean_only": clean_only,
                        "fault_above": above[0], "clean_above": above[1], "rows": rows,
                        "scores": report.samples[:, COLUMN["changepoint_score"]].clone(), "suspect": report.suspect,
                        "move_on": guard._move_on})
        guard._move_on = False
        return report

    def pending_scores():
        pending = guard.calibration._pending
        return None if pending is None else pending[4]

    def saved():
        kept = pending_scores()
        guard._saved = SHADOW.state(), None if kept is None else SHADOW.labels[id(kept)]
        return state_dict()

    def loaded(state):
        load_state_dict(state)  # the held step comes back as new tensors: its labels go with them
        shadow, labels = guard._saved
        SHADOW.load(shadow)
        SHADOW.labels.clear()
        kept = pending_scores()
        if kept is not None:
            SHADOW.labels[id(kept)] = labels
        guard._move_on = True  # the next inspect moves the guard on; the one before was the judged step

    guard._move_on = False
    guard.calibration.defer = lambda *args: postponed.append(args + (None,) * (5 - len(args)))
    guard.inspect = inspected
    guard.state_dict, guard.load_state_dict = saved, loaded
    return guard


def main(fault_share: float = typer.Option(0.02), seed: int = typer.Option(7),
         faults_per_condition: int = typer.Option(4000), out: Path = typer.Option(None)) -> None:
    config = preset("defaults")
    table = read_tables(sorted(glob.glob(DEFAULT_DATA)))
    generator = torch.Generator().manual_seed(seed)
    summary = {}
    for name, clean, real, apply, _ in conditions(table, seed, 256, True, 1, "surprise"):
        if name not in TARGETS:
            continue
        faulty = {key: apply(rows) for key, rows in {**synthetic_faults(clean, faults_per_condition, generator),
                                                     **real}.items()}
        guards = []

        def factory(cfg, guards=guards):
            guards.append(make_guard(cfg, per_token_offset=False))
            return guards[-1]

        SHADOW.reset()
        judged = replay(apply(clean), faulty, config, generator, fault_share=fault_share, make_guard=factory)
        records = [r for r in guards[0].records if not r["move_on"]]
        assert len(records) == len(judged.label)
        missed = caught_clean_only = extra_clean = clean_judged = mature = contaminated = 0
        fault_above = clean_above = 0.0
        for record, labels in zip(records, judged.label, strict=True):
            if record["reading"] is None:
                continue
            scores, suspect = record["scores"], record["suspect"]
            late = torch.tensor([label == "late_onset" for label in labels])
            healthy = torch.tensor([label == "clean" for label in labels])
            missed_here = late & ~suspect
            missed += int(missed_here.sum())
            caught_clean_only += int((missed_here & (scores > record["clean_only"])).sum())
            extra_clean += int((healthy & ~suspect & (scores > record["clean_only"])).sum())
            clean_judged += int(healthy.sum())
            if record["rows"] >= cal.MIN_CHANGEPOINT_ROWS:
                mature += 1
                contaminated += record["reading"] > record["clean_only"]
                fault_above += record["fault_above"]
                clean_above += record["clean_above"]
        summary[name] = {"late_onset_missed_while_judged": missed,
                         "of_them_above_the_clean_only_reading": caught_clean_only,
                         "clean_judgements": clean_judged,
                         "clean_judgements_the_clean_only_reading_would_add": extra_clean,
                         "steps_with_a_mature_reading": mature,
                         "of_them_reading_above_the_clean_only_one": contaminated,
                         "faulty_share_of_the_kept_mass_at_or_above_the_reading": fault_above / max(
                             fault_above + clean_above, 1e-12)}
        print(name, json.dumps(summary[name]), flush=True)
    if out is not None:
        out.write_text(json.dumps({"fault_share": fault_share, "seed": seed,
                                   "faults_per_condition": faults_per_condition, "conditions": summary}, indent=1))


if __name__ == "__main__":
    typer.run(main)
