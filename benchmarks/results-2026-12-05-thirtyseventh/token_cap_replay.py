"""The replay that chose the ``changepoint`` score's per-token cap (``rollout_guard.changepoint.TOKEN_CAP``).

For each named condition of the fidelity benchmark (seed 0, told, on the engine's support): its clean rows with the
condition's noise, the calibration's centre and spread per engine bucket read from all of them (as the guard reads
them from kept tokens: the mean of clip(d, −2, 4), the sd of clip(x, −2, 4)), and 1,000·k late-onset rows from the
zoo. Per variant of the score: the healthy rows' 99.98th percentile (the budget's point once read) and their share
above ln 1000 (the threshold until then), and the share of late-onset rows above each. In hindsight (every clean
token read) and the rule alone: what the guard does is ``fidelity.py``'s.

Variants: no cap; each z clipped to ±4.5 σ before the ratio (emulated by clipping d; tried first in the full
benchmark, ``variants/zclip*.json``); the per-token log ratio capped at 10, 8, 6 nats.

    python benchmarks/results-2026-12-05-thirtyseventh/token_cap_replay.py softmax \
        hybrid-seed1/+softmax_hybrid7b,llama/+softmax_hybrid7b,hybrid/+softmax_hybrid7b
    python benchmarks/results-2026-12-05-thirtyseventh/token_cap_replay.py surprise llama/T1/top_p1/top_k0,llama/+topk5
"""

import glob
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import rollout_guard.changepoint as cp  # noqa: E402
from benchmarks.fidelity import DEFAULT_DATA, conditions  # noqa: E402
from benchmarks.fidelity_kit import zoo  # noqa: E402
from benchmarks.fidelity_kit.rollouts import read_tables  # noqa: E402
from rollout_guard.statistics import engine_bucket  # noqa: E402

VARIANTS = (("no cap", None, math.inf), ("z clipped to ±4.5", 4.5, math.inf), ("cap 10", None, 10.0),
            ("cap 8", None, 8.0), ("cap 6", None, 6.0))


def score(engine, trainer, mask, centre, spread, clip, cap):
    cp.TOKEN_CAP = cap
    if clip is not None:  # hold each token's d to centre ± clip · spread of its bucket
        bucket = engine_bucket(torch.where(torch.isfinite(engine), engine, torch.full_like(engine, -1.0)))
        mu, sd = centre[bucket], spread[bucket]
        trainer = engine - (engine - trainer).clamp(min=mu - clip * sd, max=mu + clip * sd)
    return torch.nan_to_num(cp.changepoint_score(engine, trainer, mask, centre, spread, kernel=False), neginf=-50.0)


def main(shape: str, names: str) -> None:
    wanted = names.split(",")
    table = read_tables(sorted(glob.glob(DEFAULT_DATA)))
    generator = torch.Generator().manual_seed(5)
    saved = cp.TOKEN_CAP
    for name, clean, _, apply, _ in conditions(table, 0, 256, same_support=True, noise_shape=shape):
        if not any(w in name for w in wanted):
            continue
        rows = apply(clean)
        d, bucket = rows.engine - rows.trainer, engine_bucket(rows.engine)
        centre, spread = torch.zeros(4), torch.zeros(4)
        for k in range(1, 4):
            tokens = d[rows.mask & (bucket == k)]
            first = tokens.clamp(-2, 4).mean()
            x = (tokens - first).clamp(-2, 4)
            centre[k], spread[k] = first + x.mean(), x.std()
        faults = apply(zoo.late_onset(clean, generator))
        print(f"{name}: spread per bucket {[round(v, 3) for v in spread.tolist()]}")
        for label, clip, cap in VARIANTS:
            healthy = score(rows.engine, rows.trainer, rows.mask, centre, spread, clip, cap)
            late = score(faults.engine, faults.trainer, faults.mask, centre, spread, clip, cap)
            point = torch.quantile(healthy, 0.9998)
            ceiling = math.log(1000)
            above = 100 * float((healthy > ceiling).float().mean())
            print(f"  {label:18s} healthy: 99.98 % point {point:6.1f}, {above:.3f} %"
                  f" above ln 1000 | late onset caught: {100 * float((late > point).float().mean()):.2f} % above that"
                  f" point, {100 * float((late > ceiling).float().mean()):.2f} % above ln 1000")
    cp.TOKEN_CAP = saved


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
