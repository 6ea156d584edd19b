"""Running a command that starts processes of its own (a launcher's workers, a vLLM engine's processes)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
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


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(script: str | os.PathLike, *args: str, processes: int = 1, timeout: float = 600,
           env: dict[str, str] | None = None, log: os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Run ``script args`` on ``processes`` CPU processes (one: plain Python; more: ``accelerate launch
    --multi_gpu``, torch.distributed's launcher, each process then on the CPU with gloo as ``GRPOConfig(use_cpu=True)``
    asks), through :func:`run_group`, with the repository first on ``PYTHONPATH`` (workers import ``tests.*``) and
    ``env`` over this process's environment. ``log``: stdout and stderr go to that file; else both are captured as
    text."""
    launcher = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    command = [*launcher, str(script), *map(str, args)]
    if log is None:
        return run_group(command, timeout=timeout, capture_output=True, text=True, env=env)
    with open(log, "w") as handle:
        return run_group(command, timeout=timeout, stdout=handle, stderr=subprocess.STDOUT, env=env)
