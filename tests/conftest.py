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
    from rollout_guard.testing.tiny_model import build_tiny_model

    return build_tiny_model(CACHE / "models")


@pytest.fixture(scope="session")
def mamba2_dir(tiny_model_dir) -> Path:
    """The tiny Mamba2 copy model (MAMBA2_RECIPE), for the engine-level stale-state fault."""
    import torch

    from rollout_guard.testing.tiny_model import MAMBA2_RECIPE, build_tiny_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # transformers' reference Mamba2 scan is made of small ops: one thread is faster
    try:
        return build_tiny_model(tiny_model_dir.parent, MAMBA2_RECIPE)  # the tests' model cache
    finally:
        torch.set_num_threads(threads)
