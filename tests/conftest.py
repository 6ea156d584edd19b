"""Shared fixtures: the tiny model is built once per machine (cached under .cache/, keyed by its recipe)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("ROLLOUT_GUARD_CACHE", REPO / ".cache"))

os.environ.setdefault("VLLM_CACHE_ROOT", str(CACHE / "vllm"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from rollout_guard.integrations.tiny_model import build_tiny_model

    return build_tiny_model(CACHE / "models")
