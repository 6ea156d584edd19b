"""Which late-onset rows the guard still misses under the hybrid-7B tail model, at the defaults (thirty-third
session): replays `fidelity.py`'s told run (on the engine's support, `--faults-per-condition`, the same draws) and,
for each hybrid-7B-tail condition, prints every missed late-onset row — its tokens, its change-point score and the
threshold it was judged with (inf: the rule did not judge that step), its drift CUSUM and threshold, its spike
margin — and, for scale, the clean rows' largest change-point score over its threshold.

    python benchmarks/results-2026-12-04-thirtythird/where_late_onset_is_missed_now.py [--seed 0]
        [--faults-per-condition 4000] [--set FIELD=VALUE]
"""

import functools
import glob
import json
import sys
from pathlib import Path

import torch
import typer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.fidelity import DEFAULT_DATA, _guard, conditions, preset, synthetic_faults, with_overrides  # noqa: E402
from benchmarks.fidelity_kit.rollouts import read_tables  # noqa: E402
from benchmarks.fidelity_kit.score import replay  # noqa: E402
from rollout_guard.statistics import COLUMN  # noqa: E402


def main(seed: int = 0, faults_per_condition: int = 4000, overrides: list[str] = typer.Option([], "--set"),
         out: Path = typer.Option(None)) -> None:
    config = with_overrides(preset("defaults"), overrides)
    table = read_tables(sorted(glob.glob(DEFAULT_DATA)))
    generator = torch.Generator().manual_seed(seed)  # every condition in order: the same draws as fidelity.py
    found = {}
    for name, clean, real_faults, apply, _ in conditions(table, seed, 256, True, 1):
        faulty = {k: apply(r) for k, r in {**synthetic_faults(clean, faults_per_condition, generator),
                                           **real_faults}.items()}
        judged = replay(apply(clean), faulty, config, generator, step_rows=256, fault_share=0.02,
                        mask_truncated=False, announce_sampling=True, warmup_steps=20,
                        make_guard=functools.partial(_guard, device="cpu", per_token_offset=False))
        if "tail_hybrid7b" not in name:
            continue
        samples, suspect, labels, counted, tokens = judged.rows()
        drift, changepoint = judged.drift_thresholds().float(), judged.changepoint_thresholds().float()
        score = samples[:, COLUMN["changepoint_score"]]
        late = torch.tensor([label == "late_onset" for label in labels])
        healthy = torch.tensor([label == "clean" for label in labels]) & counted
        missed = late & counted & ~suspect
        judged_healthy = healthy & torch.isfinite(changepoint)
        rows = [{"tokens": int(tokens[i]), "changepoint_score": float(score[i]),
                 "changepoint_threshold": float(changepoint[i]),
                 "drift_cusum": float(samples[i, COLUMN["drift_cusum"]]), "drift_threshold": float(drift[i]),
                 "spike_margin": float(samples[i, COLUMN["spike_margin"]])}
                for i in missed.nonzero().flatten().tolist()]
        unjudged_late = int((late & counted & ~torch.isfinite(changepoint)).sum())
        found[name] = {"missed": rows, "late_onset_rows": int((late & counted).sum()),
                       "late_onset_rows_the_rule_did_not_judge": unjudged_late,
                       "healthy_max_score_over_threshold": float((score - changepoint)[judged_healthy].max())
                       if judged_healthy.any() else None}
        print(f"{name}: {len(rows)} of {int((late & counted).sum())} late-onset rows missed "
              f"({unjudged_late} judged in steps where the changepoint rule did not judge); healthy rows' largest "
              f"score over its threshold {found[name]['healthy_max_score_over_threshold']}", flush=True)
        for row in rows:
            print("   ", {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    if out is not None:
        out.write_text(json.dumps({"seed": seed, "faults_per_condition": faults_per_condition,
                                   "overrides": overrides, "conditions": found}, indent=1))


if __name__ == "__main__":
    typer.run(main)
