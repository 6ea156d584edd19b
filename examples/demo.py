"""Demo: a short GRPO run (real TRL, real vLLM CPU build, tiny locally built model) with corrupted rollouts.

A tiny character-level model, trained locally in seconds to copy strings ("abc=" -> "abc"), is fine-tuned with
GRPO (reward: share of letters copied). vLLM generates the rollouts in colocate mode. A fault injector corrupts
rollouts at a known rate the way stale engine state does (the engine generates from another request's
context); the guard, attached with one line, must quarantine exactly those. Prints a per-step table and a
summary; writes the evidence of each quarantined sample and a spike chart under --output-dir.

    python examples/demo.py --steps 60 --rate 0.05
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="GRPO optimizer steps (default 60)")
    parser.add_argument("--rate", type=float, default=0.05, help="share of rollouts corrupted (default 0.05)")
    parser.add_argument("--batch", type=int, default=16, help="rollouts per step (default 16)")
    parser.add_argument("--group", type=int, default=4, help="rollouts per prompt, GRPO group size (default 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=("quarantine", "monitor"), default="quarantine")
    parser.add_argument("--arch", choices=("llama", "falcon_h1"), default="llama", help="tiny model architecture")
    parser.add_argument("--output-dir", type=Path, default=REPO / "runs" / "demo")
    parser.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("ROLLOUT_GUARD_CACHE", REPO / ".cache")))
    parser.add_argument("--report-to", default="none", help="TRL report_to: none, wandb (offline unless WANDB_MODE is set), trackio")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_CACHE_ROOT", str(args.cache_dir / "vllm"))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if "wandb" in args.report_to:
        os.environ.setdefault("WANDB_MODE", "offline")  # no account needed; `wandb sync` uploads later
        os.environ.setdefault("WANDB_DIR", str(args.output_dir))
        os.environ.setdefault("WANDB_PROJECT", "rollout-guard-demo")

    from datasets import Dataset
    from rich.console import Console
    from rich.table import Table
    from trl import GRPOConfig, GRPOTrainer

    from rollout_guard import GuardConfig
    from rollout_guard.testing.tiny_model import TinyModelRecipe, build_tiny_model, copy_prompt, copy_reward, random_letters
    from rollout_guard.integrations.trl import attach_guard, default_sinks, inject_stale_context
    from rollout_guard.integrations.vllm_cpu import enable_trl_colocate_on_vllm_cpu
    from rollout_guard.outputs.sinks import StepTableSink

    console = Console()
    for previous in ("rollout_guard", "trainer", "wandb", "summary.json"):  # this demo's own earlier output
        path = args.output_dir / previous
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    started = time.perf_counter()
    recipe = TinyModelRecipe(architecture=args.arch)
    model_dir = build_tiny_model(args.cache_dir / "models", recipe)
    console.print(f"tiny model: {model_dir} ({time.perf_counter() - started:.1f} s)")

    rng = random.Random(args.seed)
    prompts = [copy_prompt(random_letters(rng, recipe)) for _ in range(args.steps * args.batch // args.group + args.group)]
    dataset = Dataset.from_list([{"prompt": prompt} for prompt in prompts])

    def copy_accuracy(prompts, completions, **_):  # noqa: ANN001
        return [copy_reward(prompt, completion) for prompt, completion in zip(prompts, completions, strict=True)]

    enable_trl_colocate_on_vllm_cpu()
    training = GRPOConfig(
        output_dir=str(args.output_dir / "trainer"), max_steps=args.steps, per_device_train_batch_size=args.batch,
        num_generations=args.group, max_completion_length=12, learning_rate=5e-4, use_vllm=True, vllm_mode="colocate",
        vllm_max_model_length=64, bf16=False, use_cpu=True, logging_steps=5, save_strategy="no",
        report_to=args.report_to, seed=args.seed, disable_tqdm=True, log_completions=False,
    )
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=copy_accuracy, args=training, train_dataset=dataset)

    guard_dir = args.output_dir / "rollout_guard"
    config = GuardConfig(mode=args.mode, output_dir=str(guard_dir))
    sinks = default_sinks(training.report_to, config, guard_dir) + [StepTableSink(console)]
    guarded = attach_guard(trainer, config, sinks=sinks)
    inject_stale_context(trainer, rate=args.rate, seed=args.seed)

    train_started = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - train_started
    history = trainer.state.log_history
    step_seconds = [row["step_time"] for row in history if "step_time" in row]

    rewards = [row["reward"] for row in history if "reward" in row and "train_runtime" not in row]
    summary = guarded.guard.summary()
    history_rows = guarded.guard.totals.history
    guard_ms = [row.get("guard_seconds", float("nan")) for row in history_rows]
    result = {
        "rollouts": summary["rollouts"],
        "injected": summary.get("injected", 0),
        "quarantined": summary["quarantined"],
        "caught": summary.get("caught", 0),
        "missed": summary.get("missed", 0),
        "false_quarantines": summary.get("false_alarms", 0),
        "rules": {key.removeprefix("rule/"): value for key, value in summary.items() if key.startswith("rule/")},
        "steps": summary["steps"],
        "mean_reward": round(sum(rewards) / len(rewards), 3) if rewards else None,  # TRL's log, all rollouts
        "train_seconds": round(train_seconds, 2),
        "mean_step_seconds_trl": round(sum(step_seconds) / len(step_seconds), 4) if step_seconds else None,
        "mean_guard_seconds": round(sum(guard_ms) / len(guard_ms), 5) if guard_ms else None,
        "evidence": str(guard_dir / "quarantine"),
        "spike_chart": str(guard_dir / "spikes.png"),
        "metrics": str(guard_dir / "metrics.jsonl"),
        "total_seconds": round(time.perf_counter() - started, 1),
    }
    table = Table(title="rollout_guard demo summary", show_header=False)
    for key, value in result.items():
        table.add_row(key, json.dumps(value) if isinstance(value, dict) else str(value))
    console.print(table)
    (args.output_dir / "summary.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    outcome = main()
    sys.exit(0 if outcome["missed"] == 0 and outcome["false_quarantines"] == 0 else 1)
