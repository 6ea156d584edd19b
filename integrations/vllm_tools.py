"""vLLM-side tools behind ``rollout-guard audit`` and ``rollout-guard replay``.

``audit`` checks a vLLM deployment (a model, a dtype, a vLLM build) against transformers: vLLM samples, the
transformers model re-scores the same tokens given the same prompts (batched, :mod:`.rescoring`), and the guard
judges every sample as it would in training. With :class:`StressSettings` it runs under the conditions in which
cache-recycling bugs show (a token budget so small that new requests get one or a few scheduled tokens, few cache
blocks so slots are recycled fast, prefix caching, many concurrent requests of varied lengths, several rounds).

``replay`` takes a quarantined sample from the store and scores its tokens again, with transformers and with a
fresh vLLM engine, and names the pattern of the disagreement (:mod:`rollout_guard.patterns`).

Inputs are checked by :func:`check_audit_inputs` / :func:`check_model` before any engine starts; problems raise
:class:`AuditUsageError` with a one-line message naming the option and the fix.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rollout_guard.config import GuardConfig
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.extras import require_extra
from rollout_guard.guard import RolloutGuard, StepReport
from rollout_guard.injection import choose_rows, plan_injection
from rollout_guard.integrations.rescoring import rescore
from rollout_guard.patterns import Pattern, abs_delta, classify_pattern
from rollout_guard.outputs.records import QuarantineRecord
from rollout_guard.outputs.sinks import LocalFilesSink
from rollout_guard.statistics import SAMPLE_COLUMNS
from rollout_guard.verdict import explain, rule_names

DTYPES = ("float32", "bfloat16", "float16")


class AuditUsageError(ValueError):
    """Bad input or environment for audit/replay; the message is one line naming the problem and the fix."""


# ----------------------------------------------------------------------------------------------- stress settings


@dataclass(frozen=True)
class StressSettings:
    """Engine and workload conditions of an audit. ``None`` leaves vLLM's default."""

    max_num_batched_tokens: int | None = None  # tokens per engine step (vLLM default: 2048–8192)
    max_num_seqs: int | None = None  # concurrent requests (vLLM default: 128–256)
    cache_blocks: int | None = None  # KV / state cache blocks (num_gpu_blocks_override); few = slots recycled fast
    prefix_caching: bool | None = None
    rounds: int = 1  # generate every prompt this many times, one engine, slots recycled across rounds
    # per-request max_tokens drawn from [max_tokens // 4, max_tokens]; random prompts of 1–2× length
    vary_lengths: bool = False

    @classmethod
    def stress(cls, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
               cache_blocks: int | None = None,
               prefix_caching: bool | None = None, rounds: int | None = None) -> StressSettings:
        """``--stress``: 8 concurrent requests, a token budget of one token per request (a newcomer next to 7
        decoding requests gets exactly one token: vLLM PR #32118's trigger), 4 cache blocks per concurrent request,
        prefix caching on, 3 rounds, varied lengths. Arguments override single knobs."""
        def given(value: Any, default: Any) -> Any:
            return default if value is None else value

        seqs = given(max_num_seqs, 8)
        return cls(max_num_batched_tokens=given(max_num_batched_tokens, seqs), max_num_seqs=seqs,
                   cache_blocks=given(cache_blocks, 4 * seqs), prefix_caching=given(prefix_caching, True),
                   rounds=given(rounds, 3), vary_lengths=True)

    def engine_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if self.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = self.max_num_batched_tokens
            kwargs["enable_chunked_prefill"] = True
        if self.max_num_seqs is not None:
            kwargs["max_num_seqs"] = self.max_num_seqs
        if self.cache_blocks is not None:
            kwargs["num_gpu_blocks_override"] = self.cache_blocks
        if self.prefix_caching is not None:
            kwargs["enable_prefix_caching"] = self.prefix_caching
        return kwargs

    def lines(self) -> list[str]:
        """The conditions used, one per line, for the audit's output."""
        def show(value: object, default: str = "vLLM default") -> str:
            return default if value is None else str(value)

        return [
            f"token budget per step (--max-num-batched-tokens): {show(self.max_num_batched_tokens)}",
            f"concurrent requests (--max-num-seqs): {show(self.max_num_seqs)}",
            f"cache blocks (--cache-blocks): {show(self.cache_blocks)}",
            "prefix caching: "
                f"{show(None if self.prefix_caching is None else ('on' if self.prefix_caching else 'off'))}",
            f"rounds: {self.rounds}",
            f"lengths: {'varied' if self.vary_lengths else 'as given'}",
        ]


# ----------------------------------------------------------------------------------------------- engine


class VllmEngine:
    """An in-process vLLM engine (no engine-core subprocess: starts in seconds, one model per process)."""

    def __init__(self, model: str, dtype: str = "float32", max_model_len: int | None = None, seed: int = 0,
                 **engine_kwargs: Any) -> None:
        require_extra("rollout-guard audit and replay", ("vllm", "transformers"), "cpu", "gpu")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM
        from vllm.platforms import current_platform

        self.cpu = bool(current_platform.is_cpu())
        if self.cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.llm = LLM(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed, enforce_eager=self.cpu,
                       logprobs_mode="processed_logprobs", **engine_kwargs)

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int | Sequence[int], temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int = 0) -> tuple[list[list[int]], list[list[float | None]]]:
        """Sample one completion per prompt; ``max_tokens`` may differ per prompt.

        Seeds: the engine's seed (``LLM(seed=...)``) makes a run reproducible. A per-request ``seed`` is passed
        only off the CPU build: there it makes vLLM rewind a CPU generator as soon as a prompt is split across
        engine steps, which fails (``RuntimeError: CPU Generator does not use offset``).
        """
        from vllm import SamplingParams

        limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        params = [SamplingParams(max_tokens=limit, temperature=temperature, top_p=top_p, top_k=top_k or 0, logprobs=0,
                                 seed=None if self.cpu else seed + index) for index, limit in enumerate(limits)]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        completions, logprobs = [], []
        for output in outputs:
            sample = output.outputs[0]
            completions.append(list(sample.token_ids))
            logprobs.append([entry[token].logprob if entry and token in entry else None
                             for token, entry in zip(sample.token_ids, sample.logprobs, strict=True)])
        return completions, logprobs

    def score(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> list[list[float | None]]:
        """The engine's logprob of each completion token given its prompt, from a fresh prefill (temperature 1)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0)
        sequences = [{"prompt_token_ids": list(p) + list(c)} for p, c in zip(prompts, completions, strict=True)]
        outputs = self.llm.generate(sequences, params, use_tqdm=False)
        scores = []
        for output, prompt, completion in zip(outputs, prompts, completions, strict=True):
            entries = output.prompt_logprobs[len(prompt) : len(prompt) + len(completion)]
            scores.append([entry[token].logprob if entry and token in entry else None
                           for token, entry in zip(completion, entries, strict=True)])
        return scores


def start_engine(model: str, **kwargs: Any) -> VllmEngine:
    """A :class:`VllmEngine`, or :class:`AuditUsageError` with vLLM's own last line when it cannot start."""
    try:
        return VllmEngine(model, **kwargs)
    except Exception as error:  # vLLM raises many types; the CLI turns this into one line and exit code 2
        message = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        raise AuditUsageError(f"vLLM could not start {model} ({type(error).__name__}: {message[:300]}); "
                              "check the model "
                              "and the engine options") from error


# ----------------------------------------------------------------------------------------------- input checks


def check_model(model: str) -> None:
    """A local folder with config.json, or a hub id already in the local cache (nothing is downloaded)."""
    path = Path(model)
    if path.exists():
        if not (path / "config.json").is_file():
            raise AuditUsageError(f"MODEL {model}: no config.json in that folder; "
                                  "pass a model folder saved with save_pretrained")
        return
    if model.count("/") <= 1 and not model.startswith((".", "/")):
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(model, "config.json"), str):
            return
    raise AuditUsageError(f"MODEL {model}: no such folder, and no hub model of that name in the local cache; pass a "
                          "model folder or download the model first")


def check_audit_inputs(prompt_file: Path | None, samples: int, max_tokens: int, temperature: float, dtype: str,
                       inject_rate: float, stress: StressSettings, random_prompts: int, prompt_tokens: int) -> None:
    """Every option of ``audit`` that can be checked without an engine; raises :class:`AuditUsageError`."""
    if dtype not in DTYPES:
        raise AuditUsageError(f"--dtype {dtype}: vLLM and transformers run {', '.join(DTYPES)}; pick one of those")
    if samples < 1:
        raise AuditUsageError(f"--samples {samples}: need at least 1 completion per prompt "
                              "(0 samples would check nothing)")
    if max_tokens < 1:
        raise AuditUsageError(f"--max-tokens {max_tokens}: need at least 1 token per completion")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise AuditUsageError(f"--temperature {temperature}: use a positive number "
                              "(greedy decoding gives no sampling logprobs to compare)")
    if not 0.0 <= inject_rate <= 1.0:
        raise AuditUsageError(f"--inject-rate {inject_rate}: use a share of samples between 0 and 1")
    for name, value in (("--max-num-batched-tokens", stress.max_num_batched_tokens),
                        ("--max-num-seqs", stress.max_num_seqs),
                        ("--cache-blocks", stress.cache_blocks)):
        if value is not None and value < 1:
            raise AuditUsageError(f"{name} {value}: use a positive number")
    if stress.rounds < 1:
        raise AuditUsageError(f"--rounds {stress.rounds}: use a positive number")
    if (stress.max_num_batched_tokens is not None and stress.max_num_seqs is not None
            and stress.max_num_batched_tokens < stress.max_num_seqs):
        raise AuditUsageError(f"--max-num-batched-tokens {stress.max_num_batched_tokens} is below --max-num-seqs "
                              f"{stress.max_num_seqs}: vLLM needs a budget of at least one token "
                              "per concurrent request")
    if prompt_file is None:
        if random_prompts < 1 or prompt_tokens < 1:
            raise AuditUsageError(f"--random-prompts {random_prompts} --prompt-tokens {prompt_tokens}: "
                                  "need at least 1 prompt "
                                  "of at least 1 token (or pass --prompts FILE)")
        return
    if not prompt_file.is_file():
        raise AuditUsageError(f"--prompts {prompt_file}: no such file; "
                              "pass a text file with one prompt per line (or .jsonl)")
    raw = prompt_file.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise AuditUsageError(f"--prompts {prompt_file}: not UTF-8 text (byte {error.start}); "
                              "pass a text file with one "
                              "prompt per line") from error
    if "\x00" in text:
        raise AuditUsageError(f"--prompts {prompt_file}: binary file (NUL bytes); "
                              "pass a text file with one prompt per line")
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise AuditUsageError(f"--prompts {prompt_file}: no prompts (the file is empty); put one prompt per line")
    if prompt_file.suffix == ".jsonl":
        import json

        for number, line in enumerate(lines, start=1):
            try:
                value = json.loads(line)
            except ValueError as error:
                raise AuditUsageError(f"--prompts {prompt_file}:{number}: not JSON ({error}); write one "
                                      f'{{"prompt": "..."}} per line') from error
            if not isinstance(value, dict) or not isinstance(value.get("prompt"), str):
                raise AuditUsageError(f'--prompts {prompt_file}:{number}: no "prompt" string; '
                                      f'write one {{"prompt": "..."}} per line')


def read_prompts(path: Path, tokenizer: Any) -> list[list[int]]:
    import json

    lines = [line for line in path.read_text().splitlines() if line.strip()]
    texts = [json.loads(line)["prompt"] if path.suffix == ".jsonl" else line for line in lines]
    return [tokenizer(text)["input_ids"] for text in texts]


def random_prompts(tokenizer: Any, count: int, length: int, seed: int, vary: bool = False) -> list[list[int]]:
    """Random token prompts of ``length`` tokens (with ``vary``: 1 to 2 × ``length``)."""
    special = set(tokenizer.all_special_ids)
    vocabulary = [i for i in range(len(tokenizer)) if i not in special]
    rng = random.Random(seed)
    return [[rng.choice(vocabulary) for _ in range(rng.randint(1, 2 * length) if vary else length)]
            for _ in range(count)]


def model_max_len(model: str) -> int | None:
    from transformers import AutoConfig

    value = getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


# ----------------------------------------------------------------------------------------------- audit


def load_transformers(model: str, dtype: str) -> tuple[Any, Any]:
    """The transformers model (eval mode, on the GPU if there is one) and tokenizer; :class:`AuditUsageError` with
    transformers' own message when they cannot be loaded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return (AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).to(device).eval(),
                AutoTokenizer.from_pretrained(model))
    except (OSError, ValueError, KeyError) as error:
        message = " ".join(str(error).split())[:300]
        raise AuditUsageError(f"transformers could not load {model} ({type(error).__name__}: {message}); "
                              "pass a causal LM "
                              "folder with its tokenizer") from error


def padded(rows: list[list[float | None]], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor([math.nan if v is None else v for v in row], dtype=torch.float32)
    return out


def evidence_from_lists(engine: list[list[float | None]], trainer: list[list[float | None]],
                        injected: torch.Tensor | None = None) -> RolloutEvidence:
    width = max([len(row) for row in engine] + [1])
    mask = torch.zeros(len(engine), width, dtype=torch.long)
    for i, row in enumerate(engine):
        mask[i, : len(row)] = 1
    return RolloutEvidence(mask=mask, engine_logprobs=padded(engine, width), trainer_logprobs=padded(trainer, width),
                           injected=injected)


@dataclass
class AuditResult:
    report: StepReport
    records: list[QuarantineRecord]
    seconds: dict[str, float] = field(default_factory=dict)
    conditions: list[str] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)  # per sample (all rounds)
    completions: list[list[int]] = field(default_factory=list)
    engine_logprobs: list[list[float | None]] = field(default_factory=list)
    trainer_logprobs: list[list[float]] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)  # per sample: its round (0-based)


def audit(model: str, prompts: list[list[int]] | None = None, prompt_file: Path | None = None,
          samples_per_prompt: int = 4, max_tokens: int = 32, temperature: float = 1.0, dtype: str = "float32",
          inject_rate: float = 0.0, seed: int = 0,
          config: GuardConfig | None = None, output_dir: Path | None = None, random_prompt_count: int = 16,
          random_prompt_tokens: int = 8, stress: StressSettings | None = None,
          on_progress: Callable[[str, int, int], None] | None = None, trainer_dtype: str | None = None) -> AuditResult:
    """Generate with vLLM under ``stress`` conditions, re-score with transformers, judge with the guard.

    ``on_progress(phase, done, total)`` is called as rounds are generated (phase ``"generate"``, in rounds) and as
    samples are re-scored (``"rescore"``, in samples). Raises :class:`AuditUsageError` for bad input (checked
    before the engine starts) or an engine that cannot start. ``trainer_dtype`` (default ``dtype``) is the dtype of
    the transformers model, e.g. float32 next to a bf16 engine.
    """
    stress = stress or StressSettings()
    timings: dict[str, float] = {}
    started = time.perf_counter()
    hf_model, tokenizer = load_transformers(model, trainer_dtype or dtype)
    if prompts is None:
        prompts = (read_prompts(prompt_file, tokenizer) if prompt_file
                   else random_prompts(tokenizer, random_prompt_count, random_prompt_tokens, seed,
                                       vary=stress.vary_lengths))
    if not prompts or not any(prompts):
        raise AuditUsageError("no prompt tokens to generate from: the prompts are empty after tokenization; "
                              "pass non-empty prompts")
    if any(len(p) == 0 for p in prompts):
        raise AuditUsageError("a prompt tokenizes to 0 tokens; remove empty prompts or use a tokenizer that adds BOS")
    longest = max(map(len, prompts)) + max_tokens
    limit = model_max_len(model)
    if limit is not None and longest > limit:
        raise AuditUsageError(f"the longest prompt ({longest - max_tokens} tokens) + --max-tokens {max_tokens} "
                              "exceeds the "
                              f"model's {limit} positions; lower --max-tokens or shorten the prompts")
    engine = start_engine(model, dtype=dtype, seed=seed, max_model_len=min(limit, longest) if limit else longest,
                          **stress.engine_kwargs())
    timings["load"] = time.perf_counter() - started
    rows = [p for p in prompts for _ in range(samples_per_prompt)]
    rng = random.Random(seed)
    all_rows: list[list[int]] = []
    completions: list[list[int]] = []
    engine_logprobs: list[list[float | None]] = []
    injected: list[bool] = []
    round_of: list[int] = []
    generator = torch.Generator().manual_seed(seed)
    started = time.perf_counter()
    for round_index in range(stress.rounds):
        selected = choose_rows(len(rows), inject_rate, generator)
        plan = plan_injection(rows, selected, group_size=samples_per_prompt)
        limits = [rng.randint(max(1, max_tokens // 4), max_tokens) for _ in rows] if stress.vary_lengths else max_tokens
        generated, logprobs = engine.generate(plan.contexts, limits, temperature=temperature,
                                              seed=seed + round_index * len(rows))
        all_rows += rows
        completions += generated
        engine_logprobs += logprobs
        injected += plan.selected.tolist()
        round_of += [round_index] * len(rows)
        if on_progress is not None:
            on_progress("generate", round_index + 1, stress.rounds)
    timings["generate"] = time.perf_counter() - started
    if sum(map(len, completions)) == 0:
        raise AuditUsageError("vLLM generated no completion tokens (every sample ended at once); "
                              "nothing to compare — "
                              "check the prompts and --max-tokens")
    started = time.perf_counter()
    done = [0]

    def rescored(count: int) -> None:
        done[0] += count
        if on_progress is not None:
            on_progress("rescore", done[0], len(all_rows))

    trainer_logprobs = rescore(hf_model, all_rows, completions, temperature, on_batch=rescored)
    timings["score"] = time.perf_counter() - started
    config = config or GuardConfig(max_quarantine_share=None)
    guard = RolloutGuard(config)
    injected_tensor = torch.tensor(injected, dtype=torch.bool) if inject_rate > 0 else None
    report = guard.inspect(evidence_from_lists(engine_logprobs, trainer_logprobs, injected_tensor), step=0)
    records = []
    for row in torch.nonzero(report.suspect).flatten().tolist():
        completion = completions[row]
        rules = rule_names(int(report.reasons[row]))
        stats = dict(zip(SAMPLE_COLUMNS, report.samples[row].tolist(), strict=True))
        records.append(QuarantineRecord(
            step=0, process_index=0, row=row, global_row=row, group_size=samples_per_prompt, action="monitored",
            rules=rules, stats=stats, explanation=explain(stats, rules, report.threshold),
            prompt_ids=list(all_rows[row]), completion_ids=completion, prompt_text=tokenizer.decode(all_rows[row]),
            completion_text=tokenizer.decode(completion), completion_tokens=[tokenizer.decode([t]) for t in completion],
            engine_logprobs=engine_logprobs[row], trainer_logprobs=trainer_logprobs[row],
            reward=None, rewards_per_func={},
            advantage_before=None, advantage_after=None,
            sampling={"temperature": temperature, "top_p": 1.0, "top_k": 0, "max_tokens": max_tokens, "seed": seed,
                      "logprobs_mode": "processed_logprobs"},
            model=model, engine={"name": "vllm", "mode": "audit", "dtype": dtype, **stress.engine_kwargs()},
            injected=injected[row] if inject_rate > 0 else None, created_unix=time.time(),
            extra={"round": round_of[row]},
        ))
    if output_dir is not None:
        sink = LocalFilesSink(output_dir, config)
        sink.on_records(records, guard)
        sink.on_step(report, guard)
        sink.on_end(guard)
    return AuditResult(report=report, records=records, seconds=timings, conditions=stress.lines(), prompts=all_rows,
                       completions=completions, engine_logprobs=engine_logprobs, trainer_logprobs=trainer_logprobs,
                       rounds=round_of)


# ----------------------------------------------------------------------------------------------- replay


@dataclass
class ReplayResult:
    record: QuarantineRecord
    trainer: list[float]
    engine: list[float | None] | None
    verdict_recorded: StepReport
    verdict_fresh_engine: StepReport | None
    pattern: Pattern
    calibrated: bool = False  # judged against the run's detector state at the record's step (else the prior)


def _as_tensor(values: Sequence[float | None]) -> torch.Tensor:
    return torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float64)


def replay_pattern(record: QuarantineRecord, trainer: Sequence[float],
                   engine: Sequence[float | None] | None) -> Pattern:
    """The pattern of a record: its recorded engine logprobs against the re-scored trainer (and a fresh engine)."""
    recorded = _as_tensor(record.engine_logprobs or [None] * len(trainer))
    replayed_trainer = _as_tensor(trainer)
    fresh = abs_delta(_as_tensor(engine), replayed_trainer) if engine is not None else None
    return classify_pattern(abs_delta(recorded, replayed_trainer), fresh)


def judge_one(engine_logprobs: Sequence[float | None], trainer_logprobs: Sequence[float | None], step: int,
              config: GuardConfig, state: dict | None = None) -> StepReport:
    """One row judged as training judged its step: against ``state``, the run's detector state that step was judged
    against (``rollout_guard.outputs.sinks.read_detector_states``), or, without it, the detector's prior. The row's own
    tokens do not join the noise (one record shows no noise of its own)."""
    guard = RolloutGuard(config)
    if state is not None:
        guard.detector.load_state_dict({name: torch.tensor(value, dtype=torch.float64)
                                        for name, value in state.items()})
    guard.detector.batch_noise = False
    return guard.inspect(evidence_from_lists([list(engine_logprobs)], [list(trainer_logprobs)]), step=step)


def replay(record: QuarantineRecord, model: str | None = None, dtype: str = "float32", with_vllm: bool = True,
           config: GuardConfig | None = None, engine_model: str | None = None,
           states: dict[int, dict] | None = None) -> ReplayResult:
    return replay_many([record], model=model, dtype=dtype, with_vllm=with_vllm, config=config,
                       engine_model=engine_model, states=states)[0]


def replay_many(records: Sequence[QuarantineRecord], model: str | None = None, dtype: str = "float32",
                with_vllm: bool = True,
                config: GuardConfig | None = None, engine_model: str | None = None,
                states: dict[int, dict] | None = None) -> list[ReplayResult]:
    """Replay several records with one transformers model and one fresh engine (all records from one model).
    ``states``: the run's detector states by step (``read_detector_states``); a record whose step has one is judged
    against it, as training judged it (``ReplayResult.calibrated``), the others against the detector's prior."""
    states = states or {}
    model = model or records[0].model
    engine_model = engine_model or model
    hf_model, _ = load_transformers(model, dtype)
    config = config or GuardConfig(max_quarantine_share=None)
    prompts = [r.prompt_ids for r in records]
    completions = [r.completion_ids for r in records]
    by_temperature: dict[float, list[int]] = {}
    for index, record in enumerate(records):
        by_temperature.setdefault(float(record.sampling.get("temperature") or 1.0), []).append(index)
    trainers: list[list[float]] = [[] for _ in records]
    for temperature, indices in by_temperature.items():
        scored = rescore(hf_model, [prompts[i] for i in indices], [completions[i] for i in indices], temperature)
        for index, values in zip(indices, scored, strict=True):
            trainers[index] = values
    engines: list[list[float | None] | None] = [None] * len(records)
    if with_vllm:
        longest = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True)) + 1
        limit = model_max_len(engine_model)
        engine = start_engine(engine_model, dtype=dtype, max_model_len=min(limit, longest) if limit else longest)
        engines = list(engine.score(prompts, completions))
    results = []

    for record, trainer, engine_scores in zip(records, trainers, engines, strict=True):
        recorded_engine = record.engine_logprobs or [None] * len(trainer)
        state = states.get(record.step)
        verdict_recorded = judge_one(recorded_engine, trainer, record.step, config, state)
        verdict_fresh = (judge_one(engine_scores, trainer, record.step, config, state) if engine_scores is not None
                         else None)
        results.append(ReplayResult(record, trainer, engine_scores, verdict_recorded, verdict_fresh,
                                    replay_pattern(record, trainer, engine_scores), calibrated=state is not None))
    return results
