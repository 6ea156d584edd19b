"""The guard under several processes: a short GRPO run with corrupted rollouts, then a check that every rank
agrees and that one process, given the same data, decides the same.

Works on GPUs (NCCL) and on CPUs (gloo); generation uses transformers (``TransformersRollouts``), so no vLLM is
needed. Launch with as many processes as you like:

    accelerate launch --multi_gpu --num_processes 2 examples/two_process_grpo.py --out runs/two_process
    python examples/two_process_grpo.py --out runs/one_process --cpu      # one process, for comparison

With ``--top-k 5 --flat --rate 0`` the engine samples a barely trained (high-entropy) policy with top-k = 5 and reports
logprobs renormalised over those 5 tokens; the guard compares the trainer's on the same support
(``GuardConfig.compare_on_engine_support``), through a hook on the model's backbone, and the check adds that it
stayed on for the whole run. Under FSDP (``accelerate launch --use_fsdp --fsdp_version 2 ...``) the hook reads an
LM head whose weights are sharded outside the forward pass.

Every rank saves what it saw (TRL's batch before and after the guard, rewards, injected rows, the guard's
report); rank 0 then checks, and writes ``checks.json``:

* identical step metrics and verdicts on every rank;
* every injected rollout quarantined, no clean one, each on the rank that holds it (zero loss mask there);
* advantages equal an independent recomputation over the gathered batch without the quarantined samples;
* ``num_items_in_batch`` equals the loss tokens left on all ranks;
* a fresh single-process guard on the concatenated batches reaches the same verdict and numbers;
* the main process's quarantine store holds one record per suspect sample of every rank (gathered to it), with
  tokens for exactly the step's ``EVIDENCE_SAMPLES`` worst (chosen from the gathered report).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EVIDENCE_SAMPLES = 2  # full evidence for the 2 worst suspects per step, statistics for the rest (checked below)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "two_process")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16, help="rollouts per process per step")
    parser.add_argument("--rate", type=float, default=0.1, help="share of rollouts corrupted")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even if a GPU is there")
    parser.add_argument("--bf16", action="store_true", help="train in bf16 (GPU)")
    parser.add_argument("--top-k", type=int, default=0, help="sample with this top_k (0: off)")
    parser.add_argument("--flat", action="store_true", help="a barely trained policy (5 training steps): high entropy")
    parser.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("ROLLOUT_GUARD_CACHE", REPO / ".cache")))
    parser.add_argument("--timeout", type=int, default=180, help="seconds before a stuck collective fails (ddp_timeout)")
    return parser.parse_args(argv)


def train(args: argparse.Namespace) -> dict:
    import torch
    from accelerate import PartialState
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rollout_guard import GuardConfig
    from rollout_guard.integrations.hf_rollouts import TransformersRollouts
    from rollout_guard.testing.tiny_model import TinyModelRecipe, build_tiny_model, copy_prompt, copy_reward, random_letters
    from rollout_guard.integrations.trl import attach_guard

    state = PartialState(cpu=args.cpu)
    with state.main_process_first():
        recipe = TinyModelRecipe(train_steps=5) if args.flat else TinyModelRecipe()
        model_dir = build_tiny_model(args.cache_dir / "models", recipe)
    rng = random.Random(7)
    dataset = Dataset.from_list([{"prompt": copy_prompt(random_letters(rng, recipe))} for _ in range(512)])

    def copy_accuracy(prompts, completions, **_):
        return [copy_reward(p, c) for p, c in zip(prompts, completions, strict=True)]

    config = GRPOConfig(
        output_dir=str(args.out / "trainer"), max_steps=args.steps, per_device_train_batch_size=args.batch, num_generations=4,
        max_completion_length=12, learning_rate=5e-4, use_vllm=False, use_cpu=args.cpu, bf16=args.bf16, logging_steps=1,
        save_strategy="no", report_to="none", seed=0, disable_tqdm=True, ddp_timeout=args.timeout,
        top_k=args.top_k,
    )
    rollouts = TransformersRollouts(stale_context_rate=args.rate, seed=3)
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=copy_accuracy, args=config, train_dataset=dataset, rollout_func=rollouts)
    guarded = attach_guard(trainer, GuardConfig(output_dir=str(args.out / "rollout_guard"), max_quarantine_share=0.9,
                                                evidence_samples_per_step=EVIDENCE_SAMPLES), keep_steps=True)
    support_at_start = guarded.support is not None
    started = time.perf_counter()
    trainer.train()
    kept = guarded.steps
    result = {
        "raw": [step.before for step in kept], "guarded": [step.after for step in kept],
        "rewards": [step.rewards_per_func for step in kept],
        "injected": [step.injected if step.injected is not None  # None: nothing injected (--rate 0)
                     else torch.zeros(step.before["completion_mask"].shape[0], dtype=torch.bool) for step in kept],
        "reports": [{"suspect": step.report.suspect, "quarantined": step.report.quarantined, "metrics": dict(step.report.metrics),
                     "samples": step.report.samples, "reasons": step.report.reasons,
                     "overhead_seconds": step.overhead_seconds, "evidence": step.evidence} for step in kept],
        "process_index": state.process_index, "num_processes": state.num_processes, "device": str(state.device),
        "train_seconds": time.perf_counter() - started, "num_generations": trainer.num_generations,
        "step_time": [row["step_time"] for row in trainer.state.log_history if "step_time" in row],
        "rate": args.rate, "top_k": args.top_k,
        "support_at_start": support_at_start, "support_at_end": guarded.support is not None,
        "guard_failures": guarded.guard.totals.failures, "distributed_type": str(trainer.accelerator.distributed_type),
    }
    torch.save(result, args.out / f"rank{state.process_index}.pt")
    state.wait_for_everyone()
    return result


def reference_advantages(rewards, group: int, excluded):
    """Per group, mean and Bessel std over the kept samples' rewards (independent of the library's code)."""
    import torch

    out = torch.zeros(rewards.shape[0])
    total = rewards.nansum(dim=1)
    for start in range(0, len(total), group):
        kept = [i for i in range(start, start + group) if not excluded[i]]
        if len(kept) >= 2:
            values = total[kept]
            for i in kept:
                out[i] = (total[i] - values.mean()) / (values.std() + 1e-4)
    return out


def check(out: Path, world: int) -> dict:
    import torch

    from rollout_guard import GuardConfig, RolloutEvidence, RolloutGuard, read_records
    from rollout_guard.selection import worst_suspects

    records = list(read_records(out / "rollout_guard" / "quarantine"))
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
    checks: dict[str, bool] = {}
    steps = len(ranks[0]["reports"])
    group = ranks[0]["num_generations"]
    rows = []
    for step in range(steps):
        reports = [r["reports"][step] for r in ranks]
        first = {k: v for k, v in reports[0]["metrics"].items() if k not in ("guard_seconds", "overhead_seconds")}
        identical = all(
            all(v == r["metrics"].get(k) or (math.isnan(v) and math.isnan(r["metrics"].get(k, 0.0))) for k, v in first.items())
            and torch.equal(r["suspect"], reports[0]["suspect"])
            for r in reports
        )
        injected = torch.cat([r["injected"][step] for r in ranks])
        local = len(ranks[0]["injected"][step])
        quarantined = reports[0]["quarantined"]
        on_owner = all(
            not r["guarded"][step]["completion_mask"][injected[i * local : (i + 1) * local]].any() for i, r in enumerate(ranks)
        )
        rewards = ranks[0]["rewards"][step]
        expected = reference_advantages(rewards, group, quarantined)
        advantages = torch.cat([r["guarded"][step]["advantages"] for r in ranks])
        tokens = sum(int(r["guarded"][step]["completion_mask"].sum()) for r in ranks)
        normalisers = {int(r["guarded"][step]["num_items_in_batch"]) for r in ranks}
        width = max(r["evidence"]["mask"].shape[1] for r in reports)

        def concatenated(key: str):
            return torch.cat([torch.nn.functional.pad(r["evidence"][key], (0, width - r["evidence"][key].shape[1])) for r in reports])

        alone = RolloutGuard(GuardConfig(max_quarantine_share=0.9)).inspect(
            RolloutEvidence(mask=concatenated("mask"), engine_logprobs=concatenated("engine"), trainer_logprobs=concatenated("trainer")),
            step=step + 1,
        )
        row = {
            "step": step + 1,
            "identical_on_all_ranks": identical,
            "quarantined_equals_injected": torch.equal(quarantined, injected),
            "excluded_on_owner_rank": on_owner,
            "advantages_match_reference": bool(torch.allclose(advantages, expected, atol=1e-4)),
            "normaliser_matches_tokens_left": normalisers == {tokens},
            "one_process_same_verdict": torch.equal(alone.suspect, reports[0]["suspect"])
            and alone.metrics["max_abs_delta"] == reports[0]["metrics"]["max_abs_delta"]
            and alone.metrics["tokens"] == reports[0]["metrics"]["tokens"],
            "injected": int(injected.sum()), "quarantined": int(quarantined.sum()), "rollouts": len(injected),
            "max_abs_delta": reports[0]["metrics"]["max_abs_delta"], "kept_max_abs_delta": reports[0]["metrics"]["kept_max_abs_delta"],
            "guard_ms": [round(r["metrics"]["guard_seconds"] * 1000, 3) for r in reports],
        }
        # every suspect sample has one record, gathered from its rank to the main process; tokens for the worst K
        mine = [record for record in records if record.step == step + 1]
        suspect_rows = torch.nonzero(reports[0]["suspect"]).flatten().tolist()
        row["records_on_main"] = (sorted(record.global_row for record in mine) == suspect_rows
                                  and all(record.process_index == record.global_row // local for record in mine))
        row["full_evidence_for_worst_k"] = ({record.global_row for record in mine if record.full_evidence}
                                            == set(worst_suspects(reports[0]["samples"], reports[0]["reasons"], EVIDENCE_SAMPLES).tolist()))
        rows.append(row)
    for key in ("identical_on_all_ranks", "quarantined_equals_injected", "excluded_on_owner_rank",
                "advantages_match_reference", "normaliser_matches_tokens_left", "one_process_same_verdict", "records_on_main",
                "full_evidence_for_worst_k"):
        checks[key] = all(row[key] for row in rows)
    if ranks[0]["rate"] > 0:
        checks["enough_injected"] = sum(row["injected"] for row in rows) >= 3
    checks["no_guard_failures"] = all(r["guard_failures"] == 0 for r in ranks)
    if ranks[0]["top_k"] > 0:  # the trainer's logprobs compared on the engine's top-k support, every step
        checks["on_engine_support_throughout"] = all(r["support_at_start"] and r["support_at_end"] for r in ranks)
    return {"world_size": world, "device": ranks[0]["device"], "distributed_type": ranks[0]["distributed_type"],
            "top_k": ranks[0]["top_k"], "checks": checks, "all_passed": all(checks.values()),
            "steps": rows, "train_seconds": ranks[0]["train_seconds"], "step_time": ranks[0]["step_time"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    result = train(args)
    if result["process_index"] != 0:
        return 0
    summary = check(args.out, result["num_processes"])
    (args.out / "checks.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "steps"}, indent=2))
    for row in summary["steps"]:
        print(json.dumps(row))
    return 0 if summary["all_passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
