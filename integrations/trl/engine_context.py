"""Engine context of each TRL rollout: what vLLM knew about it, joined to the rows of the batch the guard judges.

No extra engine round trip. In colocate mode the adapter wraps, on this trainer's instances only:

* ``vllm_generation.llm.generate``: keeps the ``RequestOutput``\\s TRL receives anyway and turns them into one
  context per completion (:func:`rollout_guard.integrations.vllm_context.rollout_contexts`);
* the stat logger manager's ``record`` (engine stats on only): the scheduler's KV-cache usage and running / waiting
  requests of every engine iteration, so that each rollout gets the values over its own life;
* ``vllm_generation.sync_weights``: counts weight syncs since the start (``weight_version``; TRL syncs before the
  first generation, so the first rollouts have version 1).

Row mapping (TRL 1.14–1.16): in colocate mode every process generates its own rows, one request per row
(``n=1``; prompts already repeated ``num_generations`` times), and ``llm.generate`` returns them in request order;
with ``vllm_tensor_parallel_size > 1`` the call covers the whole TP group and the process keeps its slice, as TRL
does. The first generate call of a step whose size matches is mapped; any other shape (TRL's tool-call loop adds
calls for a subset of rows) leaves the rows unmapped (``None``), counted in ``engine/unmapped_rows``. In server mode
the server's ``/metrics`` is scraped once per step on the main process (per-step values, no per-request fields).
With ``use_vllm=False`` there is no engine and no context.

vLLM's per-request timings and the per-iteration scheduler stats exist only with engine stats on
(``disable_log_stats=False``): TRL creates its ``LLM`` with vLLM's default (off). Call
:func:`enable_vllm_engine_stats` before building the trainer to turn them on; otherwise those fields are ``None``.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout_guard.integrations.vllm_context import (
    ROLLOUT_FIELDS, IterationLog, engine_settings, keep_families, parse_prometheus, rollout_contexts, scrape_metrics,
    server_settings,
    server_step_context,
    summarise_iterations,
)

logger = logging.getLogger("rollout_guard")

METRIC_PREFIX = "engine/"
_STATS_MARK = "_rollout_guard_engine_stats"


def enable_vllm_engine_stats() -> None:
    """Make TRL start its colocated vLLM engine with stats on (``disable_log_stats=False``), so that each rollout
    gets vLLM's queue / schedule / first- and last-token times, its preemptions and the KV-cache usage and running
    requests over its life. Call once, before constructing the ``GRPOTrainer``; an explicit ``disable_log_stats``
    passed to ``LLM`` wins. vLLM's own server turns stats on by default."""
    import trl.generation.vllm_generation as vllm_generation

    if getattr(vllm_generation, _STATS_MARK, False):
        return
    original = vllm_generation.LLM

    @functools.wraps(original)
    def llm_with_stats(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("disable_log_stats", False)
        return original(*args, **kwargs)

    vllm_generation.LLM = llm_with_stats
    setattr(vllm_generation, _STATS_MARK, True)


@dataclass
class StepEngineContext:
    """The engine context of one generation step on this process."""

    rows: list[dict[str, Any] | None]  # one context per local batch row (None: not mapped)
    metrics: dict[str, float]  # per-step values, keys ``engine/…`` (NaN: not given by this engine mode)
    settings: dict[str, Any] = field(default_factory=dict)
    injected: list[bool] | None = None  # rows a fault injector corrupted (tests)


def _nanmax(values: list[float | None]) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return max(finite) if finite else math.nan


class EngineContextCollector:
    """Collects the engine context of one TRL trainer's rollouts. Create it with :meth:`attach`."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        generation = trainer.vllm_generation
        self.generation = generation
        self.mode = generation.mode
        self.weight_version = 0
        self.engine_calls = 0
        self.calls: list[dict[str, Any]] = []
        self.seconds = 0.0  # time this collector spent in the current step
        self.last_step: StepEngineContext | None = None
        self.log: IterationLog | None = None
        self.settings: dict[str, Any] = {"mode": self.mode}
        self._server_before: dict[str, float] | None = None
        self._said: set[str] = set()

        original_sync = generation.sync_weights

        @functools.wraps(original_sync)
        def sync_weights(*args: Any, **kwargs: Any) -> Any:
            result = original_sync(*args, **kwargs)
            self.weight_version += 1
            return result

        generation.sync_weights = sync_weights
        if self.mode == "colocate":
            llm = generation.llm
            self.settings.update(engine_settings(llm))
            self.log = IterationLog.attach(llm)
            if self.log is None:
                self._say("no-stats", "rollout_guard: vLLM engine stats are off (TRL's default), so rollouts have no "
                          "queue/first-token times, preemptions, KV-cache usage or running requests; call "
                          "rollout_guard.integrations.trl.enable_vllm_engine_stats() before building the trainer")
            original_generate = llm.generate

            @functools.wraps(original_generate)
            def generate(*args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                if self.log is not None:
                    # iterations of other callers (none in TRL) are not this call's
                    self.seconds += self.log.drain().seconds
                call_started = time.monotonic()
                self.seconds += time.perf_counter() - started
                outputs = original_generate(*args, **kwargs)
                generated = time.perf_counter()
                try:
                    self._record_call(outputs, call_started, generated - started)
                except Exception as error:  # noqa: BLE001 - context is diagnostics: never break generation
                    self._say("call-failed", "rollout_guard: engine context of a generate call failed "
                              f"({type(error).__name__}: {error})")
                self.seconds += time.perf_counter() - generated
                return outputs

            llm.generate = generate

    @classmethod
    def attach(cls, trainer: Any) -> EngineContextCollector | None:
        """A collector for this trainer, or None when it generates without vLLM (``use_vllm=False``)."""
        if not getattr(trainer, "use_vllm", False) or getattr(trainer, "vllm_generation", None) is None:
            return None
        try:
            return cls(trainer)
        except Exception as error:  # noqa: BLE001 - diagnostics only: an unexpected TRL/vLLM layout must not stop
            # training
            logger.warning("rollout_guard: no engine context for this trainer (%s: %s)", type(error).__name__, error)
            return None

    def _say(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.warning(message)

    def _record_call(self, outputs: Any, call_started: float, seconds: float) -> None:
        iterations = self.log.drain() if self.log is not None else None
        if iterations is not None:
            self.seconds += iterations.seconds  # recording each iteration's scheduler stats, during generation
        contexts = rollout_contexts(outputs, call_started, iterations, self.weight_version, self.engine_calls)
        self.engine_calls += 1
        self.calls.append({"contexts": contexts, "seconds": seconds,
                           "iterations": summarise_iterations(iterations) if iterations is not None else None})

    # -- per step ---------------------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """A generation step starts: forget the previous step's calls."""
        self.calls = []
        self.seconds = 0.0

    def _tp_slice(self, rows: int, size: int) -> slice | None:
        tp = int(getattr(self.generation, "tensor_parallel_size", 1) or 1)
        if size == rows:
            return slice(0, rows)
        if tp > 1 and size == rows * tp:
            rank = torch.distributed.get_rank(group=self.generation.tp_group)
            return slice(rank * rows, (rank + 1) * rows)
        return None

    def end_step(self, rows: int) -> StepEngineContext:
        """This step's contexts mapped to the ``rows`` local batch rows, and its per-step values."""
        started = time.perf_counter()
        mapped: list[dict[str, Any] | None] = [None] * rows
        first = self.calls[0]["contexts"] if self.calls else []
        where = self._tp_slice(rows, len(first)) if self.calls else None
        if where is not None:
            mapped = list(first[where])
        elif self.mode == "colocate":
            self._say("unmapped", f"rollout_guard: vLLM's first generate call of this step returned {len(first)} "
                      f"completions for {rows} batch rows; their engine context is left unmapped")
        metrics = {"weight_version": float(self.weight_version), "calls": float(len(self.calls)),
                   "unmapped_rows": float(sum(context is None for context in mapped))}
        if self.mode == "colocate":
            metrics.update(self._colocate_metrics(mapped))
        elif self.mode == "server":
            server = self._server_metrics()
            metrics.update(server)
            base = {name: None for name in ROLLOUT_FIELDS}
            mapped = [{**base, "weight_version": self.weight_version, "engine_call": self.engine_calls,
                       "server_step": server or None} for _ in range(rows)]
            self.engine_calls += 1
            metrics["unmapped_rows"] = 0.0
            metrics["calls"] = math.nan  # TRL's vllm_client calls are not counted
        injector = getattr(self.trainer, "_rollout_guard_injector", None)
        injected = (None if injector is None or injector.last_selected is None
            else [bool(v) for v in injector.last_selected.tolist()])
        self.seconds += time.perf_counter() - started
        metrics["context_seconds"] = self.seconds
        step = StepEngineContext(rows=mapped, metrics={f"{METRIC_PREFIX}{k}": v for k, v in metrics.items()},
                                 settings=dict(self.settings), injected=injected)
        self.last_step = step
        return step

    def _colocate_metrics(self, mapped: list[dict[str, Any] | None]) -> dict[str, float]:
        contexts = [context for call in self.calls for context in call["contexts"]]
        prompt = sum(c["prompt_tokens"] or 0 for c in contexts)
        cached = [c["cached_tokens"] for c in contexts]
        step_iterations = [call["iterations"] for call in self.calls if call["iterations"] is not None]
        values = {
            "generation_seconds": float(sum(call["seconds"] for call in self.calls)),
            "prefix_cache_hit_share": (sum(cached) / prompt) if contexts and prompt and None not in cached
                                      else math.nan,
            "kv_cache_usage_max": _nanmax([it["kv_cache_usage_max"] for it in step_iterations]),
            "running_requests_max": _nanmax([it["running_requests_max"] for it in step_iterations]),
            "waiting_requests_max": _nanmax([it["waiting_requests_max"] for it in step_iterations]),
            "preemptions": float(sum(it["preemptions"] for it in step_iterations)) if step_iterations else math.nan,
            "iterations": float(sum(it["iterations"] for it in step_iterations)) if step_iterations else math.nan,
        }
        total = sum(it["iterations"] for it in step_iterations)
        values["kv_cache_usage_mean"] = (sum(it["kv_cache_usage_mean"] * it["iterations"] for it in step_iterations
                                             if it["iterations"]) / total) if total else math.nan
        return values

    def _server_metrics(self) -> dict[str, float]:
        """One scrape of the server's /metrics (main process; the other processes have no client)."""
        client = getattr(self.generation, "vllm_client", None)
        if client is None:
            return {}
        from urllib.parse import urlsplit

        parts = urlsplit(client.base_url)
        try:
            started = time.perf_counter()
            text = scrape_metrics(f"{parts.scheme}://{parts.netloc}")
            text = keep_families(text)  # only what is read: parsing vLLM's whole text costs ~30 ms
            now = parse_prometheus(text)
            if self._server_before is None:
                self.settings.update(server_settings(text))
            values = server_step_context(now, self._server_before)
            values["scrape_seconds"] = time.perf_counter() - started
        except Exception as error:  # noqa: BLE001 - no metrics endpoint: say so once, record nothing
            self._say("scrape", "rollout_guard: could not read the vLLM server's /metrics "
                      f"({type(error).__name__}: {error}); "
                      "no engine values in server mode")
            return {}
        self._server_before = now
        return values


def add_context_to_records(records: list[Any], step: StepEngineContext | None) -> None:
    """Put each record's engine context (its row's, and the engine settings) into ``record.engine``, in place."""
    if step is None:
        return
    for record in records:
        context = step.rows[record.row] if 0 <= record.row < len(step.rows) else None
        record.engine = {**record.engine, "rollout": context, "settings": step.settings}
