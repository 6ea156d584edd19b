"""vLLM-side tools behind ``rollout-guard audit`` and ``rollout-guard replay``.

``audit`` checks a vLLM deployment (a model, a dtype, a vLLM build) against transformers: vLLM samples, the
transformers model scores the same tokens given the same prompts, and the guard judges every sample as it would
in training. ``replay`` takes one quarantined sample from the store and scores its tokens again, with
transformers and with a fresh vLLM engine, to tell a reproducible disagreement (kernels, dtype, weights) from
one that only the engine's state at generation time explains (stale cache, wrong context).
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rollout_guard.config import GuardConfig
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.extras import require_extra
from rollout_guard.guard import RolloutGuard, StepReport
from rollout_guard.injection import choose_rows, plan_injection
from rollout_guard.integrations.hf_rollouts import score_with_transformers
from rollout_guard.records import QuarantineRecord
from rollout_guard.sinks import LocalFilesSink
from rollout_guard.statistics import SAMPLE_COLUMNS
from rollout_guard.verdict import rule_names


class VllmEngine:
    """An in-process vLLM engine (no engine-core subprocess: starts in seconds, one model per process)."""

    def __init__(self, model: str, dtype: str = "float32", max_model_len: int | None = None, seed: int = 0) -> None:
        require_extra("rollout-guard audit and replay", ("vllm", "transformers"), "cpu", "gpu")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
        if cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.llm = LLM(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed, enforce_eager=cpu,
                       logprobs_mode="processed_logprobs")

    def generate(self, prompts: list[list[int]], max_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int = 0) -> tuple[list[list[int]], list[list[float | None]]]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k or 0, logprobs=0, seed=seed)
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        completions, logprobs = [], []
        for output in outputs:
            sample = output.outputs[0]
            completions.append(list(sample.token_ids))
            logprobs.append([entry[token].logprob if entry and token in entry else None
                             for token, entry in zip(sample.token_ids, sample.logprobs, strict=True)])
        return completions, logprobs

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float | None]]:
        """The engine's logprob of each completion token given its prompt, from a fresh prefill (temperature 1)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0)
        sequences = [{"prompt_token_ids": list(p) + list(c)} for p, c in zip(prompts, completions, strict=True)]
        outputs = self.llm.generate(sequences, params, use_tqdm=False)
        scores = []
        for output, prompt, completion in zip(outputs, prompts, completions, strict=True):
            entries = output.prompt_logprobs[len(prompt) : len(prompt) + len(completion)]
            scores.append([entry[token].logprob if entry and token in entry else None for token, entry in zip(completion, entries, strict=True)])
        return scores


def load_transformers(model: str, dtype: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).to(device).eval(), AutoTokenizer.from_pretrained(model)


def padded(rows: list[list[float | None]], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor([math.nan if v is None else v for v in row], dtype=torch.float32)
    return out


def evidence_from_lists(engine: list[list[float | None]], trainer: list[list[float | None]], injected: torch.Tensor | None = None) -> RolloutEvidence:
    width = max([len(row) for row in engine] + [1])
    mask = torch.zeros(len(engine), width, dtype=torch.long)
    for i, row in enumerate(engine):
        mask[i, : len(row)] = 1
    return RolloutEvidence(mask=mask, engine_logprobs=padded(engine, width), trainer_logprobs=padded(trainer, width), injected=injected)


@dataclass
class AuditResult:
    report: StepReport
    records: list[QuarantineRecord]
    seconds: dict[str, float] = field(default_factory=dict)


def read_prompts(path: Path, tokenizer: Any) -> list[list[int]]:
    import json

    lines = [line for line in path.read_text().splitlines() if line.strip()]
    texts = [json.loads(line)["prompt"] if path.suffix == ".jsonl" else line for line in lines]
    return [tokenizer(text)["input_ids"] for text in texts]


def random_prompts(tokenizer: Any, count: int, length: int, seed: int) -> list[list[int]]:
    special = set(tokenizer.all_special_ids)
    vocabulary = [i for i in range(len(tokenizer)) if i not in special]
    rng = random.Random(seed)
    return [[rng.choice(vocabulary) for _ in range(length)] for _ in range(count)]


def audit(model: str, prompts: list[list[int]] | None = None, prompt_file: Path | None = None, samples_per_prompt: int = 4,
          max_tokens: int = 32, temperature: float = 1.0, dtype: str = "float32", inject_rate: float = 0.0, seed: int = 0,
          config: GuardConfig | None = None, output_dir: Path | None = None, random_prompt_count: int = 16,
          random_prompt_tokens: int = 8) -> AuditResult:
    timings: dict[str, float] = {}
    started = time.perf_counter()
    hf_model, tokenizer = load_transformers(model, dtype)
    engine = VllmEngine(model, dtype=dtype, seed=seed)
    timings["load"] = time.perf_counter() - started
    if prompts is None:
        prompts = read_prompts(prompt_file, tokenizer) if prompt_file else random_prompts(tokenizer, random_prompt_count, random_prompt_tokens, seed)
    rows = [p for p in prompts for _ in range(samples_per_prompt)]
    selected = choose_rows(len(rows), inject_rate, torch.Generator().manual_seed(seed))
    plan = plan_injection(rows, selected, group_size=samples_per_prompt)
    started = time.perf_counter()
    completions, engine_logprobs = engine.generate(plan.contexts, max_tokens, temperature=temperature, seed=seed)
    timings["generate"] = time.perf_counter() - started
    started = time.perf_counter()
    trainer_logprobs = score_with_transformers(hf_model, rows, completions, temperature)
    timings["score"] = time.perf_counter() - started
    config = config or GuardConfig(max_quarantine_share=None)
    guard = RolloutGuard(config)
    report = guard.inspect(evidence_from_lists(engine_logprobs, trainer_logprobs, plan.selected if inject_rate > 0 else None), step=0)
    records = []
    for row in torch.nonzero(report.suspect).flatten().tolist():
        completion = completions[row]
        records.append(QuarantineRecord(
            step=0, process_index=0, row=row, global_row=row, group_size=samples_per_prompt, action="monitored",
            rules=rule_names(int(report.reasons[row])), stats=dict(zip(SAMPLE_COLUMNS, report.samples[row].tolist(), strict=True)),
            prompt_ids=list(rows[row]), completion_ids=completion, prompt_text=tokenizer.decode(rows[row]),
            completion_text=tokenizer.decode(completion), completion_tokens=[tokenizer.decode([t]) for t in completion],
            engine_logprobs=engine_logprobs[row], trainer_logprobs=trainer_logprobs[row], reward=None, rewards_per_func={},
            advantage_before=None, advantage_after=None,
            sampling={"temperature": temperature, "top_p": 1.0, "top_k": 0, "max_tokens": max_tokens, "seed": seed,
                      "logprobs_mode": "processed_logprobs"},
            model=model, engine={"name": "vllm", "mode": "audit", "dtype": dtype}, injected=bool(plan.selected[row]) if inject_rate > 0 else None,
            created_unix=time.time(),
        ))
    if output_dir is not None:
        sink = LocalFilesSink(output_dir, config)
        sink.on_records(records, guard)
        sink.on_step(report, guard)
        sink.on_end(guard)
    return AuditResult(report=report, records=records, seconds=timings)


@dataclass
class ReplayResult:
    record: QuarantineRecord
    trainer: list[float]
    engine: list[float | None] | None
    verdict_recorded: StepReport
    verdict_fresh_engine: StepReport | None


def replay(record: QuarantineRecord, model: str | None = None, dtype: str = "float32", with_vllm: bool = True,
           config: GuardConfig | None = None) -> ReplayResult:
    model = model or record.model
    temperature = float(record.sampling.get("temperature") or 1.0)
    hf_model, _ = load_transformers(model, dtype)
    trainer = score_with_transformers(hf_model, [record.prompt_ids], [record.completion_ids], temperature)[0]
    engine = VllmEngine(model, dtype=dtype).score([record.prompt_ids], [record.completion_ids])[0] if with_vllm else None
    config = config or GuardConfig(max_quarantine_share=None)
    recorded_engine = record.engine_logprobs or [None] * len(trainer)
    verdict_recorded = RolloutGuard(config).inspect(evidence_from_lists([recorded_engine], [trainer]), step=record.step)
    verdict_fresh = RolloutGuard(config).inspect(evidence_from_lists([engine], [trainer]), step=record.step) if engine is not None else None
    return ReplayResult(record, trainer, engine, verdict_recorded, verdict_fresh)
