"""A fixed subset of the fidelity benchmark: fails if the default detector regresses on it.

Real H200 rollouts (``benchmarks/fidelity_data``), the same noise conditions and fault zoo as
``benchmarks/fidelity.py``, fewer rollouts and 64-rollout steps. The bounds sit a margin below what the defaults
measure on this subset (the figures beside them; ``measure``'s in the assertion messages); a guard whose score
threshold is out of reach (``false_alarm_budget=1e-30``, no ceiling) fails them, which shows the test can fail.
"""

from __future__ import annotations

import glob
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.fidelity import conditions, preset, synthetic_faults, with_overrides  # noqa: E402
from benchmarks.fidelity_kit.rollouts import fixed_subset, read_tables  # noqa: E402
from benchmarks.fidelity_kit.score import replay  # noqa: E402
from rollout_guard.config import GuardConfig  # noqa: E402

DATA = sorted(glob.glob(str(REPO / "benchmarks" / "fidelity_data" / "h200-*.parquet")))

# pooled over conditions: the least recall per fault, the most false quarantines per clean rollout. Measured with
# GuardConfig's defaults (circuit breaker off) on this subset: gibberish 1.0, NaN 1.0, moderate 0.999, late onset
# 0.975, isolated spikes 0.965, single spike 0.971, truncated 1.0, real context swap 0.991, real late onset 1.0 (real
# stale weights 0.0: not corruption a row verdict can tell, left out); false quarantines: real 0, dense-7B tail
# 0.077, hybrid-7B tail 0.016, top-k 0.003 (its offset left in: the subset is judged off the engine's support). The
# tails' false quarantines come from rare 3–13-nat healthy disagreements in a run too short to have shown them on
# the other side (docs/detector.md); the full benchmark's streams are longer. With false_alarm_budget=1e-30 and
# ceiling_delta=None: late onset 0.858, isolated 0.746, single 0.656, moderate 0.973, real context swap 0.903.
RECALL_AT_LEAST = {
    "confident_gibberish": 0.99, "nonfinite": 1.0, "moderate_confidence": 0.98, "late_onset": 0.94,
    "isolated_spikes": 0.93, "single_spike": 0.93, "truncated_gibberish": 0.98, "real_context_swap": 0.95,
    "real_late_onset": 0.9,
}
FALSE_AT_MOST = {"real": 0.0, "softmax_dense7b": 0.1, "softmax_hybrid7b": 0.03, "topk5_high_entropy": 0.01}
BLIND = ["false_alarm_budget=1e-30", "ceiling_delta=None"]  # a score threshold of 69 nats, no ceiling


def measure(config: GuardConfig) -> tuple[dict[str, float], dict[str, float]]:
    """Recall per fault kind and false quarantines per clean rollout by noise kind, pooled over conditions."""
    table = fixed_subset(read_tables(DATA), clean_per_source=300, faulty_per_kind=40, seed=0)
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
    recall, false_rate = measure(preset("defaults"))
    assert set(RECALL_AT_LEAST) <= set(recall) and set(FALSE_AT_MOST) == set(false_rate), (recall, false_rate)
    assert not failures(recall, false_rate), (recall, false_rate)


@pytest.mark.skipif(not DATA, reason="benchmarks/fidelity_data has no rollouts")
def test_a_threshold_out_of_reach_fails_the_same_bounds():
    recall, false_rate = measure(with_overrides(preset("defaults"), BLIND))
    problems = failures(recall, false_rate)
    assert all(any(p.startswith(f"recall {kind} ") for p in problems)
               for kind in ("late_onset", "isolated_spikes", "single_spike")), problems


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
