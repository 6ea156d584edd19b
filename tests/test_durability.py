"""Durability of the guard's files: fsync where a crash could lose them, and one line per step after a resume."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from rollout_guard.config import GuardConfig
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.guard import RolloutGuard
from rollout_guard.checkpoint import STATE_FILE, load_state, save_state, saved_step
from rollout_guard.outputs.records import QuarantineRecord
from rollout_guard.outputs.sinks import LocalFilesSink
from rollout_guard.outputs.store import QuarantineStore, read_records


@pytest.fixture
def fsynced(monkeypatch) -> list[str]:
    """Paths (files and folders) fsynced while the test runs."""
    synced: list[str] = []
    original = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        original(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def record(step: int, row: int = 0) -> QuarantineRecord:
    return QuarantineRecord(
        step=step, process_index=0, row=row, global_row=row, group_size=4, action="quarantined", rules=["score"],
        stats={"max_abs_delta": 12.5}, prompt_ids=[1], completion_ids=[3], prompt_text="a=", completion_text="x",
        completion_tokens=["x"], engine_logprobs=[-0.1], trainer_logprobs=[-9.0], reward=0.25, rewards_per_func={"copy": 0.25},
        advantage_before=-1.0, advantage_after=0.0, sampling={}, model="tiny", engine={"name": "vllm"},
    )


def evidence(corrupt: bool) -> RolloutEvidence:
    trainer = torch.full((4, 5), -0.05)
    if corrupt:
        trainer[1] = -10.0
    return RolloutEvidence(mask=torch.ones(4, 5, dtype=torch.long), engine_logprobs=torch.full((4, 5), -0.05), trainer_logprobs=trainer)


def test_checkpoint_state_is_fsynced_file_then_folder(tmp_path, fsynced):
    guard = RolloutGuard(GuardConfig())
    guard.inspect(evidence(True), step=1)
    path = save_state(guard, tmp_path, global_step=7)
    assert str(tmp_path / "rollout_guard_state.partial") in fsynced, "the file's content before the rename"
    assert fsynced.index(str(tmp_path / "rollout_guard_state.partial")) < fsynced.index(str(tmp_path)), "then the folder"
    assert path.name == STATE_FILE and not (tmp_path / "rollout_guard_state.partial").exists()
    restored = RolloutGuard(GuardConfig())
    state = load_state(restored, tmp_path)
    assert saved_step(state) == 7 and restored.totals.steps == 1


def test_a_new_store_file_fsyncs_its_folder_once(tmp_path, fsynced):
    store = QuarantineStore(tmp_path, max_file_bytes=1)
    store.append([record(1)])
    store.append([record(2)])  # rotates: a second new file
    store.close()
    assert fsynced.count(str(tmp_path)) == 2
    fsynced.clear()
    again = QuarantineStore(tmp_path)  # appending to an existing file needs no folder fsync
    again.append([record(3)])
    again.close()
    assert str(tmp_path) not in fsynced and len(fsynced) == 1


def test_resume_leaves_one_line_per_step(tmp_path):
    """A run writes steps 1–4, checkpoints at 2, is killed, resumes from 2 and writes 3–4 again."""
    config = GuardConfig(alert_cooldown_steps=1)
    guard, sink = RolloutGuard(config), LocalFilesSink(tmp_path, config)
    for step in range(1, 5):
        report = guard.inspect(evidence(corrupt=True), step=step)
        sink.on_records([record(step, 1)], guard)
        sink.on_step(report, guard)
        if step == 2:
            save_state(guard, tmp_path, global_step=2)
    assert len(list(read_records(tmp_path / "quarantine"))) == 4

    resumed, resumed_sink = RolloutGuard(config), LocalFilesSink(tmp_path, config)  # a new process
    resumed_sink.on_resume(saved_step(load_state(resumed, tmp_path)), resumed)
    for step in (3, 4):
        report = resumed.inspect(evidence(corrupt=True), step=step)
        resumed_sink.on_records([record(step, 1)], resumed)
        resumed_sink.on_step(report, resumed)
    resumed_sink.on_end(resumed)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert [(r.step, r.row) for r in read_records(tmp_path / "quarantine")] == [(1, 1), (2, 1), (3, 1), (4, 1)]
    alerts = [(row["step"], row["kind"]) for row in map(json.loads, (tmp_path / "alerts.jsonl").read_text().splitlines())]
    assert alerts and len(alerts) == len(set(alerts))


def test_resume_keeps_lines_it_cannot_read(tmp_path):
    sink = LocalFilesSink(tmp_path, GuardConfig())
    sink.store.append([record(1), record(3)])
    with (Path(tmp_path) / "quarantine" / "quarantine-00000.jsonl").open("ab") as handle:
        handle.write(b"garbage\n")
    sink.on_resume(2, RolloutGuard(GuardConfig()))
    text = (Path(tmp_path) / "quarantine" / "quarantine-00000.jsonl").read_bytes()
    assert text.count(b"\n") == 2 and text.endswith(b"garbage\n") and b'"step":3' not in text
