"""The guard's running state saved next to a trainer's checkpoint and restored on resume (any framework)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from rollout_guard.guard import RolloutGuard
from rollout_guard.outputs.store import fsync_directory

logger = logging.getLogger("rollout_guard")

STATE_FILE = "rollout_guard_state.json"


def save_state(guard: RolloutGuard, checkpoint_dir: str | Path, global_step: int | None = None) -> Path:
    """Write the guard's running state (totals, history, alert baselines) next to a checkpoint, durably: the
    file is fsynced before it replaces the old one, and the folder after (a crash leaves the old or the new file)."""
    path = Path(checkpoint_dir) / STATE_FILE
    partial = path.with_suffix(".partial")
    with partial.open("w") as handle:
        handle.write(json.dumps({**guard.state_dict(), "global_step": global_step}, allow_nan=True))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)
    fsync_directory(path.parent)
    return path


def read_state(checkpoint_dir: str | Path) -> dict | None:
    """The guard's state saved in a checkpoint folder, or None (logged) when the folder has none."""
    path = Path(checkpoint_dir) / STATE_FILE
    if not path.is_file():
        logger.warning("rollout_guard: %s has no %s; the guard starts from fresh totals", checkpoint_dir, STATE_FILE)
        return None
    return json.loads(path.read_text())


def load_state(guard: RolloutGuard, checkpoint_dir: str | Path, state: dict | None = None) -> dict | None:
    """Restore the guard's state from a checkpoint folder (or ``state``, already read from one); returns the state,
    or None when there is none."""
    state = read_state(checkpoint_dir) if state is None else state
    if state is None:
        return None
    guard.load_state_dict(state)
    logger.info("rollout_guard: restored state from %s (%s steps so far)", checkpoint_dir, guard.totals.steps)
    return state


def saved_step(state: dict) -> int:
    """The training step a saved state belongs to: the checkpoint's global step, or (a state saved without one) the
    last step in the guard's history."""
    if state.get("global_step") is not None:
        return int(state["global_step"])
    history = state.get("totals", {}).get("history", [])
    return int(history[-1]["step"]) if history else 0
