"""Where the guard misses late onset under the tail models (twenty-sixth session): replays `fidelity.py`'s told run
(seed 0, on the engine's support, 1,000 faults per condition) and, for each tail stream, prints the missed
late-onset rows (tokens, spike margin, drift CUSUM, the drift threshold they were judged with, the joint sum) and
how far the healthy rows judged at the uncalibrated drift threshold went.

    python benchmarks/results-2026-12-03-twentysixth/where_late_onset_is_missed.py [--seed 0] [--set FIELD=VALUE]
"""

import glob
import sys
from pathlib import Path

import torch
import typer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.fidelity import DEFAULT_DATA, conditions, preset, synthetic_faults, with_overrides  # noqa: E402
from benchmarks.fidelity_kit.rollouts import read_tables  # noqa: E402
from benchmarks.fidelity_kit.score import replay  # noqa: E402
from rollout_guard.statistics import COLUMN  # noqa: E402


def main(seed: int = 0, overrides: list[str] = typer.Option([], "--set")) -> None:
    config = with_overrides(preset("defaults"), overrides)
    table = read_tables(sorted(glob.glob(DEFAULT_DATA)))
    generator = torch.Generator().manual_seed(seed)  # every condition in order: the same draws as fidelity.py
    for name, clean, real_faults, apply, _ in conditions(table, seed, 256, True, 1):
        faulty = {k: apply(r) for k, r in {**synthetic_faults(clean, 1000, generator), **real_faults}.items()}
        judged = replay(apply(clean), faulty, config, generator, step_rows=256, fault_share=0.02,
                        mask_truncated=False, device="cpu", announce_sampling=True, warmup_steps=20)
        if "tail" not in name:
            continue
        samples, suspect, labels, counted, _ = judged.rows()
        threshold = judged.drift_thresholds().float()
        margin, cusum = samples[:, COLUMN["spike_margin"]], samples[:, COLUMN["drift_cusum"]]
        joint = margin + config.joint_drift_weight * (cusum - threshold)
        late = torch.tensor([label == "late_onset" for label in labels]) & counted & ~suspect
        healthy = torch.tensor([label == "clean" for label in labels])
        uncalibrated = min(config.drift_threshold,  # with variants/uncalibrated-drift-4.diff applied, its field
                           getattr(config, "uncalibrated_drift_threshold", config.drift_threshold))
        early = healthy & (threshold == uncalibrated)  # judged before the run's own was read
        print(f"{name}: {int(late.sum())} late-onset rows missed; {int(early.sum())} of {int(healthy.sum())} healthy "
              f"judgements before the drift threshold is read, their CUSUM at most {float(cusum[early].max()):.2f}")
        for i in late.nonzero().flatten().tolist():
            print(f"  tokens {int(samples[i, COLUMN['tokens']]):4d}  spike margin {float(margin[i]):6.2f}  "
                  f"CUSUM {float(cusum[i]):5.2f}  drift threshold {float(threshold[i]):4.2f}  joint {float(joint[i]):6.2f}")


if __name__ == "__main__":
    typer.run(main)
