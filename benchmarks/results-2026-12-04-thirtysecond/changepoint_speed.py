"""What the ``changepoint`` rule costs per step: the guard's ``inspect`` with ``changepoint_budget`` off and on,
side by side in one run, on healthy batches after a warm-up (so that the rule judges), and the score alone.

    python benchmarks/results-2026-12-04-thirtysecond/changepoint_speed.py [--device cuda] [--profile]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollout_guard import GuardConfig, RolloutEvidence, RolloutGuard  # noqa: E402
from rollout_guard.changepoint import changepoint_score  # noqa: E402

app = typer.Typer(add_completion=False)


def batches(rows: int, length: int, device: str, count: int) -> list[RolloutEvidence]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        engine = -torch.rand(rows, length, generator=generator) * 4
        trainer = engine - 0.02 - 0.3 * torch.randn(rows, length, generator=generator)
        out.append(RolloutEvidence(mask=torch.ones(rows, length, dtype=torch.long, device=device),
                                   engine_logprobs=engine.to(device), trainer_logprobs=trainer.to(device)))
    return out


def per_step(guard: RolloutGuard, data: list[RolloutEvidence], device: str, warm: int = 12) -> float:
    for step, evidence in enumerate(data[:warm]):
        guard.inspect(evidence, step=step, sampling=(1.0,))
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for step, evidence in enumerate(data[warm:], start=warm):
        guard.inspect(evidence, step=step, sampling=(1.0,))
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / (len(data) - warm)


@app.command()
def main(device: str = typer.Option("cpu"), steps: int = typer.Option(8, help="timed steps after 12 of warm-up"),
         profile: bool = typer.Option(False, help="print the top ops of one step with the rule on")) -> None:
    print(f"device {device}; ms per guard step (inspect), rule off / on, and the score alone")
    for rows, length in ((64, 1024), (256, 1024), (256, 4096)):
        data = batches(rows, length, device, 12 + steps)
        off = per_step(RolloutGuard(GuardConfig(), device=device), data, device)
        guard = RolloutGuard(GuardConfig(changepoint_budget=0.0002), device=device)
        on = per_step(guard, data, device)
        assert guard.calibration.changepoint_threshold_value() is not None, "the rule must judge"
        centre, spread = guard.calibration.changepoint_noise(device)
        evidence = data[-1]
        changepoint_score(evidence.engine_logprobs, evidence.trainer_logprobs, evidence.mask, centre, spread)
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(steps):
            changepoint_score(evidence.engine_logprobs, evidence.trainer_logprobs, evidence.mask, centre, spread)
        if device == "cuda":
            torch.cuda.synchronize()
        alone = (time.perf_counter() - started) / steps
        print(f"{rows}x{length}: off {1e3 * off:.2f} ms, on {1e3 * on:.2f} ms ({on / off:.2f}x); "
              f"score alone {1e3 * alone:.2f} ms", flush=True)
        if profile:
            from torch.profiler import ProfilerActivity, profile as run_profile
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
            with run_profile(activities=activities) as prof:
                guard.inspect(evidence, step=99, sampling=(1.0,))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    app()
