"""Offline, not taken: a calibrated count over the tokens no side found likely (twentieth session).

For a row with u such tokens (engine < -3 nats, trainer < ln 0.2), k_c of them with x = d - centre > c nats, and
p_c the per-token rate of x > c among clean such tokens:

    S = max_c  -ln P(Poisson(u p_c) >= k_c),   c in {0.5, 1, 1.5, 2}   (0 where k_c = 0)

P(Poisson(lam) >= k) = gammainc(k, lam). The rates, bucket centres and the row threshold (the 1 - b quantile of the
clean rows' S) come from half of each condition's clean rows (even index); the false rate is read on the other half
and the guard's missed rows (from diag_misses.py's pickle, seed 0) are scored against the threshold. Hindsight in
the rates and the threshold (a whole condition's clean tokens, no warm-up): an upper bound on what such a rule adds.

    python count_rule.py MISSES.pkl     # MISSES.pkl from ../../results-2026-12-02-nineteenth/prototypes/diag_misses.py
"""
import collections, glob, math, pickle, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks import fidelity as F
from rollout_guard.statistics import engine_bucket

CS = torch.tensor([0.5, 1.0, 1.5, 2.0], dtype=torch.float64)
BUDGETS = (1e-4, 2e-4, 5e-4, 1e-3)


def unlikely_excess(engine, trainer, centre):
    """(B, T) mask of the tokens no side found likely and (B, T) x = d - centre of their engine bucket."""
    ok = torch.isfinite(engine) & torch.isfinite(trainer)
    e, t = torch.where(ok, engine, 0.0), torch.where(ok, trainer, 0.0)
    return ok & (e < -3) & (t < math.log(0.2)), e - t - centre[engine_bucket(e)]


def score(unlikely, x, rates):
    """(B,) S = max_c -ln P(Poisson(u p_c) >= k_c)."""
    u = unlikely.sum(-1, keepdim=True).double()
    k = (unlikely.unsqueeze(-1) & (x.unsqueeze(-1) > CS)).sum(-2).double()  # (B, C)
    tail = torch.special.gammainc(k.clamp(min=1e-12), u * rates)
    return torch.where(k > 0, -torch.log(tail.clamp(min=1e-300)), 0.0).max(-1).values


def main(misses):
    missed = collections.defaultdict(list)
    for r in pickle.load(open(misses, "rb"))["records"]:
        if r["kind"] == "missed":
            missed[r["cond"]].append(r)
    table = F.read_tables(sorted(glob.glob(F.DEFAULT_DATA)))
    generator = torch.Generator().manual_seed(0)
    totals = collections.Counter()
    for name, clean, real, apply, _ in F.conditions(table, 0, 256, True):
        {k: apply(r) for k, r in {**F.synthetic_faults(clean, 1000, generator), **real}.items()}  # keep the draws
        rows = apply(clean)
        engine = torch.where(rows.mask.bool(), rows.engine.double(), math.nan)
        trainer = torch.where(rows.mask.bool(), rows.trainer.double(), math.nan)
        fit, held = slice(0, None, 2), slice(1, None, 2)
        ok = torch.isfinite(engine[fit]) & torch.isfinite(trainer[fit])
        d, bucket = (engine[fit] - trainer[fit])[ok], engine_bucket(torch.where(ok, engine[fit], 0.0))[ok]
        centre = torch.stack([d[bucket == b].median() if (bucket == b).any() else d.new_zeros(()) for b in range(4)])
        unlikely, x = unlikely_excess(engine[fit], trainer[fit], centre)
        rates = ((unlikely.unsqueeze(-1) & (x.unsqueeze(-1) > CS)).sum((0, 1)) / unlikely.sum()).clamp(min=1e-9)
        s_fit = score(unlikely, x, rates)
        s_held = score(*unlikely_excess(engine[held], trainer[held], centre), rates)
        miss = [(r["fault"], score(*unlikely_excess(torch.tensor([r["engine"]], dtype=torch.float64),
                                                     torch.tensor([r["trainer"]], dtype=torch.float64),
                                                     centre), rates)[0])
                for r in missed.get(name, []) if r["fault"] != "real_stale_weights"]
        line = []
        for b in BUDGETS:
            threshold = torch.quantile(s_fit, 1 - b) if s_fit.max() > 0 else torch.tensor(math.inf)
            false = int((s_held > threshold).sum())
            caught = collections.Counter(f for f, s in miss if s > threshold)
            totals[b, "false"] += false
            totals[b, "held"] += len(s_held)
            for f, n in caught.items():
                totals[b, f] += n
            line.append(f"b={b:g}: thr {float(threshold):.1f} false {false}/{len(s_held)} "
                        + " ".join(f"{f} +{n}" for f, n in sorted(caught.items())))
        print(f"{name:36s} missed {len(miss):3d} | " + " | ".join(line), flush=True)
    for b in BUDGETS:
        extra = {f: n for (bb, f), n in totals.items() if bb == b and f not in ("false", "held")}
        print(f"budget {b:g}: held-out clean rows above the threshold {totals[b, 'false']} of {totals[b, 'held']}; "
              f"missed rows it would catch {extra}")


if __name__ == "__main__":
    main(sys.argv[1])
