"""What a count-of-exceedances rule could do on the fidelity benchmark, with hindsight (thirteenth session; not a
guard rule).

Per condition: every token's x = d − (its engine bucket's median clean d), q the bucket's clean 1 − Q quantile of
|x|; a row scores −ln P(Poisson(Q·n) ≥ k) for k of its n tokens over q; the threshold is the separability bound's
own (``hindsight_threshold``: at most 0.1 % of the clean rows over it). Printed: the share of late-onset and
moderate rows over it.

    python benchmarks/results-2026-12-02-thirteenth/count_rule_prototype.py 0.01 abs > count_rule_prototype.txt
"""
import glob
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.fidelity import DEFAULT_DATA, conditions, synthetic_faults
from benchmarks.fidelity_kit.rollouts import read_tables
from benchmarks.fidelity_kit.score import GOAL_FALSE_RATE
from benchmarks.separability import hindsight_threshold
from rollout_guard.statistics import engine_bucket
table = read_tables(sorted(glob.glob(DEFAULT_DATA)))
g = torch.Generator().manual_seed(0)
Q = float(sys.argv[1]) if len(sys.argv) > 1 else 0.01
SIDE = sys.argv[2] if len(sys.argv) > 2 else 'abs'
def xs(r, centre):
    m = r.mask & torch.isfinite(r.engine) & torch.isfinite(r.trainer)
    e = torch.where(m, r.engine, 0.0); t = torch.where(m, r.trainer, 0.0)
    b = engine_bucket(e)
    x = (e - t) - centre[b]
    return m, b, x
def score(r, centre, q):
    m, b, x = xs(r, centre)
    v = x.abs() if SIDE == 'abs' else x
    over = (v > q[b]) & m
    k = over.sum(-1).double(); n = m.sum(-1).double()
    lam = Q * n
    # -log P(Poisson(lam) >= k), via regularized gamma: P(X>=k) = gammainc(k, lam) (lower) for k>=1
    p = torch.where(k > 0, torch.special.gammainc(k.clamp(min=1), lam.clamp(min=1e-9)), torch.ones_like(k))
    return -torch.log(p.clamp(min=1e-300))
for name, clean, real, apply, _ in conditions(table, 0, 256):
    faulty = {k: apply(r) for k, r in {**synthetic_faults(clean, 1000, g), **real}.items()}
    clean = apply(clean)
    m = clean.mask & torch.isfinite(clean.engine) & torch.isfinite(clean.trainer)
    b = engine_bucket(torch.where(m, clean.engine, 0.0))
    d = (clean.engine - clean.trainer)
    centre = torch.zeros(4); q = torch.full((4,), float('inf'))
    for k in range(4):
        sel = d[m & (b == k)]
        if len(sel) > 100:
            centre[k] = sel.median()
            v = (sel - centre[k]).abs() if SIDE == 'abs' else sel - centre[k]
            q[k] = torch.quantile(v.double()[:1_000_000] if len(v) > 1_000_000 else v.double(), 1 - Q)
    cs = score(clean, centre, q)
    thr = hindsight_threshold(cs, GOAL_FALSE_RATE)
    out = []
    for f in ('late_onset', 'moderate_confidence', 'real_late_onset'):
        if f not in faulty: continue
        fs = score(faulty[f], centre, q)
        out.append(f"{f}={100*float((fs > thr).float().mean()):.1f}")
    print(f"{name:42s} clean_thr={float(thr):6.2f} " + ' '.join(out), flush=True)
