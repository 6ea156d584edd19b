"""The repository's working tree stays small enough to travel to the device machine.

The device machine that runs the GPU benchmarks takes a copy of the working tree plus the wheels carried in
``.whl/``, at most 64 MiB in all: 10 MiB is left for the wheels (trl, datasets and their small deps; typer and its
two deps take 160 KiB). Results JSON are kept gzipped (``benchmarks/fidelity_kit/results_file.py``).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRACKED_LIMIT = 54 * 2**20  # bytes: the device's 64 MiB less ~10 MiB of carried wheels


def _tracked() -> list[Path]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are not known")
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [REPO / name for name in names.decode().split("\0") if name]


def test_tracked_files_leave_room_for_the_device_wheels():
    tracked = _tracked()
    total = sum(path.stat().st_size for path in tracked if path.is_file())
    largest = sorted(((path.stat().st_size, str(path.relative_to(REPO))) for path in tracked if path.is_file()),
                     reverse=True)[:5]
    assert total <= TRACKED_LIMIT, (
        f"tracked files: {total / 2**20:.1f} MiB, over {TRACKED_LIMIT / 2**20:.0f} MiB (the device takes 64 MiB with "
        f"its wheels); gzip results JSON (gzip -9n) or drop what no longer earns its place; largest: {largest}")


def test_results_json_is_kept_gzipped():
    plain = [name for name in map(str, (path.relative_to(REPO) for path in _tracked()))
             if name.startswith("benchmarks/results") and name.endswith(".json")]
    assert not plain, f"gzip these results files (gzip -9n; read_results reads either name): {plain[:10]}"
