"""Where the fused guard's host time goes per step: cProfile over warm, calibrated steps (statistics_speed.py's
batch and settings). python profile_step.py [ROWSxTOKENS] [--device cuda]"""
import cProfile, io, pstats, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[3])); sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.statistics_speed import SAMPLING, make_batch, warm_guard
from rollout_guard import GuardConfig

size = sys.argv[1] if len(sys.argv) > 1 else "512x8192"
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
rows, length = (int(p) for p in size.split("x"))
evidence = make_batch(rows, length, device)
guard = warm_guard(GuardConfig(calibration_warmup_tokens=1000), evidence, device, 8)
step = iter(range(100, 10**9))
for _ in range(20):
    guard.inspect(evidence, step=next(step), sampling=SAMPLING)
torch.cuda.synchronize() if device.type == "cuda" else None
n = 200
start = time.perf_counter()
for _ in range(n):
    guard.inspect(evidence, step=next(step), sampling=SAMPLING)
torch.cuda.synchronize() if device.type == "cuda" else None
print(f"{size} on {device}: {1e3 * (time.perf_counter() - start) / n:.3f} ms per step (no profiler)")
profiler = cProfile.Profile()
profiler.enable()
for _ in range(n):
    guard.inspect(evidence, step=next(step), sampling=SAMPLING)
profiler.disable()
for key in ("tottime", "cumulative"):
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(28)
    print("\n".join(line[:170] for line in out.getvalue().splitlines()[4:40]))
