"""The fused guard's step with its calibration update held and applied while the next step's kernel runs (as is)
against the same guard applying every update at once after its step's host sync (SETTLE_AT_ONCE_STEPS patched
to never end: the behaviour before), next to TRL's metric ops; statistics_speed.py's batch, warm-up and timer
(median of --repeats), the three interleaved for --rounds rounds. Also the host time of the settle itself.

    python settle_split.py [--sizes 256x4096,512x8192] [--repeats 100] [--rounds 3]
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.statistics_speed import SAMPLING, make_batch, time_it, trl_metric_ops, warm_guard  # noqa: E402
from rollout_guard import GuardConfig, calibration  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--sizes", default="256x4096,512x8192")
parser.add_argument("--repeats", type=int, default=100)
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
args = parser.parse_args()
device = torch.device(args.device)
AT_ONCE = calibration.SETTLE_AT_ONCE_STEPS
results = []
for size in args.sizes.split(","):
    rows, length = (int(p) for p in size.split("x"))
    evidence = make_batch(rows, length, device)
    config = GuardConfig(calibration_warmup_tokens=1000, fused_statistics=device.type == "cuda")
    calibration.SETTLE_AT_ONCE_STEPS = AT_ONCE
    held = warm_guard(config, evidence, device, AT_ONCE + 2)  # past the steps applied at once
    calibration.SETTLE_AT_ONCE_STEPS = 10**9
    at_once = warm_guard(config, evidence, device, AT_ONCE + 2)
    step = iter(range(100, 10**9))
    for round_ in range(args.rounds):
        trl = time_it(lambda: trl_metric_ops(evidence.trainer_logprobs, evidence.engine_logprobs, evidence.mask),
                      device, args.repeats)
        calibration.SETTLE_AT_ONCE_STEPS = AT_ONCE
        held_s = time_it(lambda: held.inspect(evidence, step=next(step), sampling=SAMPLING), device, args.repeats)
        assert held.calibration.state_dict()["pending"] is not None, "the update should be held"
        calibration.SETTLE_AT_ONCE_STEPS = 10**9
        once_s = time_it(lambda: at_once.inspect(evidence, step=next(step), sampling=SAMPLING), device, args.repeats)
        assert at_once.calibration.state_dict()["pending"] is None
        row = dict(size=size, round=round_ + 1, trl_ops_ms=1e3 * trl, held_ms=1e3 * held_s, at_once_ms=1e3 * once_s,
                   held_ratio=held_s / trl, at_once_ratio=once_s / trl)
        results.append(row)
        print(f"{size} round {round_ + 1}: TRL ops {row['trl_ops_ms']:.3f} ms | guard, update held "
              f"{row['held_ms']:.3f} ms ({row['held_ratio']:.2f}x) | guard, update at once {row['at_once_ms']:.3f} ms "
              f"({row['at_once_ratio']:.2f}x)", flush=True)
    calibration.SETTLE_AT_ONCE_STEPS = AT_ONCE
    # the host time of applying a held update and building the next table (what now overlaps the kernel)
    spent = []
    for _ in range(args.repeats):
        held.inspect(evidence, step=next(step), sampling=SAMPLING)
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        held._settle_calibration()
        spent.append(time.perf_counter() - started)
    spent.sort()
    print(f"{size}: settle (update, thresholds, next table) {1e3 * spent[len(spent) // 2]:.3f} ms host", flush=True)
    results.append(dict(size=size, settle_host_ms=1e3 * spent[len(spent) // 2]))
print(json.dumps(results))
