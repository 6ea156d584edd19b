"""``python -m rollout_guard.cli``: the ``rollout-guard`` command."""

from rollout_guard.cli import app

app()
