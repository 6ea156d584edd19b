"""What the guard costs as a user feels it: whole GRPO training steps with and without it, interleaved, beside the
guard's own timers, and the time ``train()`` takes after its last step with and without it.

The demo's set-up (the tiny copy model, real TRL, the real vLLM CPU build in colocate mode, 16 rollouts per step, 5 %
of them corrupted by the stale-context injector). One run with the guard attached (``attach_guard``, default
sinks): its steps alternate between the guard judging the batch (``guard_batch``, the adapter's whole per-step
work up to handing the sinks' work to the background writer) and the batch passing straight to the loss, so that
both halves see the same engine, model and machine load. Per step, the wall time between TRL's ``on_step_end``
callbacks (generation, scoring, the guard when on, the loss and the optimizer step); beside it the guard's own
timers of the judged steps (``guard_seconds``: ``RolloutGuard.inspect``; ``overhead_seconds``: the adapter's
whole step). Then a second trainer without the guard: the time from its last ``on_step_end`` to ``train()``
returning, against the same for the guarded run (the guard flushes its writer, draws the final charts and writes
the summary there).

    python benchmarks/training_step_ab.py --steps 60 --out runs/training_step_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_trainer(args: argparse.Namespace, output_dir: Path):
    """A GRPOTrainer as the demo builds it, and the time of each ``on_step_end`` (a list it appends to)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rollout_guard.integrations.vllm_cpu import enable_trl_colocate_on_vllm_cpu
    from rollout_guard.testing.tiny_model import (TinyModelRecipe, build_tiny_model, copy_prompt, copy_reward,
                                                  random_letters)

    recipe = TinyModelRecipe()
    model_dir = build_tiny_model(args.cache_dir / "models", recipe)
    rng = random.Random(args.seed)
    prompts = [copy_prompt(random_letters(rng, recipe)) for _ in range(args.steps * args.batch // args.group + args.group)]

    def copy_accuracy(prompts, completions, **_):  # noqa: ANN001
        return [copy_reward(prompt, completion) for prompt, completion in zip(prompts, completions, strict=True)]

    enable_trl_colocate_on_vllm_cpu()
    training = GRPOConfig(
        output_dir=str(output_dir), max_steps=args.steps, per_device_train_batch_size=args.batch,
        num_generations=args.group, max_completion_length=12, learning_rate=5e-4, use_vllm=True, vllm_mode="colocate",
        vllm_max_model_length=64, bf16=False, use_cpu=True, logging_steps=5, save_strategy="no", report_to="none",
        seed=args.seed, disable_tqdm=True, log_completions=False,
    )
    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, *_, **__):  # noqa: ANN002, ANN003
            ends.append(time.perf_counter())

    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=copy_accuracy, args=training,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]), callbacks=[StepClock()])
    return trainer, ends


def main() -> None:  # noqa: PLR0915 - one measurement, top to bottom
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--rate", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out (engine and allocator warm-up)")
    parser.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("ROLLOUT_GUARD_CACHE", REPO / ".cache")))
    parser.add_argument("--work-dir", type=Path, default=REPO / "runs" / "training_step_ab")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plain", action="store_true", help="run the trainer without the guard only (the parent "
                        "runs this in a child process: one vLLM engine per process)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CACHE_ROOT", str(args.cache_dir / "vllm"))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    if args.plain:  # what train() takes after its last step without the guard
        plain, plain_ends = build_trainer(args, args.work_dir / "plain")
        started = time.perf_counter()
        plain.train()
        print("PLAIN " + json.dumps({"after_last_step_s": time.perf_counter() - plain_ends[-1],
                                     "train_s": time.perf_counter() - started}), flush=True)
        return

    from rollout_guard import GuardConfig
    from rollout_guard.integrations.trl import attach_guard, default_sinks, inject_stale_context

    # the same training without the guard, in a child process started first (before this process sets up
    # vLLM's and torch.distributed's environment)
    child = subprocess.run([sys.executable, __file__, "--plain", "--steps", str(args.steps), "--batch", str(args.batch),
                            "--group", str(args.group), "--seed", str(args.seed), "--cache-dir", str(args.cache_dir),
                            "--work-dir", str(args.work_dir)], capture_output=True, text=True, check=True)
    plain = json.loads(next(line for line in child.stdout.splitlines() if line.startswith("PLAIN "))[6:])
    plain_end, plain_seconds = plain["after_last_step_s"], plain["train_s"]

    # the guarded run, its steps alternating: the guard judges odd steps, even ones pass straight to the loss
    trainer, ends = build_trainer(args, args.work_dir / "guarded")
    guard_dir = args.work_dir / "guarded" / "rollout_guard"
    config = GuardConfig(output_dir=str(guard_dir))
    guarded = attach_guard(trainer, config, sinks=default_sinks("none", config, guard_dir))
    inject_stale_context(trainer, rate=args.rate, seed=args.seed)
    judge = guarded.guard_batch
    judged: list[bool] = []

    def alternate(batch):  # noqa: ANN001, ANN202
        on = len(judged) % 2 == 0
        judged.append(on)
        return judge(batch) if on else batch

    guarded.guard_batch = alternate
    started = time.perf_counter()
    trainer.train()
    guarded_end = time.perf_counter() - ends[-1]
    guarded_seconds = time.perf_counter() - started
    steps = [(judged[i], ends[i] - ends[i - 1]) for i in range(max(args.warmup, 1), min(len(ends), len(judged)))]
    on = [seconds for is_on, seconds in steps if is_on]
    off = [seconds for is_on, seconds in steps if not is_on]
    rows = [json.loads(line) for line in (guard_dir / "metrics.jsonl").read_text().splitlines()]
    guard_ms = [1e3 * row["guard_seconds"] for row in rows if row.get("guard_seconds") is not None]
    adapter_ms = [1e3 * row["overhead_seconds"] for row in rows if row.get("overhead_seconds") is not None]


    def median_ms(values: list[float]) -> float:
        return 1e3 * statistics.median(values) if values else float("nan")

    result = {
        "steps": args.steps, "rollouts_per_step": args.batch, "steps_compared": {"judged": len(on), "passed": len(off)},
        "step_ms_median": {"judged": median_ms(on), "passed": median_ms(off)},
        "step_ms_quartiles": {"judged": [1e3 * q for q in statistics.quantiles(on, n=4)],
                              "passed": [1e3 * q for q in statistics.quantiles(off, n=4)]},
        "guard_seconds_ms_median": statistics.median(guard_ms), "adapter_overhead_ms_median": statistics.median(adapter_ms),
        "after_last_step_s": {"guarded": guarded_end, "plain": plain_end},
        "train_s": {"guarded": guarded_seconds, "plain": plain_seconds},
    }
    result["step_ms_difference"] = result["step_ms_median"]["judged"] - result["step_ms_median"]["passed"]
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
