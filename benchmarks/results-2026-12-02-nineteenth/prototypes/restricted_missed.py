"""Offline: would a CUSUM over the tokens no side found likely alone lift the guard's missed rows above their
condition's clean maximum? python restricted_missed.py MISSES.pkl (from diag_misses.py MISSES.pkl)."""
import pickle, torch, math, sys, glob, collections
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from rollout_guard.statistics import cusum_drawup, engine_bucket
from benchmarks import fidelity as F
d = pickle.load(open(sys.argv[1], 'rb'))  # diag_misses.py's output
missed = collections.defaultdict(list)
for r in d['records']:
    if r['kind'] == 'missed':
        missed[r['cond']].append(r)
def rc(e, t, centre, clip=1.5, allow=0.5):
    b = engine_bucket(e)
    x = e - t - centre[b]
    unl = torch.isfinite(e) & torch.isfinite(t) & (e < -3) & (t < math.log(0.2))
    s, _ = cusum_drawup(x.clamp(-2, clip) - allow, unl)
    return s
table = F.read_tables(sorted(glob.glob(F.DEFAULT_DATA)))
gen = torch.Generator().manual_seed(0)
for name, clean, real, apply, params in F.conditions(table, 0, 256, True):
    faulty = {k: apply(r) for k, r in {**F.synthetic_faults(clean, 1000, gen), **real}.items()}
    if name not in missed: continue
    cl = apply(clean)
    ok = cl.mask & torch.isfinite(cl.engine) & torch.isfinite(cl.trainer)
    dd = cl.engine - cl.trainer
    b = engine_bucket(torch.where(ok, cl.engine, torch.zeros_like(cl.engine)))
    centre = torch.stack([dd[ok & (b == k)].median() if (ok & (b == k)).any() else torch.tensor(0.) for k in range(4)])
    e = torch.where(ok, cl.engine, torch.full_like(cl.engine, float('nan'))); t = torch.where(ok, cl.trainer, torch.full_like(cl.trainer, float('nan')))
    s = rc(e, t, centre)
    q = torch.quantile(s, torch.tensor([0.999]))[0]
    hits = collections.Counter(); tot = collections.Counter()
    for r in missed[name]:
        sr = rc(torch.tensor([r['engine']]), torch.tensor([r['trainer']]), torch.tensor(r['values'][0]))[0]
        tot[r['fault']] += 1; hits[r['fault']] += int(sr > s.max())
    print(f"{name[:36]:36s} clean p99.9 {q:.2f} max {s.max():.2f}; missed rows above clean max: " + ", ".join(f"{k} {hits[k]}/{tot[k]}" for k in tot), flush=True)
