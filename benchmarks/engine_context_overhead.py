"""Cost of the engine context: no extra engine round trip in colocate mode, so the cost is

1. host work per generation call: turning the ``RequestOutput``\\s TRL already receives into one context per rollout
   (:func:`rollout_guard.integrations.vllm_context.rollout_contexts`: fingerprint of the completion, per-rollout window over
   the engine iterations). Measured here on vLLM-shaped objects at realistic batch sizes (``--host``), and in the
   e2e run as ``engine/context_seconds`` (tests/integrations/test_engine_context_e2e.py prints it);
2. vLLM's own stats (``disable_log_stats=False``, needed for timings, KV-cache usage and running requests): the same
   generate calls on a real engine with stats off and on, each in its own process (``--engine``).

    python benchmarks/engine_context_overhead.py --host --engine --out benchmarks/results/engine_context/overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]


def host_cost(rows: int, tokens: int, iterations: int, repeats: int = 5) -> dict[str, float]:
    """Median seconds of rollout_contexts over ``rows`` completions of ``tokens`` tokens, ``iterations`` engine
    iterations in the log (the engine steps of one generate call)."""
    import random

    from rollout_guard.integrations.vllm_context import IterationLog, rollout_contexts

    rng = random.Random(0)
    log = IterationLog()
    for i in range(iterations):
        log.at.append(100.0 + i * 0.01), log.running.append(rng.randint(1, 256)), log.waiting.append(0)
        log.kv_usage.append(rng.random()), log.preempted.append(0)
    outputs = []
    for _ in range(rows):
        start = 100.0 + rng.random() * iterations * 0.005
        stats = SimpleNamespace(num_preemptions=0, queued_ts=start - 0.01, scheduled_ts=start, first_token_ts=start + 0.05,
                                last_token_ts=start + rng.random() * iterations * 0.005)
        completion = SimpleNamespace(token_ids=[rng.randrange(150_000) for _ in range(tokens)], finish_reason="length")
        outputs.append(SimpleNamespace(prompt_token_ids=list(range(256)), num_cached_tokens=0, metrics=stats, outputs=[completion]))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        rollout_contexts(outputs, 99.0, log, 1, 0)
        times.append(time.perf_counter() - started)
    return {"rows": rows, "tokens": tokens, "iterations": iterations, "seconds": statistics.median(times)}


ENGINE_CHILD = r"""
import json, os, sys, time, statistics
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    stats = sys.argv[1] == "on"
    llm = LLM(model=sys.argv[2], dtype="float32", enforce_eager=True, max_model_len=64, max_num_seqs=64, seed=0,
              disable_log_stats=not stats)
    params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=1.0, logprobs=0)
    prompts = [{"prompt_token_ids": [5 + (i * 7 + j) % 20 for j in range(16)]} for i in range(64)]
    recording = [0.0]
    if stats:  # time vLLM's per-iteration stat recording (Prometheus and logging stat loggers)
        manager = llm.llm_engine.logger_manager
        original = manager.record
        def record(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                recording[0] += time.perf_counter() - started
        manager.record = record
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    times, recorded = [], []
    for _ in range(int(sys.argv[3])):
        recording[0] = 0.0
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - started)
        recorded.append(recording[0])
    print("RESULT " + json.dumps({"stats": stats, "seconds": times, "record_seconds": recorded}))
"""


def engine_cost(model: str, repeats: int) -> dict[str, dict]:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CACHE_ROOT": str(REPO / ".cache" / "vllm"), "PYTHONPATH": str(REPO)}
    results = {}
    for setting in ("off", "on", "off", "on"):  # interleaved: the machine's load drifts
        done = subprocess.run([sys.executable, "-c", ENGINE_CHILD, setting, model, str(repeats)], capture_output=True,
                              text=True, env=env, timeout=900)
        line = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if not line:
            raise RuntimeError(done.stderr[-3000:])
        child = json.loads(line[0][7:])
        results.setdefault(setting, {"seconds": [], "record_seconds": []})
        results[setting]["seconds"].extend(child["seconds"])
        results[setting]["record_seconds"].extend(child["record_seconds"])
    # the machine may be shared: the minimum is the least disturbed run, the median the typical one
    return {setting: {"min_seconds": min(runs["seconds"]), "median_seconds": statistics.median(runs["seconds"]),
                      "record_seconds_median": statistics.median(runs["record_seconds"]), **runs}
            for setting, runs in results.items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", action="store_true")
    parser.add_argument("--engine", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    arguments = parser.parse_args()
    report: dict = {"python": sys.version.split()[0]}
    if arguments.host:
        report["host"] = [host_cost(rows, tokens, iterations) for rows, tokens, iterations in
                          ((16, 12, 30), (256, 1024, 1100), (1024, 1024, 1100), (4096, 1024, 1100))]
        for row in report["host"]:
            print(f"host: {row['rows']} rollouts × {row['tokens']} tokens, {row['iterations']} iterations: {1e3 * row['seconds']:.2f} ms")
    if arguments.engine:
        from rollout_guard.testing.tiny_model import build_tiny_model

        model = str(build_tiny_model(REPO / ".cache" / "models"))
        report["engine"] = engine_cost(model, arguments.repeats)
        off, on = report["engine"]["off"], report["engine"]["on"]
        print(f"engine: 64 requests × 32 tokens per generate call; stats off: min {off['min_seconds']:.3f} s, median "
              f"{off['median_seconds']:.3f} s; stats on: min {on['min_seconds']:.3f} s, median {on['median_seconds']:.3f} s; "
              f"min ratio {100 * (on['min_seconds'] / off['min_seconds'] - 1):+.1f} %; vLLM's stat recording inside the "
              f"stats-on calls: {1e3 * on['record_seconds_median']:.1f} ms median "
              f"({100 * on['record_seconds_median'] / on['median_seconds']:.2f} % of the call)")
    if arguments.out:
        arguments.out.write_text(json.dumps(report, indent=1))
