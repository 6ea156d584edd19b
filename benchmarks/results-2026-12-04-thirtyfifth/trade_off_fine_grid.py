"""The thirtieth session's cross-fitted trade-off of the change-point test (``changepoint_trade_off.py``) on a fine
grid of budgets, with the noise learned per 0.25-nat engine bin (as there) or over the guard's four engine buckets
(``--buckets guard``, as ``../results-2026-12-04-thirtysecond/trade_off_guard_buckets.py``): so that the two
curves can be compared at the same share of held-out clean rows flagged, not at the same nominal budget (at one
nominal budget the thirteen bins flag more held-out clean rows).

    python benchmarks/results-2026-12-04-thirtyfifth/trade_off_fine_grid.py [--seed 1] [--buckets guard]
"""

import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "results-2026-12-03-twentyeighth"))

import benchmarks.likelihood_bound as likelihood_bound  # noqa: E402
import changepoint_every_condition  # noqa: E402
from rollout_guard.statistics import ENGINE_BUCKET_EDGES  # noqa: E402

GRID = tuple(float(q) for q in torch.logspace(-4.3, -2.3, 21, dtype=torch.float64))  # 0.005 % … 0.5 %

if __name__ == "__main__":
    if "--buckets" in sys.argv:
        at = sys.argv.index("--buckets")
        if sys.argv[at + 1] != "guard":
            raise SystemExit("--buckets: use 'guard' (the guard's four engine buckets) or leave it out (0.25-nat bins)")
        del sys.argv[at: at + 2]
        edges = torch.tensor(ENGINE_BUCKET_EDGES, dtype=torch.float64)
        likelihood_bound.LEARNED_EDGES = edges  # what learned_noise bins by
        changepoint_every_condition.LEARNED_EDGES = edges  # what log_lr bins by
    path = ROOT / "benchmarks" / "results-2026-12-04-thirtieth" / "changepoint_trade_off.py"
    spec = importlib.util.spec_from_file_location("changepoint_trade_off", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.BUDGETS = GRID
    module.app()
