"""Detection on a real engine fault: the guard's rules and the single-score detector on the same rollouts.

The rollouts come from ``benchmarks/stale_state_fault.py`` (vLLM CPU, the tiny Mamba2 model in bf16, the stale-state
fault of vLLM PR #32118 reinstated, and the same engine as shipped), one run per seed and concurrency (token budget
= concurrency, the fault's trigger), each rollout re-scored with transformers in float32. A rollout's class is its
max |engine − trainer| over its tokens: **strong** ≥ 3 nats, **clean** within the shipped engine's largest
disagreement, **grey** in between.

Both detectors see the fault run's rollouts as a stream of 64-rollout steps in a shuffled order, twice: **cold**
(the fault from the first step) and **warm** (eight steps of the shipped engine's rollouts first). The guard runs
``RolloutGuard.inspect`` with its defaults, told the sampling settings; the detector is
``rollout_guard.detector.Detector`` with its defaults, learning from the rows it keeps.

    python benchmarks/real_engine_detection.py                      # seeds 0-2, concurrency 8 and 16
    python benchmarks/real_engine_detection.py --seeds 0 --concurrency 8 --prompts 16
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "real_engine_detection"
STRONG = 3.0  # nats
STEP_ROWS = 64
WARM_STEPS = 8


def rollouts(seed: int, concurrency: int, prompts: int, cache: Path) -> dict:
    """Both conditions' rollouts of one run of stale_state_fault.py (cached under ``cache``)."""
    path = cache / f"seed{seed}-concurrency{concurrency}-prompts{prompts}.json"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(REPO / "benchmarks" / "stale_state_fault.py"), "--seed", str(seed),
                        "--max-num-seqs", str(concurrency), "--prompts", str(prompts), "--json", str(path)],
                       check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    return json.loads(path.read_text())


def padded(rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T) engine, trainer logprobs and mask, right-padded."""
    width = max(max(len(r["engine"]) for r in rows), 1)
    engine = torch.zeros(len(rows), width, dtype=torch.float32)
    trainer = torch.zeros_like(engine)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        n = len(r["engine"])
        engine[i, :n] = torch.tensor(r["engine"])
        trainer[i, :n] = torch.tensor(r["trainer"])
        mask[i, :n] = True
    return engine, trainer, mask


def judge_stream(steps: list[list[dict]]) -> dict[str, list[bool]]:
    """Each detector's verdict on every row of the stream, in order."""
    from rollout_guard import GuardConfig, RolloutEvidence, RolloutGuard
    from rollout_guard.detector import Detector

    guard, detector = RolloutGuard(GuardConfig(mode="monitor", output_dir=None)), Detector()
    verdicts: dict[str, list[bool]] = {"guard": [], "detector": []}
    for step, rows in enumerate(steps):
        engine, trainer, mask = padded(rows)
        report = guard.inspect(RolloutEvidence(mask=mask, engine_logprobs=engine, trainer_logprobs=trainer), step,
                               sampling=(1.0, 1.0, -1))
        verdicts["guard"] += report.suspect.tolist()
        judgement = detector.judge(engine, trainer, mask)
        detector.update(judgement.kept_counts)
        verdicts["detector"] += judgement.suspect.tolist()
    return verdicts


def classify(rows: list[dict], clean_max: float) -> list[str]:
    return ["strong" if r["max"] >= STRONG else "clean" if r["max"] <= clean_max else "grey" for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--cache", type=Path, default=REPO / ".cache" / "real_engine_detection")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu.json.gz")
    args = parser.parse_args()
    table, missed = [], []
    for seed in args.seeds:
        for concurrency in args.concurrency:
            run = rollouts(seed, concurrency, args.prompts, args.cache)
            fault, shipped = run["fault"]["samples"], run["shipped"]["samples"]
            fault = [r for r in fault if r["tokens"]]
            clean_max = max(r["max"] for r in run["shipped"]["samples"])
            order = list(range(len(fault)))
            random.Random(seed).shuffle(order)
            stream = [fault[i] for i in order]
            classes = classify(stream, clean_max)
            warm = [r for r in shipped if r["tokens"]][: WARM_STEPS * STEP_ROWS]
            for start, prefix in (("cold", []), ("warm", warm)):
                rows = prefix + stream
                verdicts = judge_stream([rows[i: i + STEP_ROWS] for i in range(0, len(rows), STEP_ROWS)])
                for name, flags in verdicts.items():
                    flags = flags[len(prefix):]
                    cell = {"seed": seed, "concurrency": concurrency, "start": start, "detector": name,
                            "clean_max": clean_max}
                    for kind in ("strong", "grey", "clean"):
                        cell[kind] = sum(c == kind for c in classes)
                        cell[f"{kind}_flagged"] = sum(f for f, c in zip(flags, classes, strict=True) if c == kind)
                    shipped_flags = verdicts[name][: len(prefix)]
                    cell["warmup_flagged"] = sum(shipped_flags)
                    table.append(cell)
                    missed += [{**{k: cell[k] for k in ("seed", "concurrency", "start", "detector")},
                                "max": r["max"], "engine": r["engine"], "trainer": r["trainer"]}
                               for r, f, c in zip(stream, flags, classes, strict=True) if c == "strong" and not f]
    print(f"{'seed':>4} {'conc':>4} {'start':>5} {'detector':>8} | strong caught | grey flagged | clean flagged"
          " | warm-up flagged")
    for c in table:
        print(f"{c['seed']:>4} {c['concurrency']:>4} {c['start']:>5} {c['detector']:>8} | "
              f"{c['strong_flagged']:>5} of {c['strong']:<5} | {c['grey_flagged']:>4} of {c['grey']:<5} | "
              f"{c['clean_flagged']:>4} of {c['clean']:<5} | {c['warmup_flagged']}")
    for name in ("guard", "detector"):
        cells = [c for c in table if c["detector"] == name]
        print(f"{name}: strong caught {sum(c['strong_flagged'] for c in cells)} of {sum(c['strong'] for c in cells)}, "
              f"grey flagged {sum(c['grey_flagged'] for c in cells)} of {sum(c['grey'] for c in cells)}, "
              f"clean flagged {sum(c['clean_flagged'] for c in cells)} of {sum(c['clean'] for c in cells)}, "
              f"warm-up flagged {sum(c['warmup_flagged'] for c in cells)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(args.out, "wt") as f:
        json.dump({"cells": table, "missed_strong": missed}, f)
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
