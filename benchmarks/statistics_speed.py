"""The guard's per-step time next to the mismatch-metric ops TRL already runs, on the same tensors, in one run.

For each size B×T: fp32 engine and trainer logprobs (trainer = engine + N(0, 0.02²) noise, ~1 % of rows shifted
by −9 nats), a right-padded mask (lengths uniform in [T/4, T]): ``guard_overhead.make_batch``. Timed, median of
``--repeats`` runs after warm-up, each ending in a device synchronisation:

* **TRL ops**: what TRL 1.16's ``GRPOTrainer._generate_and_score_completions`` computes from the same tensors
  for its importance-sampling correction and its ``sampling/*`` metrics (default ``sequence_mask`` mode, clip
  max 3.0), copied from its source, with ``accelerator.gather`` the identity of one process and its ``.item()``
  host copies;
* **guard**: ``RolloutGuard.inspect`` with :class:`GuardConfig`'s defaults (pure torch): the detector's judgement,
  the per-rollout statistics, the packet, its gather (the identity on one process) and its one device→host copy,
  the verdict's bookkeeping and the detector's update;
* **detector**: the detector's part of that step alone: ``Detector.judge``, the kept histogram added to its state
  (``update``; the cross-process sum is the identity on one process) and the verdicts copied to the host.

The guard and the detector run warm (eight steps of the same batch first, as later steps of a run) and the guard is
told the sampling settings, as the TRL adapter tells it. On the GPU the TRL ops and the guard are then timed
alternately ``--rounds`` times: the ratio's median and range over pairs of medians taken back to back (single
medians a minute apart differed by up to 1.7× on a lent H200 host); also the host syncs per step (counted with
``torch.cuda.set_sync_debug_mode``), the extra device memory of each (peak above its inputs) against its inputs,
and the guard's step in parts (:data:`STEP_PARTS`, medians).
Printed: one JSON line per size, then a table; ``--out`` writes them all as JSON.

    python benchmarks/statistics_speed.py --device cuda --out statistics_speed.json
    python benchmarks/statistics_speed.py            # CPU: small sizes, no rounds
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics

import torch

from guard_overhead import make_batch, time_it as _time_it  # this folder's shared batch and timer
from rollout_guard import GuardConfig, RolloutEvidence, RolloutGuard
from rollout_guard.detector import Detector

STEP_PARTS = ("until_copy", "copy", "after_copy")
"""``RolloutGuard.last_step_parts``: host time until the step's one host copy (the judgement's launches, the packet,
the learning's launch), in it (waiting for the device), after it (the verdict's bookkeeping)."""
SAMPLING = ("temperature=1", "top_p=1", "top_k=0")  # told the settings, as the TRL adapter tells it every step
WARM_STEPS = 8


def trl_metric_ops(old_per_token_logps: torch.Tensor, sampling_per_token_logps: torch.Tensor, completion_mask: torch.Tensor,
                   mode: str = "sequence_mask", clip_min: float | None = None, clip_max: float | None = 3.0) -> dict[str, float]:
    """TRL 1.16 grpo_trainer.py (importance-sampling ratio, then the sampling/* metrics), one process."""
    device = old_per_token_logps.device
    gather = lambda tensor: tensor.reshape(-1)  # noqa: E731 - accelerator.gather on one process

    def nanmin(tensor: torch.Tensor) -> torch.Tensor:
        if torch.isnan(tensor).all():
            return torch.tensor(float("nan"), dtype=tensor.dtype, device=tensor.device)
        return torch.min(tensor[~torch.isnan(tensor)])

    def nanmax(tensor: torch.Tensor) -> torch.Tensor:
        if torch.isnan(tensor).all():
            return torch.tensor(float("nan"), dtype=tensor.dtype, device=tensor.device)
        return torch.max(tensor[~torch.isnan(tensor)])

    mask = completion_mask
    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True) if sequence_level_is else per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)

    delta = torch.abs(old_per_token_logps - sampling_per_token_logps)
    mask = completion_mask.bool()
    delta = delta[mask & ~torch.isnan(delta)]
    mean_delta = torch.mean(delta) if delta.numel() > 0 else torch.tensor(0.0, device=device)
    max_delta = torch.max(delta) if delta.numel() > 0 else torch.tensor(0.0, device=device)
    metrics = {"mean": gather(mean_delta).mean().item(), "max": gather(max_delta).max().item()}
    flat_is_ratio = ratio.flatten() if sequence_level_is else ratio[mask]
    low = torch.min(flat_is_ratio) if flat_is_ratio.numel() > 0 else torch.tensor(0.0, device=device)
    mean = torch.mean(flat_is_ratio) if flat_is_ratio.numel() > 0 else torch.tensor(0.0, device=device)
    high = torch.max(flat_is_ratio) if flat_is_ratio.numel() > 0 else torch.tensor(0.0, device=device)
    metrics["is_min"] = nanmin(gather(low)).item()
    metrics["is_mean"] = gather(mean).nanmean().item()
    metrics["is_max"] = nanmax(gather(high)).item()
    return metrics


time_it = functools.partial(_time_it, warmup=5)


def host_syncs(fn) -> int:
    """Synchronizing CUDA operations in one call of ``fn`` (``torch.cuda.set_sync_debug_mode``)."""
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(warning.message) for warning in caught)


def extra_mib(fn, device: torch.device) -> float:
    """Peak device memory one call of ``fn`` allocates above what is allocated before it, MiB."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def warm_guard(config: GuardConfig, evidence: RolloutEvidence, device: torch.device, steps: int = WARM_STEPS,
               sampling: tuple | None = SAMPLING) -> RolloutGuard:
    """A guard that has judged ``evidence`` ``steps`` times (its detector's noise learned from the kept rows)."""
    guard = RolloutGuard(config, device=device)
    for step in range(1, steps + 1):
        guard.inspect(evidence, step=step, sampling=sampling)
    return guard


def detector_step(detector: Detector, evidence: RolloutEvidence) -> torch.Tensor:
    """The detector's part of a guard step: judge, learn from the kept rows, the verdicts to the host."""
    judgement = detector.judge(evidence.engine_logprobs, evidence.trainer_logprobs, evidence.mask)
    detector.update(judgement.kept_counts)
    return judgement.reasons.cpu()


def fused_against_reference(evidence: RolloutEvidence, device: torch.device) -> dict:
    """On the GPU: the fused step's judgement against the torch reference on the CPU, both warm from the same
    steps: whether every verdict and onset agrees, and the largest score difference (nats)."""
    cpu = RolloutEvidence(evidence.mask.cpu(), evidence.engine_logprobs.cpu(), evidence.trainer_logprobs.cpu())
    fused, reference = Detector(device=device), Detector()
    for _ in range(WARM_STEPS):
        detector_step(fused, evidence)
        detector_step(reference, cpu)
    got = fused.judge(evidence.engine_logprobs, evidence.trainer_logprobs, evidence.mask)
    expected = reference.judge(cpu.engine_logprobs, cpu.trainer_logprobs, cpu.mask)
    finite = torch.isfinite(expected.score)
    return {"verdicts_equal": bool(torch.equal(got.reasons.cpu(), expected.reasons)),
            "onsets_equal": bool(torch.equal(got.onset.cpu(), expected.onset)),
            "max_score_difference": float((got.score.cpu() - expected.score)[finite].abs().max()),
            "states_equal": bool(torch.allclose(fused.counts.cpu(), reference.counts))}


def measure(rows: int, length: int, device: torch.device, repeats: int, rounds: int) -> dict:
    """One size's figures (module docstring)."""
    gpu = device.type == "cuda"
    evidence = make_batch(rows, length, device)
    trl = lambda: trl_metric_ops(evidence.trainer_logprobs, evidence.engine_logprobs, evidence.mask)  # noqa: E731
    guard = warm_guard(GuardConfig(), evidence, device)
    step = iter(range(WARM_STEPS + 1, 10**9))
    inspect = lambda: guard.inspect(evidence, step=next(step), sampling=SAMPLING)  # noqa: E731
    detector = Detector(device=device)
    for _ in range(WARM_STEPS):
        detector_step(detector, evidence)
    judge = lambda: detector_step(detector, evidence)  # noqa: E731
    trl_seconds = time_it(trl, device, repeats)
    guard_seconds = time_it(inspect, device, repeats)
    detector_seconds = time_it(judge, device, repeats)
    report = inspect()
    input_bytes = sum(t.element_size() * t.numel() for t in (evidence.mask, evidence.engine_logprobs,
                                                             evidence.trainer_logprobs))
    row = {"rows": rows, "tokens_per_row": length, "tokens": rows * length, "input_mib": input_bytes / 2**20,
           "trl_ops_ms": trl_seconds * 1e3, "guard_ms": guard_seconds * 1e3, "detector_ms": detector_seconds * 1e3,
           "guard_over_trl": guard_seconds / trl_seconds, "detector_over_trl": detector_seconds / trl_seconds,
           "corrupted": max(rows // 100, 1), "suspect": int(report.suspect.sum()),
           "suspect_by_detector": int((judge() != 0).sum())}
    if gpu:
        row["fused_against_reference"] = fused_against_reference(evidence, device)
        row["host_syncs_per_step"] = {"guard": host_syncs(inspect), "detector": host_syncs(judge),
                                      "trl_ops": host_syncs(trl)}
        row["guard_extra_mib"] = extra_mib(inspect, device)
        row["detector_extra_mib"] = extra_mib(judge, device)
        row["trl_ops_extra_mib"] = extra_mib(trl, device)
        row["rounds"] = []
        for _ in range(rounds):  # interleaved: each ratio from two medians taken back to back
            trl_ms, guard_ms = 1e3 * time_it(trl, device, repeats), 1e3 * time_it(inspect, device, repeats)
            row["rounds"].append({"trl_ops_ms": trl_ms, "guard_ms": guard_ms, "ratio": guard_ms / trl_ms})
        parts = []
        for _ in range(repeats):  # the guard's step in parts, from its own clock (no synchronisation between them)
            inspect()
            torch.cuda.synchronize(device)
            parts.append(guard.last_step_parts)
        row["step_parts_ms"] = {name: 1e3 * statistics.median(p[i] for p in parts)
                                for i, name in enumerate(STEP_PARTS)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", default=None, help="comma-separated ROWSxTOKENS (default depends on the device)")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5,
                        help="on the GPU, then time TRL's ops and the guard alternately this many times (a shared "
                             "host drifts between measurements a minute apart); the ratio's median and range")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    sizes = args.sizes or ("64x1024,256x4096,512x8192,512x16384" if gpu else "16x256,64x1024")
    rows_out = []
    for size in sizes.split(","):
        rows, length = (int(part) for part in size.lower().split("x"))
        row = measure(rows, length, device, args.repeats, args.rounds)
        rows_out.append(row)
        print(json.dumps(row), flush=True)

    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    print(f"\ndevice: {name}; torch {torch.__version__}; fp32 logprobs, ~1 % corrupted rows; median of {args.repeats}; "
          f"GuardConfig defaults, warm")
    print(f"{'rows×tokens':>14} {'TRL ops ms':>11} {'guard ms':>10} {'guard/TRL':>10} {'detector ms':>12} "
          f"{'det/TRL':>8} {'extra MiB':>10} {'input MiB':>10} {'suspect':>12}")
    for row in rows_out:
        print(f"{row['rows']:>6}×{row['tokens_per_row']:<7} {row['trl_ops_ms']:>11.3f} {row['guard_ms']:>10.3f} "
              f"{row['guard_over_trl']:>10.2f} {row['detector_ms']:>12.3f} {row['detector_over_trl']:>8.2f} "
              f"{row.get('guard_extra_mib', math.nan):>10.2f} {row['input_mib']:>10.1f} "
              f"{row['suspect']:>4} of {row['corrupted']:<4}")
    for row in rows_out:
        if row.get("rounds"):
            ratios = sorted(r["ratio"] for r in row["rounds"])
            print(f"guard/TRL at {row['rows']}×{row['tokens_per_row']} in {len(ratios)} interleaved rounds: median "
                  f"{ratios[len(ratios) // 2]:.2f} (range {ratios[0]:.2f}–{ratios[-1]:.2f}; TRL ops "
                  f"{min(r['trl_ops_ms'] for r in row['rounds']):.3f}–{max(r['trl_ops_ms'] for r in row['rounds']):.3f}"
                  f" ms, guard {min(r['guard_ms'] for r in row['rounds']):.3f}–"
                  f"{max(r['guard_ms'] for r in row['rounds']):.3f} ms)")
    for row in rows_out:
        if "host_syncs_per_step" in row:
            print(f"at {row['rows']}×{row['tokens_per_row']}: host syncs per step {row['host_syncs_per_step']}; "
                  f"extra device memory: guard {row['guard_extra_mib']:.2f} MiB, detector "
                  f"{row['detector_extra_mib']:.2f} MiB, TRL ops {row['trl_ops_extra_mib']:.2f} MiB")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"device": name, "torch": torch.__version__, "repeats": args.repeats, "rounds": args.rounds,
                       "config": GuardConfig().to_dict(), "rows": rows_out}, handle, indent=2)


if __name__ == "__main__":
    main()
