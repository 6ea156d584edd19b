"""After a resume every process holds one guard state, also with an output directory per process (two CPU
processes, gloo)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tests.integrations.resume_ranks import CHECKPOINT_STEP, STEPS
from tests.processes import launch

WORKER = Path(__file__).with_name("resume_ranks.py")


def _run(tiny_model_dir: Path, out: Path, phase: str) -> list[dict]:
    done = launch(WORKER, tiny_model_dir, out, phase, processes=2, timeout=300,
                  env={"TRL_EXPERIMENTAL_SILENCE": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


def test_every_process_resumes_with_the_main_processs_guard_state_without_a_shared_filesystem(tiny_model_dir,
                                                                                               tmp_path):
    """Only rank 0's checkpoint has the guard's state file; rank 1's checkpoint is the same model, optimizer and
    trainer state without it (a node that does not share rank 0's disk). After resuming and two more steps both
    ranks count every step of the run and hold the same detector state, totals and alert baselines."""
    from rollout_guard.checkpoint import STATE_FILE

    _run(tiny_model_dir, tmp_path, "first")
    saved = tmp_path / "rank0" / f"checkpoint-{CHECKPOINT_STEP}"
    assert (saved / STATE_FILE).is_file()
    shutil.copytree(saved, tmp_path / "rank1" / saved.name, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(STATE_FILE))
    ranks = _run(tiny_model_dir, tmp_path, "resume")
    for rank in ranks:
        assert rank["totals"]["steps"] == STEPS, [r["totals"]["steps"] for r in ranks]
    first, second = ranks
    for name, value in first["detector"].items():
        assert torch.equal(value, second["detector"][name]), name
    without_timings = ("history",)
    assert {k: v for k, v in first["totals"].items() if k not in without_timings} == {
        k: v for k, v in second["totals"].items() if k not in without_timings}
    assert [row["step"] for row in first["totals"]["history"]] == [row["step"] for row in second["totals"]["history"]]
    assert first["alerts"] == second["alerts"]
