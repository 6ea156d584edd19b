"""Offline: a CUSUM over the tokens no side found likely alone (clip, allowance), clean p99 / p99.9 / max per
condition against the faults above the clean p99.9 (hindsight centres). python restricted.py [CONDITION-SUBSTRING ...]"""
import sys, glob, torch, math
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from benchmarks import fidelity as F
from rollout_guard.statistics import cusum_drawup, engine_bucket
table = F.read_tables(sorted(glob.glob(F.DEFAULT_DATA)))
gen = torch.Generator().manual_seed(0)
want = sys.argv[1:]
ALLOW = 0.5
for name, clean, real, apply, params in F.conditions(table, 0, 256, True):
    faulty = {k: apply(r) for k, r in {**F.synthetic_faults(clean, 1000, gen), **real}.items()}
    cl = apply(clean)
    if want and not any(w in name for w in want): continue
    ok = cl.mask & torch.isfinite(cl.engine) & torch.isfinite(cl.trainer)
    d = cl.engine - cl.trainer
    b = engine_bucket(torch.where(ok, cl.engine, torch.zeros_like(cl.engine)))
    centre = torch.stack([d[ok & (b == k)].median() if (ok & (b == k)).any() else torch.tensor(0.) for k in range(4)])
    def score(r, clip=1.5, allow=ALLOW):
        ok = r.mask & torch.isfinite(r.engine) & torch.isfinite(r.trainer)
        b = engine_bucket(torch.where(ok, r.engine, torch.zeros_like(r.engine)))
        x = r.engine - r.trainer - centre[b]
        unl = ok & (r.engine < -3) & (r.trainer < math.log(0.2))
        s, _ = cusum_drawup(x.clamp(-2, clip) - allow, unl)
        return s
    for clip in (1.5, 3.0):
      for allow in (0.5, 0.75):
        k = score(cl, clip, allow)
        q = torch.quantile(k.float(), torch.tensor([0.99, 0.999]))
        line = f"{name[:34]:34s} clip {clip} allow {allow}: clean p99 {q[0]:.2f} p99.9 {q[1]:.2f} max {k.max():.2f};"
        for f in ("real_context_swap", "real_late_onset", "late_onset", "isolated_spikes"):
            if f in faulty:
                kf = score(faulty[f], clip, allow)
                line += f" {f[:9]} >p99.9 {int((kf > q[1]).sum())}/{len(kf)}"
        print(line, flush=True)
