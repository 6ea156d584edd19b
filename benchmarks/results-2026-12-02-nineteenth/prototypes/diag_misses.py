"""Dump the guard's missed faults and false quarantines with their tokens and the thresholds in use (the first
judgement of each step): python diag_misses.py OUT.pkl [FIELD=VALUE ...] (SEED=1 in the environment for seed 1)."""
import functools, glob, json, sys, pickle
from pathlib import Path
import torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from benchmarks import fidelity as F
from benchmarks.fidelity_kit.score import replay, figures
from rollout_guard.guard import RolloutGuard
from rollout_guard.statistics import engine_bucket

RECORDS = []
TRACE = []
CURRENT = {"name": None, "labels": None}

class Recording(RolloutGuard):
    seen_steps = None
    def inspect(self, evidence, step, **kw):
        cal = self.calibration
        before = dict(values=[list(v) for v in cal.threshold_values()], drift=cal.drift_threshold_value(),
                      warm=cal.calibrated_flags(), centred=cal.centred_flags(),
                      unlikely_tokens=[b[0] for b in cal._unlikely], needed=cal._unlikely_min_tokens(),
                      rows=cal.rows)
        report = super().inspect(evidence, step, **kw)
        first = step not in self.seen_steps
        if first:
            TRACE.append(dict(cond=CURRENT["name"], step=step, sampling=kw.get("sampling"), unlikely=before["values"][3][0],
                              carried=cal._unlikely_fresh[0], tokens=before["unlikely_tokens"][0], needed=before["needed"],
                              warm=before["warm"][0], missed=int((evidence.injected.bool() & ~report.suspect).sum()),
                              false=int((~evidence.injected.bool() & report.suspect).sum())))
        self.seen_steps.add(step)
        inj = evidence.injected.bool()
        bad = (inj & ~report.suspect) | (~inj & report.suspect)
        if first and bad.any():
            for i in torch.nonzero(bad).flatten().tolist():
                m = evidence.mask[i].bool()
                key = tuple(round(v, 4) for v in evidence.engine_logprobs[i][m][:12].tolist()) + (int(m.sum()),)
                RECORDS.append(dict(cond=CURRENT["name"], step=step, kind="missed" if inj[i] else "false",
                                    fault=CURRENT["lookup"].get(key, "?"),
                                    engine=evidence.engine_logprobs[i][m].tolist(),
                                    trainer=evidence.trainer_logprobs[i][m].tolist(),
                                    samples=report.samples[i].tolist(), **before))
        return report

def make(config):
    g = Recording(config); g.seen_steps = set(); return g

def main(out, extra=()):
    sys.argv = ["x"]
    config = F.with_overrides(F.preset("defaults"), list(extra))
    table = F.read_tables(sorted(glob.glob(F.DEFAULT_DATA)))
    SEED = int(__import__("os").environ.get("SEED", "0")); gen = torch.Generator().manual_seed(SEED)
    res = []
    for name, clean, real, apply, params in F.conditions(table, SEED, 256, True):
        CURRENT["name"] = name
        faulty = {k: apply(r) for k, r in {**F.synthetic_faults(clean, 1000, gen), **real}.items()}
        lookup = {}
        for k, r in faulty.items():
            for i in range(len(r)):
                m = r.mask[i].bool()
                lookup[tuple(round(v, 4) for v in r.engine[i][m][:12].tolist()) + (int(m.sum()),)] = k
        CURRENT["lookup"] = lookup
        j = replay(apply(clean), faulty, config, gen, step_rows=256, fault_share=0.02, make_guard=make)
        f = figures(j, config)
        res.append((name, {k: (v.get("caught", v.get("false")), v["rows"]) for k, v in f.items()}))
        print(name, res[-1][1], flush=True)
    pickle.dump(dict(records=RECORDS, results=res, trace=TRACE), open(out, "wb"))

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
