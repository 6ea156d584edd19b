"""The single-score detector's step next to the mismatch-metric ops TRL already runs, on the same tensors, in one run.

For each size B×T the batch of ``guard_overhead.make_batch`` (fp32 logprobs, 0.02-nat noise, ~1 % of rows shifted
by −9 nats, right-padded). Timed alternately ``--rounds`` times, each a median of ``--repeats`` runs ending in a
device synchronisation: TRL 1.16's importance-sampling and ``sampling/*`` metric ops (``statistics_speed``), and the
detector's step — ``Detector.judge``, the kept histogram added to its state (``update``, the cross-process sum being
the identity on one process) and the verdicts copied to the host (the step's one host sync). Printed: each size's
median ratio detector / TRL and its range over the rounds, and the detector's peak device memory above its inputs.

    python benchmarks/detector_speed.py --device cuda --out benchmarks/results/detector_speed/h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from guard_overhead import make_batch, time_it  # this folder's shared batch and timer
from statistics_speed import trl_metric_ops

from rollout_guard.detector import Detector


def detector_step(detector: Detector, engine: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> None:
    judgement = detector.judge(engine, trainer, mask)
    detector.update(judgement.kept_counts)
    judgement.reasons.cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", default=None, help="B×T list, e.g. 256x4096,512x8192")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    sizes = args.sizes or ("256x4096,512x8192" if gpu else "16x256,64x1024")
    results = []
    for size in sizes.split(","):
        rows, length = (int(v) for v in size.split("x"))
        evidence = make_batch(rows, length, device)
        engine, trainer, mask = evidence.engine_logprobs, evidence.trainer_logprobs, evidence.mask
        detector = Detector(device=device)
        for _ in range(3):  # warm: the state holds a few steps of kept tokens
            detector_step(detector, engine, trainer, mask)
        if gpu:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            detector_step(detector, engine, trainer, mask)
            peak = torch.cuda.max_memory_allocated(device) - base
        else:
            peak = None
        pairs = []
        for _ in range(args.rounds):
            trl = time_it(lambda: trl_metric_ops(trainer, engine, mask), device, args.repeats)
            ours = time_it(lambda: detector_step(detector, engine, trainer, mask), device, args.repeats)
            pairs.append((trl, ours))
        ratios = [ours / trl for trl, ours in pairs]
        inputs = sum(t.numel() * t.element_size() for t in (engine, trainer, mask))
        row = {"size": size, "trl_ms": 1e3 * statistics.median(p[0] for p in pairs),
               "detector_ms": 1e3 * statistics.median(p[1] for p in pairs), "ratio": statistics.median(ratios),
               "ratio_range": [min(ratios), max(ratios)], "peak_bytes_above_inputs": peak, "input_bytes": inputs,
               "suspect": int(detector.judge(engine, trainer, mask).suspect.sum())}
        results.append(row)
        print(f"{size}: TRL ops {row['trl_ms']:.3f} ms, detector {row['detector_ms']:.3f} ms, ratio {row['ratio']:.2f} "
              f"[{row['ratio_range'][0]:.2f}, {row['ratio_range'][1]:.2f}], peak memory "
              f"{'-' if peak is None else f'{peak / 2**20:.0f} MiB'} above {inputs / 2**20:.0f} MiB of inputs, "
              f"{row['suspect']} of {rows} rows suspect", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(device) if gpu else "cpu",
                                        "torch": torch.__version__, "results": results}, indent=1))


if __name__ == "__main__":
    main()
