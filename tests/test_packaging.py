"""The distribution installs `integrations/` as `rollout_guard.integrations`, in a wheel as in editable mode."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_wheel_maps_integrations_under_the_package(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next(tmp_path.glob("rollout_guard-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("trl", "vllm_cpu", "hf_rollouts", "wandb", "trackio", "tiny_model", "vllm_tools", "rescoring",
                   "testing_faults"):
        assert f"rollout_guard/integrations/{module}.py" in names, module
    assert not any(name.startswith(("integrations/", "tests/", "examples/")) for name in names)
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "rollout-guard = rollout_guard.cli:app" in entry_points
    target = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    probe = subprocess.run([sys.executable, "-I", "-c", "import sys; sys.path.insert(0, sys.argv[1]); import rollout_guard.integrations.trl as t; print(t.__file__)",
                            str(target)], capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.strip().startswith(str(target))
