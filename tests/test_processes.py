"""tests/processes.run_group, which the multi-process tests launch through: a timeout kills what the command
started too (subprocess.run's kills only the command)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.processes import run_group

LAUNCHER = """import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(worker.pid))
time.sleep(600)
"""


def test_a_timeout_kills_the_launcher_and_its_workers(tmp_path):
    pid_file = tmp_path / "worker.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_group([sys.executable, "-c", LAUNCHER, str(pid_file)], timeout=5, stdout=subprocess.DEVNULL,
                  stderr=subprocess.DEVNULL)  # no pipe a surviving worker could hold open
    worker = int(pid_file.read_text())
    for _ in range(50):  # the kill is delivered at once; the process table may take a moment
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        if open(f"/proc/{worker}/stat").read().split()[2] == "Z":  # killed, not yet reaped by its (dead) parent
            break
        time.sleep(0.1)
    else:
        os.kill(worker, 9)
        pytest.fail("the worker outlived the timeout")


def test_a_finished_command_returns_as_subprocess_run():
    done = run_group([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                     timeout=30, capture_output=True, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
