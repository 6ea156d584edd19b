"""What the sinks cost per step: local files and W&B (offline), with and without chart images.

    python benchmarks/sink_overhead.py --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rollout_guard import GuardConfig, QuarantineRecord, RolloutEvidence, RolloutGuard
from rollout_guard.outputs.sinks import LocalFilesSink


def record(step: int) -> QuarantineRecord:
    return QuarantineRecord(
        step=step, process_index=0, row=0, global_row=0, group_size=4, action="quarantined", rules=["score"],
        stats={"max_abs_delta": 12.0, "onset_token": 0.0}, prompt_ids=[1] * 64, completion_ids=[2] * 256,
        prompt_text="p" * 64, completion_text="c" * 256, completion_tokens=["c"] * 256, engine_logprobs=[-0.1] * 256,
        trainer_logprobs=[-9.0] * 256, reward=0.0, rewards_per_func={}, advantage_before=0.0, advantage_after=0.0,
        sampling={}, model="m", engine={},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    from rollout_guard.integrations.wandb import WandbSink

    directory = Path(tempfile.mkdtemp())
    os.environ["WANDB_DIR"] = str(directory)
    wandb.init(project="rollout-guard-bench")
    config = GuardConfig(image_every_steps=50, spike_image_min_gap_steps=10, max_quarantine_share=None)
    guard = RolloutGuard(config)
    sinks = {"local files": LocalFilesSink(directory / "guard", config), "wandb": WandbSink(config, directory / "images")}
    timings: dict[str, dict[str, list[float]]] = {name: {"plain": [], "with images": []} for name in sinks}
    generator = torch.Generator().manual_seed(0)
    for step in range(1, args.steps + 1):
        engine = -torch.rand(args.rows, args.tokens, generator=generator)
        trainer = engine.clone()
        spike = step % 7 == 0
        if spike:
            trainer[0] -= 9.0
        report = guard.inspect(RolloutEvidence(mask=torch.ones(args.rows, args.tokens, dtype=torch.long),
                                               engine_logprobs=engine, trainer_logprobs=trainer), step=step)
        for name, sink in sinks.items():
            images_due = name == "wandb" and sink._images_due(report)
            started = time.perf_counter()
            if spike:
                sink.on_records([record(step)], guard)
            sink.on_step(report, guard)
            timings[name]["with images" if images_due else "plain"].append(time.perf_counter() - started)
    wandb.finish()
    summary = {name: {kind: {"steps": len(values), "median_ms": round(statistics.median(values) * 1000, 2) if values else None}
                      for kind, values in kinds.items()} for name, kinds in timings.items()}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
