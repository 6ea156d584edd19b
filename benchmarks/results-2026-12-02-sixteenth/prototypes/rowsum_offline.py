"""Prototype: a standardised row sum S = Σ clip(x) / sqrt(Σ σ²_b), hindsight moments per engine bucket; recall at
the clean rows' 1 − 0.0005 quantile, per condition and fault; which rows the guard missed does it catch."""
import sys, glob, math, torch, json
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository
from benchmarks.fidelity import DEFAULT_DATA, conditions, synthetic_faults
from benchmarks.fidelity_kit.rollouts import read_tables
from rollout_guard.statistics import engine_bucket
LIKELY_E, LIKELY_T = math.log(0.05), math.log(0.2)
def stats(rows, centre, var):
    m = rows.mask & torch.isfinite(rows.engine) & torch.isfinite(rows.trainer)
    b = engine_bucket(rows.engine.clamp(min=-1e9))
    d = torch.where(m, rows.engine - rows.trainer, 0.0)
    x = (d - centre[b]).clamp(-2, 4)
    unlikely = (rows.engine < LIKELY_E) & (rows.trainer < LIKELY_T)
    x = torch.where(unlikely, x.clamp(max=1.5), x)
    x = torch.where(m, x, 0.0)
    v = torch.where(m, var[b], 0.0)
    return x.sum(-1) / v.sum(-1).clamp(min=1e-12).sqrt()
def moments(rows):
    m = rows.mask & torch.isfinite(rows.engine) & torch.isfinite(rows.trainer)
    b = engine_bucket(rows.engine.clamp(min=-1e9))[m]; d = (rows.engine - rows.trainer)[m]
    centre = torch.zeros(4); var = torch.ones(4)
    for k in range(4):
        dk = d[b == k].clamp(-2, 4)
        if len(dk) > 10: centre[k] = dk.mean(); var[k] = ((dk - centre[k]).clamp(-2, 4)).var()
    return centre, var
table = read_tables(sorted(glob.glob(DEFAULT_DATA)))
gen = torch.Generator().manual_seed(0)
out = {}
for name, clean, real, apply, _ in conditions(table, 0, 256, True):
    faulty = {k: apply(r) for k, r in {**synthetic_faults(clean, 1000, gen), **real}.items()}
    clean = apply(clean)
    centre, var = moments(clean)
    cs = stats(clean, centre, var)
    thr = float(cs.sort(descending=True).values[int(0.0005 * len(cs))])
    rec = {f: round(100 * float((stats(r, centre, var) > thr).float().mean()), 1) for f, r in sorted(faulty.items())}
    out[name] = rec
    print(f'{name:40s} thr {thr:6.2f}', rec, flush=True)
json.dump(out, open('sumproto.json', 'w'))
