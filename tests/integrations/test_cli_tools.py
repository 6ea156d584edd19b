"""rollout-guard audit and replay against a real vLLM engine (CPU build) and transformers."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_guard.testing.tiny_model import TinyModelRecipe, copy_prompt, random_letters
from rollout_guard.outputs.store import read_records


def cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollout_guard.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    rng = random.Random(11)
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(copy_prompt(random_letters(rng, TinyModelRecipe())) for _ in range(12)) + "\n")
    return path


@pytest.fixture(scope="module")
def injected_audit(tmp_path_factory, tiny_model_dir, prompt_file) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("audit_injected")
    done = cli("audit", str(tiny_model_dir), "--prompts", str(prompt_file), "--inject-rate", "0.3", "--max-tokens", "12", "-o", str(out))
    return done, out


def test_audit_of_a_clean_deployment_agrees(tmp_path, tiny_model_dir, prompt_file):
    done = cli("audit", str(tiny_model_dir), "--prompts", str(prompt_file), "--max-tokens", "12", "-o", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "verdict: agrees" in done.stdout
    metrics = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["samples"] == 48 and metrics["suspect"] == 0 and metrics["max_abs_delta"] < 1e-3


def test_audit_flags_exactly_the_injected_samples(injected_audit):
    done, out = injected_audit
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = list(read_records(out / "quarantine"))
    assert len(records) >= 5 and all(record.injected for record in records)
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["missed"] == 0 and metrics["false_alarms"] == 0 and metrics["caught"] == len(records)


def test_replay_tells_stale_state_from_a_reproducible_disagreement(injected_audit):
    _, out = injected_audit
    done = cli("replay", str(out / "quarantine"), "--index", "0")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "fresh engine vs replayed trainer" in done.stdout and "suspect: False" in done.stdout
    assert "conclusion: a fresh engine agrees with the trainer" in done.stdout
    missing = cli("replay", str(out / "quarantine"), "--step", "99")
    assert missing.returncode == 2 and "no record with step=99" in missing.stderr
