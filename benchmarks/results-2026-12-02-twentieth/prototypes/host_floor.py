"""What the calibration's per-step host work costs the fused step (one H200): statistics_speed.py's batch and timer
(median of 100) for a warm guard as it is, and with parts of that work patched out (thresholds then frozen or stale:
floors, not guards). python host_floor.py [ROWSxTOKENS ...]"""
import sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[3])); sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.statistics_speed import SAMPLING, make_batch, warm_guard, time_it, trl_metric_ops
from rollout_guard import GuardConfig, fused_statistics, statistics
from rollout_guard import guard as guard_module

device = torch.device("cuda")
original_parameters = fused_statistics.kernel_parameters


def frozen_table(guard):
    table = {}
    def parameters(*args, **kwargs):
        if "t" not in table:
            table["t"] = original_parameters(*args, **kwargs)
        return table["t"]
    return parameters


def variants(guard):
    yield "as is", lambda: None
    yield "table built, no pinned copy (blocking .to)", lambda: setattr(
        fused_statistics, "kernel_parameters", lambda *a, **k: original_parameters(*a[:2], "cpu", *a[3:], **k).to(device))
    yield "table frozen (update and thresholds run)", lambda: setattr(fused_statistics, "kernel_parameters", frozen_table(guard))
    yield "no update", lambda: setattr(guard.calibration, "update", lambda *a, **k: None)


for size in sys.argv[1:] or ["256x4096", "512x8192"]:
    rows, length = (int(p) for p in size.split("x"))
    evidence = make_batch(rows, length, device)
    trl = time_it(lambda: trl_metric_ops(evidence.trainer_logprobs, evidence.engine_logprobs, evidence.mask), device, 100)
    line = [f"{size}: TRL ops {1e3 * trl:.3f} ms"]
    for index in range(4):
        fused_statistics.kernel_parameters = original_parameters
        guard = warm_guard(GuardConfig(calibration_warmup_tokens=1000), evidence, device, 8)
        label, patch = list(variants(guard))[index]
        patch()
        step = iter(range(100, 10**9))
        seconds = time_it(lambda: guard.inspect(evidence, step=next(step), sampling=SAMPLING), device, 100)
        line.append(f"{label} {1e3 * seconds:.3f} ms ({seconds / trl:.2f}x)")
    fused_statistics.kernel_parameters = original_parameters
    print("\n   ".join(line), flush=True)
