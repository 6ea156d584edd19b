"""Running a command that starts processes of its own (a launcher's workers, a vLLM engine's processes)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence
from typing import Any


def run_group(command: Sequence[str], timeout: float, **popen: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(command, timeout=timeout, **popen)`` in a process group of its own, killed whole when the
    command ends or times out: ``subprocess.run`` kills only the command, so a hung launcher's workers kept running
    (a two-process test that hung left four behind). ``capture_output=True`` is understood as by
    ``subprocess.run``; the timeout re-raises ``subprocess.TimeoutExpired`` after the group is killed."""
    if popen.pop("capture_output", False):
        popen["stdout"] = popen["stderr"] = subprocess.PIPE
    with subprocess.Popen(list(command), start_new_session=True, **popen) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            process.kill()  # (already, as the group's leader)
            process.communicate()
            raise
        finally:
            _kill_group(process.pid)  # whatever the command left behind
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _kill_group(group: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signal.SIGKILL)
