"""The real engine-level stale-state fault (vLLM PR #32118, reinstated by FAULT INJECTION FOR TESTS) on vLLM CPU.

Generates with vLLM (bf16) from the same copy prompts under stress conditions twice, in two processes: once
with ``rollout_guard.testing.engine_faults`` switched on, once with vLLM as shipped. Every rollout is
re-scored with transformers (float32) given its true prompt: that is the ground truth. Prints, per condition, how
many rollouts disagree (max |Δ| above 1, 3 and 8 nats), their |Δ| profile (max, mean over their tokens, the
engine's logprob of the worst token), what the guard's defaults flag, and how often the fault fired. ``--json``
keeps every rollout's per-token engine and trainer logprobs (``benchmarks/real_engine_detection.py`` reads them).

    python benchmarks/stale_state_fault.py                       # builds the tiny Mamba2 model (~6 min) once
    python benchmarks/stale_state_fault.py --prompts 64 --rounds 3 --json results.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
THRESHOLDS = (1.0, 3.0, 8.0)


def run_condition(args: argparse.Namespace) -> dict:
    """One condition, in this process: generate, re-score, summarise every rollout."""
    import torch

    from rollout_guard.testing import engine_faults
    from rollout_guard.testing.tiny_model import copy_prompt
    from rollout_guard.integrations.vllm_tools import StressSettings, audit

    if args.condition == "fault":
        engine_faults.enable_stale_mamba_state_fault()
    rng = random.Random(args.seed)
    letters = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8))) for _ in range(args.prompts)]
    prompt_file = Path(tempfile.mkdtemp()) / "prompts.txt"
    prompt_file.write_text("\n".join(copy_prompt(text) for text in letters) + "\n")
    settings = StressSettings.stress(max_num_seqs=args.max_num_seqs, cache_blocks=args.cache_blocks,
                                     prefix_caching=args.prefix_caching, rounds=args.rounds)
    result = audit(args.model, prompt_file=prompt_file, samples_per_prompt=args.samples, max_tokens=args.max_tokens,
                   dtype="bfloat16", seed=args.seed, stress=settings, trainer_dtype="float32")
    rows = []
    for engine, trainer in zip(result.engine_logprobs, result.trainer_logprobs, strict=True):
        e = torch.tensor([float("nan") if v is None else v for v in engine], dtype=torch.float64)
        t = torch.tensor(trainer, dtype=torch.float64)
        delta = (e - t).abs().nan_to_num(nan=float("inf"))
        worst = int(delta.argmax()) if len(delta) else -1
        rows.append({"tokens": len(delta), "max": float(delta.max()) if len(delta) else 0.0,
                     "mean": float(delta.mean()) if len(delta) else 0.0,
                     "worst_engine_logprob": float(e[worst]) if worst >= 0 else None,
                     "engine": e.tolist(), "trainer": t.tolist()})
    return {"condition": args.condition, "conditions": result.conditions, "samples": rows,
            "suspect": int(result.report.metrics["suspect"]), "fault_stats": dict(engine_faults.FAULT_STATS)}


def summary(result: dict) -> list[str]:
    rows = result["samples"]
    lines = [f"{result['condition']}: {len(rows)} rollouts, {sum(r['tokens'] for r in rows)} tokens; guard (defaults) "
             f"flags {result['suspect']}; new 1-token requests run as decodes: {result['fault_stats']['new_rows_run_as_decode']}"]
    for threshold in THRESHOLDS:
        hit = [r for r in rows if r["max"] > threshold]
        if not hit:
            lines.append(f"  max |Δ| > {threshold:g} nats: 0")
            continue
        worst = sorted(r["worst_engine_logprob"] for r in hit if r["worst_engine_logprob"] is not None)
        lines.append(f"  max |Δ| > {threshold:g} nats: {len(hit)} ({100 * len(hit) / len(rows):.1f} %); their max |Δ| "
                     f"{min(r['max'] for r in hit):.2f}–{max(r['max'] for r in hit):.2f}, mean |Δ| per token "
                     f"{min(r['mean'] for r in hit):.2f}–{max(r['mean'] for r in hit):.2f}, engine logprob of the worst "
                     f"token {worst[0]:.2f}–{worst[-1]:.2f} (median {worst[len(worst) // 2]:.2f})")
    clean = [r for r in rows if r["max"] <= THRESHOLDS[0]]
    if clean:
        lines.append(f"  the others: max |Δ| ≤ {max(r['max'] for r in clean):.3f} nats, mean |Δ| per token ≤ "
                     f"{max(r['mean'] for r in clean):.3f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="A Mamba2 model folder (default: build the tiny copy model, MAMBA2_RECIPE)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--cache-blocks", type=int, default=None)
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="Also write both conditions' per-rollout figures here")
    parser.add_argument("--condition", choices=("fault", "shipped"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.condition:
        args.out.write_text(json.dumps(run_condition(args)))
        return
    if args.model is None:
        from rollout_guard.testing.tiny_model import MAMBA2_RECIPE, build_tiny_model

        args.model = str(build_tiny_model(REPO / ".cache" / "models", MAMBA2_RECIPE))
    results = {}
    for condition in ("fault", "shipped"):
        out = Path(tempfile.mkdtemp()) / f"{condition}.json"
        command = [sys.executable, __file__, "--condition", condition, "--out", str(out)]
        for name in ("model", "prompts", "samples", "rounds", "max_tokens", "max_num_seqs", "seed"):
            command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        if args.cache_blocks:
            command += ["--cache-blocks", str(args.cache_blocks)]
        command.append("--prefix-caching" if args.prefix_caching else "--no-prefix-caching")
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(REPO)}
        subprocess.run(command, check=True, env=env)
        results[condition] = json.loads(out.read_text())
    print("conditions: " + "; ".join(results["fault"]["conditions"]))
    for condition in ("fault", "shipped"):
        print("\n".join(summary(results[condition])))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
