"""The thirtieth session's cross-fitted trade-off of the change-point test (``changepoint_trade_off.py``) with the
noise learned over the guard's four engine buckets (``rollout_guard.statistics.ENGINE_BUCKET_EDGES``) instead of
thirteen 0.25-nat bins: whether the library's rule, which reads the calibration's per-bucket centre and spread, keeps
the test's power in the hybrid-7B-tail cells.

    python benchmarks/results-2026-12-04-thirtysecond/trade_off_guard_buckets.py [--seed 1]
"""

import runpy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "results-2026-12-03-twentyeighth"))

import benchmarks.likelihood_bound as likelihood_bound  # noqa: E402
import changepoint_every_condition  # noqa: E402
from rollout_guard.statistics import ENGINE_BUCKET_EDGES  # noqa: E402

if __name__ == "__main__":
    edges = torch.tensor(ENGINE_BUCKET_EDGES, dtype=torch.float64)
    likelihood_bound.LEARNED_EDGES = edges  # what learned_noise bins by
    changepoint_every_condition.LEARNED_EDGES = edges  # what log_lr bins by
    runpy.run_path(str(ROOT / "benchmarks" / "results-2026-12-04-thirtieth" / "changepoint_trade_off.py"),
                   run_name="__main__")
