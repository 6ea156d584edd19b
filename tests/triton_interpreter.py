"""Run a test module's named cases in Triton's interpreter on the CPU: a child process started with
``TRITON_INTERPRET=1`` (Triton reads it when first imported), one ``ok <name>`` or ``FAILED <name>: ...`` line per
case. The parent asserts every case printed ok."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cases(cases: dict[str, Callable[[], None]], names: Iterable[str]) -> int:
    """In the child: run each named case, print one line each; the number that failed."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    failed = 0
    for name in names:
        try:
            cases[name]()
        except Exception as error:  # noqa: BLE001 - report every case
            failed += 1
            print(f"FAILED {name}: {type(error).__name__}: {error}", flush=True)
        else:
            print(f"ok {name}", flush=True)
    return failed


def check_in_interpreter(module_file: str, names: list[str], timeout: int = 900) -> None:
    """In the parent: run ``module_file``'s ``__main__`` with the case names in the interpreter; assert all ok."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    run = subprocess.run([sys.executable, module_file, *names], capture_output=True, text=True, timeout=timeout,
                         env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert run.stdout.count("ok ") == len(names), run.stdout
