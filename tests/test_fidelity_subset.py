"""A fixed subset of the fidelity benchmark: fails if the default detector regresses on it.

Real H200 rollouts (``benchmarks/fidelity_data``), the same noise conditions and fault zoo as
``benchmarks/fidelity.py``, fewer rollouts. The bounds sit a margin below what the defaults measured on this
subset (see ``measure``'s figures in the assertion messages); release 0.1's thresholds fail them, which shows the
test can fail.
"""

from __future__ import annotations

import glob
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.fidelity import conditions, preset, synthetic_faults  # noqa: E402
from benchmarks.fidelity_kit.rollouts import fixed_subset, read_tables  # noqa: E402
from benchmarks.fidelity_kit.score import replay  # noqa: E402

DATA = sorted(glob.glob(str(REPO / "benchmarks" / "fidelity_data" / "h200-*.parquet")))

# pooled over conditions: the least recall per fault, the most false quarantines per clean rollout
# (measured on this subset, 2026-11-30, after the third session's detector change: gibberish 1.0, NaN 1.0, moderate
# 0.81, late onset 0.76, isolated 0.92, single 0.90, truncated 0.94, real context swap 0.99, real late onset 1.0;
# false: real 0, dense tail 0, hybrid tail 0.0011, top-k 0. Smaller than the benchmark's 256-rollout steps, the
# calibration warms up later here, so the uncalibrated 4-nat spike threshold judges more of the rows than there:
# before that change moderate 0.89, late onset 0.80, single 0.94, hybrid tail false 0.0067, top-k false 0.0022.
# After the fourth session's (unlikely-token spikes, announced sampling changes): moderate 0.80, late onset 0.755,
# isolated 0.92, single 0.91, truncated 0.92, real context swap 0.98; false as before. After the fifth's (spike
# floor 1.5, calibrated drift threshold, both only when told the sampling settings, as replay now does for every
# condition): moderate 0.804, late onset 0.754, isolated 0.921, single 0.911, truncated 0.943, real context swap
# 0.981; false as before. After the sixth's (replay: each setting judged after 20 steps of it, the guard moved on
# with the stream's fault share; restarts on a setting change; centres before histograms; drift floor 3.5):
# moderate 0.928, late onset 0.89, isolated 0.943, single 0.977, truncated 0.969, real context swap 1.0; false:
# real 0, dense tail 0, hybrid tail 0.0011, top-k 0. Release 0.1 on the same replay: late onset 0.19, single
# 0.63, isolated 0.81, false 1.6 / 4.3 / 100 % under the three noise models.)
RECALL_AT_LEAST = {
    "confident_gibberish": 0.99, "nonfinite": 1.0, "moderate_confidence": 0.85, "late_onset": 0.8,
    "isolated_spikes": 0.9, "single_spike": 0.93, "truncated_gibberish": 0.9, "real_context_swap": 0.9,
    "real_late_onset": 0.9,
}
FALSE_AT_MOST = {"real": 0.0, "tail_dense7b": 0.005, "tail_hybrid7b": 0.005, "topk5_high_entropy": 0.005}


def measure(preset_name: str) -> tuple[dict[str, float], dict[str, float]]:
    table = fixed_subset(read_tables(DATA), clean_per_source=300, faulty_per_kind=40, seed=0)
    config = preset(preset_name)
    generator = torch.Generator().manual_seed(0)
    caught: dict[str, list[int]] = {}
    false: dict[str, list[int]] = {}
    for _, clean, real_faults, apply, params in conditions(table, seed=0, step_rows=64):
        faulty = {key: apply(rows) for key, rows in {**synthetic_faults(clean, 60, generator), **real_faults}.items()}
        judged = replay(apply(clean), faulty, config, generator, step_rows=64, fault_share=0.05)
        _, suspect, labels, counted, _ = judged.rows()
        kind = "real" if params["noise"].startswith("real") else params["noise"]
        for name in set(labels):
            rows = torch.tensor([label == name for label in labels]) & counted
            tally = false.setdefault(kind, [0, 0]) if name == "clean" else caught.setdefault(name, [0, 0])
            tally[0] += int((suspect & rows).sum())
            tally[1] += int(rows.sum())
    return ({name: c / n for name, (c, n) in caught.items()}, {kind: f / n for kind, (f, n) in false.items()})


def failures(recall: dict[str, float], false_rate: dict[str, float]) -> list[str]:
    out = [f"recall {name} {recall.get(name, 0.0):.3f} < {bound}" for name, bound in RECALL_AT_LEAST.items()
           if recall.get(name, 0.0) < bound]
    out += [f"false quarantines {kind} {false_rate[kind]:.4f} > {bound}" for kind, bound in FALSE_AT_MOST.items()
            if false_rate[kind] > bound]
    return out


@pytest.mark.skipif(not DATA, reason="benchmarks/fidelity_data has no rollouts")
def test_defaults_hold_on_the_fixed_subset():
    recall, false_rate = measure("defaults")
    assert not failures(recall, false_rate), (recall, false_rate)


@pytest.mark.skipif(not DATA, reason="benchmarks/fidelity_data has no rollouts")
def test_release_0_1_thresholds_fail_the_same_bounds():
    recall, false_rate = measure("v0.1")
    problems = failures(recall, false_rate)
    assert any("late_onset" in p for p in problems) and any("topk5_high_entropy" in p for p in problems), problems


def test_stitched_conditions_keep_every_token_and_put_a_real_late_onset_last():
    """``fidelity.py --stitch 4``: each clean row is 4 of the data's rows of one setting end to end (every token
    kept once, a setting's remainder dropped); a context swap is 4 swaps of its setting; a real late-onset row is
    kept whole, last, after 3 clean rows of its setting."""
    table = fixed_subset(read_tables(DATA), clean_per_source=40, faulty_per_kind=8, seed=0)
    plain = {name: (clean, real) for name, clean, real, _, _ in conditions(table, seed=0, step_rows=64)}
    for name, clean, real, _, _ in conditions(table, seed=0, step_rows=16, stitch=4):
        base, base_real = plain[name]
        assert len(clean) == len(base) // 4 or "/+" in name  # pooled streams: per setting, each rounded down
        kept = clean.engine[clean.mask]
        assert 0 < kept.numel() <= base.engine[base.mask].numel()
        assert torch.isin(kept, base.engine[base.mask]).all()
        late = real.get("real_late_onset")
        if late is not None and len(late):
            own = base_real["real_late_onset"]
            tail = own.lengths
            assert len(late) == len(own) and bool((late.lengths > tail).all())
            ends = late.engine.gather(1, (late.lengths - 1).unsqueeze(1)).squeeze(1)
            assert torch.equal(ends, own.engine.gather(1, (tail - 1).unsqueeze(1)).squeeze(1))
