"""Host time per step of the guard's parts (wrapped with perf_counter; CUDA synchronised around the step):
python host_split.py [ROWSxTOKENS ...]"""
import collections, functools, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[3])); sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.statistics_speed import SAMPLING, make_batch, warm_guard
from rollout_guard import GuardConfig, guard as guard_module, packet, fused_statistics, calibration

SPENT = collections.Counter()


def timed(owner, name, label):
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            SPENT[label] += time.perf_counter() - start
    setattr(owner, name, wrapper)


device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
fused = device.type == "cuda"
timed(guard_module.RolloutGuard, "_packet", "packet (launch; reference: compute)")
timed(guard_module.RolloutGuard, "_judge", "judge (incl. the copy)")
timed(calibration.Calibration, "update", "  calibration.update")
timed(guard_module.RolloutGuard, "_calibration_metrics", "  calibration metrics (thresholds)")
timed(guard_module, "step_metrics", "  step_metrics")
timed(guard_module, "combine_aggregates", "  combine_aggregates")
timed(guard_module.RolloutGuard, "_update_totals", "  totals")
if fused:
    timed(fused_statistics, "kernel_parameters", "  kernel_parameters")
for size in sys.argv[1:] or ["256x4096", "512x8192"]:
    rows, length = (int(p) for p in size.split("x"))
    evidence = make_batch(rows, length, device)
    guard = warm_guard(GuardConfig(calibration_warmup_tokens=1000, fused_statistics=fused), evidence, device, 8)
    step = iter(range(100, 10**9))
    for _ in range(20):
        guard.inspect(evidence, step=next(step), sampling=SAMPLING)
    SPENT.clear()
    n, total = 200, 0.0
    for _ in range(n):
        if fused:
            torch.cuda.synchronize()
        start = time.perf_counter()
        guard.inspect(evidence, step=next(step), sampling=SAMPLING)
        total += time.perf_counter() - start
    print(f"{size} on {device} ({'fused' if fused else 'reference'}): inspect {1e3 * total / n:.3f} ms per step")
    for label, seconds in SPENT.items():
        print(f"   {label:40s} {1e3 * seconds / n:.3f} ms")
