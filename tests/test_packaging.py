"""Packaging: the wheel maps `integrations/` to `rollout_guard.integrations`, ships py.typed, and its bare install
(no extras) needs torch only, imports the core, and names the extra when an integration is missing."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    return next(out.glob("rollout_guard-*.whl"))


def test_wheel_maps_integrations_under_the_package(wheel, tmp_path):
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("trl/__init__", "trl/attach", "trl/batch", "trl_versions", "vllm_cpu", "hf_rollouts", "wandb", "trackio",
                   "vllm_tools", "rescoring"):
        assert f"rollout_guard/integrations/{module}.py" in names, module
    assert "rollout_guard/py.typed" in names
    assert not any(name.startswith(("integrations/", "tests/", "examples/", "scripts/")) for name in names)
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


def test_the_core_requires_torch_only(wheel):
    metadata = zipfile.ZipFile(wheel).read(next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith("METADATA"))).decode()
    requirements = [Requirement(line.removeprefix("Requires-Dist:").strip()) for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert [r.name for r in requirements if r.marker is None] == ["torch"]
    extras = {line.removeprefix("Provides-Extra:").strip() for line in metadata.splitlines() if line.startswith("Provides-Extra:")}
    assert {"trl", "wandb", "trackio", "charts", "cli", "cpu", "gpu", "dev"} <= extras
    trl = next(r for r in requirements if r.name == "trl" and r.marker.evaluate({"extra": "trl"}))
    assert all(trl.specifier.contains(v) for v in ("1.14.0", "1.15.0", "1.16.0")) and not trl.specifier.contains("1.17.0")


def distributions_needed_by(name: str) -> set[str]:
    """``name`` and everything it requires (no extras), as installed in this environment."""
    needed, todo = set(), [name]
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        if dist.metadata["Name"].lower() in needed:
            continue
        needed.add(dist.metadata["Name"].lower())
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return needed


def expose(distributions: set[str], folder: Path) -> None:
    """Symlink the installed files of these distributions (top-level entries, dist-info included) into ``folder``."""
    folder.mkdir()
    for name in distributions:
        dist = importlib.metadata.distribution(name)
        for top in {Path(str(f)).parts[0] for f in dist.files or []} - {".."}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (folder / top).exists():
                (folder / top).symlink_to(source)


BARE_CHECK = r"""
import logging, sys, tempfile
import torch
import rollout_guard
from rollout_guard import GuardConfig, RolloutEvidence, RolloutGuard
from rollout_guard.outputs.console import ConsoleSink
from rollout_guard.outputs.sinks import LocalFilesSink
from rollout_guard.extras import MissingExtraError

out = tempfile.mkdtemp()
guard = RolloutGuard(GuardConfig())
sinks = [LocalFilesSink(out, guard.config), ConsoleSink(out)]
engine = torch.full((4, 5), -0.05)
trainer = engine.clone()
trainer[1] = -10.0
report = guard.inspect(RolloutEvidence(mask=torch.ones(4, 5, dtype=torch.long), engine_logprobs=engine, trainer_logprobs=trainer), step=1)
for sink in sinks:
    sink.on_step(report, guard)
for sink in sinks:
    sink.on_end(guard)
for module in ("rollout_guard.integrations.trl", "rollout_guard.outputs.charts", "rollout_guard.integrations.wandb"):
    try:
        __import__(module)
    except MissingExtraError as error:
        print("missing:", error)
    else:
        raise SystemExit(f"{module} imported without its extra")
loaded = sorted({m.split(".")[0] for m in sys.modules} & {"trl", "vllm", "transformers", "accelerate", "matplotlib", "wandb", "typer", "rich", "numpy"})
assert not loaded, loaded
print("quarantined:", int(report.metrics["quarantined"]))
"""


def test_the_bare_wheel_installs_beside_torch_alone_and_imports_the_core(wheel, tmp_path):
    """A fresh venv (no system site-packages) that sees only torch and what torch needs (symlinked from this
    environment, instead of a 900 MB install), then `pip install --no-index` of the wheel: a core dependency other
    than torch would fail to resolve."""
    env_dir = tmp_path / "bare"
    venv.create(env_dir, with_pip=True, system_site_packages=False)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    expose(distributions_needed_by("torch"), tmp_path / "torch_only")
    (site / "torch_only.pth").write_text(str(tmp_path / "torch_only") + "\n")
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "PIP_"))}
    # ensurepip's own setuptools (65 on Python 3.11) would shadow the newer one that torch requires
    subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", "setuptools"], capture_output=True, timeout=120, env=env)
    before = {path.name for path in site.iterdir()}
    installed = subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-cache-dir", str(wheel)],
                               capture_output=True, text=True, timeout=300, env=env)
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-3000:]
    added = {path.name for path in site.iterdir()} - before
    assert {name.split("-")[0] for name in added} == {"rollout_guard"}, added  # nothing but the project itself
    size = sum(f.stat().st_size for name in added for f in (site / name).rglob("*") if f.is_file())
    print(f"bare core install size (excluding torch): {size / 1024:.0f} KiB in {sorted(added)}")
    assert size < 2 * 1024 * 1024  # bytes: the code of every integration, with bytecode
    check = subprocess.run([python, "-c", BARE_CHECK], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-3000:]
    assert "quarantined: 1" in check.stdout
    assert "rollout_guard.integrations.trl needs 'trl', which is not installed: pip install 'rollout-guard[trl]'" in check.stdout
    assert "pip install 'rollout-guard[charts]'" in check.stdout and "pip install 'rollout-guard[wandb]'" in check.stdout
    # the console sink works without rich; the local files without matplotlib (no chart, said once)
    assert "rollout_guard: 1 step, 4 rollouts judged; 1 quarantined" in check.stderr
    assert "no spikes.png" in check.stderr and "pip install 'rollout-guard[charts]'" in check.stderr
    cli = subprocess.run([env_dir / "bin" / "rollout-guard", "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert cli.returncode != 0 and "needs 'typer', which is not installed: pip install 'rollout-guard[cli]'" in cli.stderr
