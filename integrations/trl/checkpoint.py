"""Checkpoint state: the guard's running state saved next to each TRL checkpoint and restored on resume."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from rollout_guard.guard import RolloutGuard

logger = logging.getLogger("rollout_guard")

STATE_FILE = "rollout_guard_state.json"


def save_state(guard: RolloutGuard, checkpoint_dir: str | Path) -> Path:
    """Write the guard's running state (totals, history, alert baselines) next to a TRL checkpoint."""
    path = Path(checkpoint_dir) / STATE_FILE
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(guard.state_dict(), allow_nan=True))
    os.replace(partial, path)
    return path


def load_state(guard: RolloutGuard, checkpoint_dir: str | Path) -> bool:
    path = Path(checkpoint_dir) / STATE_FILE
    if not path.is_file():
        logger.warning("rollout_guard: %s has no %s; the guard starts from fresh totals", checkpoint_dir, STATE_FILE)
        return False
    guard.load_state_dict(json.loads(path.read_text()))
    logger.info("rollout_guard: restored state from %s (%s steps so far)", path, guard.totals.steps)
    return True
