"""examples/two_process_grpo.py (the script of the two-GPU run) with two CPU processes (gloo), as CI can run it."""

from __future__ import annotations

import json
from pathlib import Path

from tests.processes import launch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "two_process_grpo.py"


def run_example(out: Path, *args: str) -> dict:
    """The example on two CPU processes (``accelerate launch``, gloo); its ``checks.json``."""
    done = launch(EXAMPLE, "--out", str(out), "--cpu", "--timeout", "120", *args, processes=2)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return json.loads((out / "checks.json").read_text())


def test_two_cpu_processes_with_transformers_rollouts(tmp_path):
    summary = run_example(tmp_path, "--steps", "4")
    assert summary["world_size"] == 2 and summary["all_passed"], summary["checks"]
    assert sum(step["quarantined"] for step in summary["steps"]) >= 3
    assert all(step["kept_max_abs_delta"] < 1e-3 for step in summary["steps"])  # transformers engine = fp32 trainer


def test_two_cpu_processes_compare_on_the_engine_top_k_support(tmp_path):
    """A barely trained policy sampled with top_k = 5, no corruption: each process's hook (under DDP) gives the
    trainer's logprobs on the engine's support every step, so the clean samples agree to fp32 noise (off the
    support they differ by ≈ 1 nat, the log of the mass outside the top 5) and none is flagged."""
    summary = run_example(tmp_path, "--steps", "3", "--top-k", "5", "--flat", "--rate", "0")
    assert summary["world_size"] == 2 and summary["top_k"] == 5 and summary["all_passed"], summary["checks"]
    assert summary["checks"]["on_engine_support_throughout"] and summary["checks"]["no_guard_failures"]
    assert all(step["quarantined"] == 0 and step["kept_max_abs_delta"] < 1e-3 for step in summary["steps"])
