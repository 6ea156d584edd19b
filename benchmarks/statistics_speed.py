"""The guard's per-step time next to the mismatch-metric ops TRL already runs, on the same tensors, in one run.

For each size B×T: fp32 engine and trainer logprobs (trainer = engine + N(0, 0.02²) noise, ~1 % of rows shifted
by −9 nats), a right-padded mask (lengths uniform in [T/4, T]). Timed, median of ``--repeats`` runs after
warm-up, each ending in a device synchronisation:

* **TRL ops**: what TRL 1.16's ``GRPOTrainer._generate_and_score_completions`` computes from the same tensors
  for its importance-sampling correction and its ``sampling/*`` metrics (default ``sequence_mask`` mode, clip
  max 3.0), copied from its source, with ``accelerator.gather`` the identity of one process and its ``.item()``
  host copies;
* **guard (reference)**: ``RolloutGuard.inspect`` with ``fused_statistics=False`` (pure torch);
* **guard (fused)**: ``RolloutGuard.inspect`` with the default config (one Triton kernel on CUDA), and the
  kernel launch alone (``fused_packet`` + synchronisation); and a first step (no centre known, after
  ``recalibrate``), judged around the batch's own centres (``batch_thresholds``: a few more torch ops);
* **the ``changepoint`` rule** (on by default; it judges in the warm guard): its score alone in its Triton kernel
  and in torch, their largest difference, and the warm guard's step with the rule off (``changepoint_budget=None``).

The guard runs warm (its calibration fed by earlier steps, as in a real run) and is told the sampling settings, as
the TRL adapter tells it (a guard never told them pays the first step's extra pass every step). On the GPU the TRL
ops and the fused guard are then timed alternately ``--rounds`` times: the ratio's median and range over pairs of
medians taken back to back (single medians a minute apart differed by up to 1.7× on a lent H200 host). Before
timing, the fused packet is checked against the reference packet on the same device (verdicts, counts and
histograms exactly; float sums to float32 rounding). Also printed: the guard's extra device memory (peak above its
inputs) against its inputs.

    python benchmarks/statistics_speed.py --device cuda --out statistics_speed.json
    python benchmarks/statistics_speed.py            # CPU: reference only, small sizes
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math

import torch

from guard_overhead import make_batch, time_it as _time_it  # this folder's shared batch and timer
from rollout_guard import GuardConfig, RolloutEvidence, RolloutGuard
from rollout_guard.packet import PacketLayout, reference_packet
from rollout_guard.statistics import COLUMN

SAMPLING = ("temperature=1", "top_p=1", "top_k=0")  # told the settings, as the TRL adapter tells it every step


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


def warm_guard(config: GuardConfig, evidence: RolloutEvidence, device: torch.device, steps: int,
               sampling: tuple | None = SAMPLING) -> RolloutGuard:
    guard = RolloutGuard(config, device=device)
    for step in range(1, steps + 1):
        guard.inspect(evidence, step=step, sampling=sampling)
    return guard


def compare_packets(evidence: RolloutEvidence, guard: RolloutGuard) -> dict[str, float]:
    """Fused against reference on the same device, same thresholds. ``drift_start`` is compared where the drift
    exceeds 1e-3 nats: where the CUSUM never rises, its start is the position of a float-rounding-sized bump."""
    from rollout_guard.fused_statistics import fused_packet
    from rollout_guard.packet import AGGREGATES

    from rollout_guard.fused_statistics import kernel_parameters

    thresholds, drift = guard.calibration.thresholds(evidence.device), guard.calibration.drift_threshold_value()
    scaling = guard.calibration.row_scaling(evidence.device)  # each row's own spike threshold, as the guard judges
    reference = reference_packet(evidence, guard.config, thresholds, drift, scaling)
    fused = fused_packet(evidence, guard.config, kernel_parameters(guard.config, thresholds, evidence.device, drift,
                                                                   scaling))
    layout = PacketLayout(evidence.batch_size)
    ref, got = reference[layout.samples].view(evidence.batch_size, -1), fused[layout.samples].view(evidence.batch_size, -1)
    exact = [COLUMN[name] for name in ("tokens", "compared_tokens", "confident_wrong_tokens", "first_divergent_token",
                                       "nonfinite_engine_tokens", "nonfinite_trainer_tokens")]
    rising = ref[:, COLUMN["drift_cusum"]] > 1e-3
    finite = torch.isfinite(ref) & torch.isfinite(got)
    floats = [COLUMN[name] for name in ("max_abs_delta", "mean_abs_delta", "seq_log_ratio", "kl_k3", "engine_mean_logprob",
                                        "trainer_mean_logprob", "spike_margin", "drift_cusum")]
    relative = ((got - ref).abs() / ref.abs().clamp(min=1.0)).where(finite, torch.zeros_like(ref))[:, floats]
    calibration_ref = reference[layout.calibration].view(4, -1)
    calibration_got = fused[layout.calibration].view(4, -1)
    tokens = calibration_ref[:, :1].clamp(min=1.0)
    aggregates_ref, aggregates_got = reference[layout.aggregates], fused[layout.aggregates]
    both = torch.isfinite(aggregates_ref) & torch.isfinite(aggregates_got)
    return {
        "verdicts_equal": bool(torch.equal(reference[layout.reasons], fused[layout.reasons])),
        "counts_equal": bool(torch.equal(ref[:, exact], got[:, exact])),
        "drift_start_equal_where_rising": bool(torch.equal(ref[rising, COLUMN["drift_start"]], got[rising, COLUMN["drift_start"]])),
        "nan_pattern_equal": bool(torch.equal(torch.isnan(ref), torch.isnan(got))),
        "histogram_equal": bool(torch.equal(reference[layout.histogram], fused[layout.histogram])),
        "calibration_counts_equal": bool(torch.equal(calibration_ref[:, [0, 3]], calibration_got[:, [0, 3]])
                                         and torch.equal(calibration_ref[:, 4:], calibration_got[:, 4:])),
        "kept_rows_equal": bool(reference[layout.kept_rows] == fused[layout.kept_rows]),
        "aggregate_maxima_equal": bool(torch.equal(aggregates_ref[5:9], aggregates_got[5:9])),
        "max_relative_difference": float(relative.max()),
        "calibration_sums_max_difference_per_token": float(((calibration_got[:, 1:3] - calibration_ref[:, 1:3]).abs() / tokens).max()),
        "aggregates_max_relative_difference": float(((aggregates_got - aggregates_ref).abs()
                                                     / aggregates_ref.abs().clamp(min=1.0)).where(both, 0.0).max()),
        "aggregates": len(AGGREGATES),
        "suspect": int((reference[layout.reasons] != 0).sum()),
    }


def changepoint_figures(guard: RolloutGuard, evidence: RolloutEvidence, device: torch.device, repeats: int,
                        step: int) -> dict[str, float | bool]:
    """The ``changepoint`` rule's part: whether it judges in the warm guard, its score alone in its Triton kernel
    and in torch (and their largest difference on this device), and the same guard's step with the rule off."""
    from rollout_guard.changepoint import changepoint_score

    out = {"changepoint_judges": guard.calibration.changepoint_threshold_value() is not None}
    centre, spread = guard.calibration.changepoint_noise(device)
    sides = (evidence.engine_logprobs, evidence.trainer_logprobs, evidence.mask, centre, spread)
    kernel, torch_form = changepoint_score(*sides, kernel=True), changepoint_score(*sides, kernel=False)
    finite = torch.isfinite(torch_form)
    out["changepoint_score_max_difference"] = float(((kernel - torch_form).abs() / torch_form.abs().clamp(min=1.0))
                                                    .where(finite, torch.zeros_like(kernel)).max())
    out["changepoint_inf_equal"] = bool(torch.equal(finite, torch.isfinite(kernel)))
    out["changepoint_kernel_ms"] = 1e3 * time_it(lambda: changepoint_score(*sides, kernel=True), device, repeats)
    out["changepoint_torch_ms"] = 1e3 * time_it(lambda: changepoint_score(*sides, kernel=False), device, repeats)
    import rollout_guard.changepoint as changepoint

    chosen = changepoint.KERNEL_BLOCK, changepoint.KERNEL_WARPS, changepoint.KERNEL_CHUNK
    timings = {}
    for changepoint.KERNEL_BLOCK, changepoint.KERNEL_WARPS, changepoint.KERNEL_CHUNK in (
            (64, 4, 512), (128, 4, 512), (128, 4, 1024), (128, 4, 2048), (128, 8, 1024), (256, 8, 1024),
            (128, 4, 1 << 30)):
        timings[f"{changepoint.KERNEL_BLOCK}/{changepoint.KERNEL_WARPS}/{changepoint.KERNEL_CHUNK}"] = 1e3 * time_it(
            lambda: changepoint_score(*sides, kernel=True), device, repeats)
    changepoint.KERNEL_BLOCK, changepoint.KERNEL_WARPS, changepoint.KERNEL_CHUNK = chosen
    out["changepoint_kernel_ms_by_block_warps_chunk"] = timings
    off = warm_guard(dataclasses.replace(guard.config, changepoint_budget=None), evidence, device, 8)
    counter = iter(range(step, 10**9))
    out["guard_fused_rule_off_ms"] = 1e3 * time_it(lambda: off.inspect(evidence, step=next(counter),
                                                                       sampling=SAMPLING), device, repeats)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", default=None, help="comma-separated ROWSxTOKENS (default depends on the device)")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5,
                        help="on the GPU, then time TRL's ops and the fused guard alternately this many times (a "
                             "shared host drifts between measurements a minute apart); the ratio's median and range")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    from rollout_guard import fused_statistics

    fused_ok = gpu and fused_statistics.available()
    sizes = args.sizes or ("64x1024,256x4096,512x8192,512x16384" if gpu else "16x256,64x1024")
    rows_out = []
    for size in sizes.split(","):
        rows, length = (int(part) for part in size.lower().split("x"))
        evidence = make_batch(rows, length, device)
        trl_seconds = time_it(lambda: trl_metric_ops(evidence.trainer_logprobs, evidence.engine_logprobs, evidence.mask),
                              device, args.repeats)
        # warm calibration: 64 tokens per sample would take many steps at small sizes; 8 steps at these sizes
        reference_guard = warm_guard(GuardConfig(fused_statistics=False, calibration_warmup_tokens=1000), evidence, device, 8)
        step = iter(range(100, 10**9))
        reference_seconds = time_it(lambda: reference_guard.inspect(evidence, step=next(step), sampling=SAMPLING), device, args.repeats)
        row = {"rows": rows, "tokens_per_row": length, "tokens": rows * length, "trl_ops_ms": trl_seconds * 1e3,
               "guard_reference_ms": reference_seconds * 1e3}
        input_bytes = sum(t.element_size() * t.numel() for t in (evidence.mask, evidence.engine_logprobs, evidence.trainer_logprobs))
        row["input_mib"] = input_bytes / 2**20
        if fused_ok:
            guard = warm_guard(GuardConfig(calibration_warmup_tokens=1000), evidence, device, 8)
            assert bool(guard.calibration.warm().any()), "the benchmark should time a calibrated guard"
            row["check"] = compare_packets(evidence, guard)
            row["row_scaling"] = guard.calibration.row_scaling() is not None
            # buckets not calibrated after the warm-up: those with enough tokens take the batch's pass every step
            row["uncalibrated_buckets"] = guard.calibration.calibrated_flags().count(False)
            row["batch_pass_every_step"] = guard.calibration.uncalibrated_on(device, rows) is not None
            parameters = fused_statistics.kernel_parameters(guard.config, guard.calibration.thresholds("cpu"), device)
            row["kernel_ms"] = time_it(lambda: fused_statistics.fused_packet(evidence, guard.config, parameters), device,
                                       args.repeats) * 1e3
            row["kernel_ms_without_histograms"] = time_it(
                lambda: fused_statistics.fused_packet(evidence, guard.config, parameters, histograms=False), device, args.repeats) * 1e3
            row["kernel_ms_by_block_and_warps"] = {
                f"{block}/{warps}": time_it(lambda: fused_statistics.fused_packet(evidence, guard.config, parameters, block, warps),
                                            device, args.repeats) * 1e3
                for block, warps in ((256, 2), (256, 4), (512, 2), (512, 4), (1024, 4), (1024, 8), (2048, 8))}
            fused_seconds = time_it(lambda: guard.inspect(evidence, step=next(step), sampling=SAMPLING), device, args.repeats)
            row["guard_fused_ms"] = fused_seconds * 1e3
            row.update(changepoint_figures(guard, evidence, device, args.repeats, next(step)))
            fresh = RolloutGuard(GuardConfig(calibration_warmup_tokens=1000), device=device)

            def first_step() -> None:  # no centre known: judged around the batch's own (batch_thresholds)
                fresh.recalibrate()
                fresh.inspect(evidence, step=next(step), sampling=SAMPLING)

            row["guard_fused_first_step_ms"] = time_it(first_step, device, args.repeats) * 1e3
            # the same first step without the batch's spike reading (batch_spike_thresholds), for its cost
            fresh.calibration.uncalibrated_on = lambda *args, **kwargs: None
            row["guard_fused_first_step_centres_only_ms"] = time_it(first_step, device, args.repeats) * 1e3
            del fresh.calibration.uncalibrated_on
            untold = warm_guard(GuardConfig(calibration_warmup_tokens=1000), evidence, device, 8, sampling=None)
            row["guard_fused_untold_ms"] = time_it(lambda: untold.inspect(evidence, step=next(step)), device,
                                                   args.repeats) * 1e3  # never told: the batch's pass every step
            row["host_syncs_first_step"] = host_syncs(first_step)
            row["host_syncs_per_step"] = {"guard_fused": host_syncs(lambda: guard.inspect(evidence, step=next(step), sampling=SAMPLING)),
                                          "guard_reference": host_syncs(lambda: reference_guard.inspect(evidence, step=next(step), sampling=SAMPLING)),
                                          "trl_ops": host_syncs(lambda: trl_metric_ops(evidence.trainer_logprobs, evidence.engine_logprobs, evidence.mask))}
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            guard.inspect(evidence, step=next(step), sampling=SAMPLING)
            row["guard_extra_mib"] = (torch.cuda.max_memory_allocated(device) - before) / 2**20
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            trl_metric_ops(evidence.trainer_logprobs, evidence.engine_logprobs, evidence.mask)
            row["trl_ops_extra_mib"] = (torch.cuda.max_memory_allocated(device) - before) / 2**20
            row["fused_over_trl"] = fused_seconds / trl_seconds
            row["rounds"] = []
            for _ in range(args.rounds):  # interleaved: each ratio from two medians taken back to back
                trl_ms = 1e3 * time_it(lambda: trl_metric_ops(evidence.trainer_logprobs, evidence.engine_logprobs,
                                                              evidence.mask), device, args.repeats)
                fused_ms = 1e3 * time_it(lambda: guard.inspect(evidence, step=next(step), sampling=SAMPLING), device,
                                         args.repeats)
                row["rounds"].append({"trl_ops_ms": trl_ms, "guard_fused_ms": fused_ms, "ratio": fused_ms / trl_ms})
        row["reference_over_trl"] = reference_seconds / trl_seconds
        rows_out.append(row)
        print(json.dumps(row), flush=True)

    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    print(f"\ndevice: {name}; torch {torch.__version__}; fp32 logprobs, ~1 % corrupted rows; median of {args.repeats}")
    print(f"{'rows×tokens':>14} {'TRL ops ms':>11} {'guard ref ms':>13} {'ref/TRL':>8} {'kernel ms':>10} {'guard fused ms':>15} "
          f"{'fused/TRL':>10} {'extra MiB':>10} {'input MiB':>10} {'check':>6}")
    for row in rows_out:
        fused = row.get("guard_fused_ms")
        check = row.get("check")
        ok = "-" if check is None else ("ok" if all(check[k] for k in check if k.endswith("_equal")) else "DIFF")
        print(f"{row['rows']:>6}×{row['tokens_per_row']:<7} {row['trl_ops_ms']:>11.3f} {row['guard_reference_ms']:>13.3f} "
              f"{row['reference_over_trl']:>8.2f} {row.get('kernel_ms', math.nan):>10.3f} "
              f"{fused if fused is not None else math.nan:>15.3f} {row.get('fused_over_trl', math.nan):>10.2f} "
              f"{row.get('guard_extra_mib', math.nan):>10.2f} {row['input_mib']:>10.1f} {ok:>6}")
    for row in rows_out:
        if row.get("rounds"):
            ratios = sorted(r["ratio"] for r in row["rounds"])
            print(f"fused/TRL at {row['rows']}×{row['tokens_per_row']} in {len(ratios)} interleaved rounds: median "
                  f"{ratios[len(ratios) // 2]:.2f} (range {ratios[0]:.2f}–{ratios[-1]:.2f}; TRL ops "
                  f"{min(r['trl_ops_ms'] for r in row['rounds']):.3f}–{max(r['trl_ops_ms'] for r in row['rounds']):.3f}"
                  f" ms, guard {min(r['guard_fused_ms'] for r in row['rounds']):.3f}–"
                  f"{max(r['guard_fused_ms'] for r in row['rounds']):.3f} ms)")
    for row in rows_out:
        if "host_syncs_per_step" in row:
            print(f"host syncs per step at {row['rows']}×{row['tokens_per_row']}: {row['host_syncs_per_step']}; "
                  f"a first step (the batch's own centres and spike thresholds): "
                  f"{row['guard_fused_first_step_ms']:.3f} ms "
                  f"(centres only: {row['guard_fused_first_step_centres_only_ms']:.3f} ms), "
                  f"never told the settings: {row['guard_fused_untold_ms']:.3f} ms, "
                  f"{row['host_syncs_first_step']} host sync(s); warm guard: {row['uncalibrated_buckets']} bucket(s) "
                  f"not calibrated, batch's pass every step: {row['batch_pass_every_step']}")
    for row in rows_out:
        if "changepoint_kernel_ms" in row:
            print(f"changepoint rule at {row['rows']}×{row['tokens_per_row']}: judges {row['changepoint_judges']}; "
                  f"score {row['changepoint_kernel_ms']:.3f} ms in its kernel, {row['changepoint_torch_ms']:.3f} ms "
                  f"in torch (largest relative difference {row['changepoint_score_max_difference']:.1e}, −inf equal "
                  f"{row['changepoint_inf_equal']}); guard step {row['guard_fused_ms']:.3f} ms with the rule, "
                  f"{row['guard_fused_rule_off_ms']:.3f} ms without ({row['guard_fused_ms'] / row['trl_ops_ms']:.2f}× "
                  f"and {row['guard_fused_rule_off_ms'] / row['trl_ops_ms']:.2f}× TRL's ops); the score's kernel by "
                  f"block/warps/chunk: " + ", ".join(f"{key} {value:.3f} ms" for key, value
                                                     in row["changepoint_kernel_ms_by_block_warps_chunk"].items()))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"device": name, "torch": torch.__version__, "repeats": args.repeats, "rounds": args.rounds,
                       "rows": rows_out}, handle, indent=2)


if __name__ == "__main__":
    main()
