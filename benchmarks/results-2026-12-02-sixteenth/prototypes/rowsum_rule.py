"""python rowsum_rule.py OUT BUDGET FLOOR [fidelity args]: the fidelity benchmark with a prototype row-sum rule OR-ed in:
S = Σ clip(x) / sqrt(Σ σ²_b) over compared tokens (x = d − calibrated centre, clip −2..4, 1.5 for tokens no side
found likely), flagged above the kept rows' extrapolated 1 − BUDGET/1000 quantile (at least FLOOR), once the
buckets are centred and ≥ 1000 kept rows were seen since the last restart."""
import sys, math, copy
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository
import torch
import rollout_guard.calibration as C
from rollout_guard.guard import RolloutGuard
from rollout_guard.statistics import engine_bucket, EXCESS_EDGES, NUM_EXCESS_BINS
import benchmarks.fidelity_kit.score as SC
out, budget, floor = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
EDGES = torch.tensor(EXCESS_EDGES, dtype=torch.float64)
LE, LT = math.log(0.05), math.log(0.2)
class SumGuard(RolloutGuard):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self._sum = {'hist': [0.0] * NUM_EXCESS_BINS, 'rows': 0.0, 'sampling': None}
    def state_dict(self):
        s = super().state_dict(); s['_sum'] = copy.deepcopy(self._sum); return s
    def load_state_dict(self, state):
        super().load_state_dict(state); self._sum = copy.deepcopy(state['_sum'])
    def inspect(self, evidence, **kw):
        sampling = kw.get('sampling')
        if sampling != self._sum['sampling']:
            self._sum = {'hist': [0.0] * NUM_EXCESS_BINS, 'rows': 0.0, 'sampling': sampling}
        cal = self.calibration
        ready = all(cal.centred_flags()) and self._sum['rows'] >= 1000
        centre, var = cal.centre.float(), cal.variance.float()
        thr = max(floor, C.extrapolated_quantile(self._sum['hist'], self._sum['rows'], budget / 1000)) if ready else math.inf
        rep = super().inspect(evidence, **kw)
        e, t, m = evidence.engine_logprobs.float(), evidence.trainer_logprobs.float(), evidence.mask.bool()
        m = m & torch.isfinite(e) & torch.isfinite(t)
        b = engine_bucket(torch.where(m, e, 0.0))
        x = (torch.where(m, e - t, 0.0) - centre[b]).clamp(-2, 4)
        x = torch.where((e < LE) & (t < LT), x.clamp(max=1.5), x)
        x = torch.where(m, x, 0.0)
        v = torch.where(m, var[b], 0.0)
        s = x.sum(-1) / v.sum(-1).clamp(min=1e-12).sqrt()
        flag = (s > thr).cpu()
        rep.suspect |= flag
        kept = (~rep.suspect) & m.any(-1).cpu()
        if all(cal.centred_flags()):
            d = cal.config.calibration_decay
            sk = s.cpu()[kept].double().clamp(min=0)
            h = torch.bucketize(sk[sk >= EDGES[0]], EDGES, right=True) - 1
            add = torch.bincount(h, minlength=NUM_EXCESS_BINS).tolist()
            self._sum['hist'] = [a * d + n for a, n in zip(self._sum['hist'], add)]
            self._sum['rows'] = self._sum['rows'] * d + float(kept.sum())
        return rep
SC.RolloutGuard = SumGuard
sys.argv = ['fidelity', '--faults-per-condition', '1000', '--same-support', '--out', out] + sys.argv[4:]
from benchmarks.fidelity import app
app()
