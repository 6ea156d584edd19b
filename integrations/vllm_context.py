"""Engine context of vLLM rollouts: what the engine knew about each request, from vLLM's own fields.

Pure functions over what vLLM hands back anyway (``RequestOutput``, its ``metrics``, the scheduler's per-iteration
stats, the server's Prometheus text), plus :class:`IterationLog`, which keeps the scheduler stats vLLM's stat
logger receives on every engine iteration (no extra engine call). A field the engine does not give is ``None``
(JSON ``null``), never guessed.

Fields of one rollout (:data:`ROLLOUT_FIELDS`), colocate mode (vLLM in the training process):

* ``prompt_tokens``, ``generation_tokens``, ``finish_reason``, ``completion_fingerprint`` (CRC-32 of the completion's
  length and first and last 32 token ids: joins a context to a batch row offline) — always.
* ``cached_tokens`` (``RequestOutput.num_cached_tokens``: prompt tokens served from the prefix cache) and
  ``prefix_cache_hit_share`` (= cached / prompt tokens) — always (0 when prefix caching is off).
* ``preemptions`` (``RequestStateStats.num_preemptions``) and the times ``queued_s``, ``scheduled_s``,
  ``first_token_s``, ``last_token_s`` (seconds after the generate call began, from the engine core's monotonic
  timestamps) — only with engine stats on (``disable_log_stats=False``); else ``None``.
* ``kv_cache_usage_max``, ``kv_cache_usage_mean`` (fraction of KV-cache blocks in use, 0–1),
  ``running_requests_max``, ``waiting_requests_max``, ``engine_preemptions`` (preemptions of any request) over the
  engine iterations between the request's scheduling and its last token — only with engine stats on.
* ``weight_version`` (weight syncs since the start) and ``engine_call`` are the adapter's (counted there).
"""

from __future__ import annotations

import math
import sys
import time
import zlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

ROLLOUT_FIELDS = (
    "engine_call", "weight_version", "prompt_tokens", "generation_tokens", "finish_reason", "completion_fingerprint",
    "cached_tokens", "prefix_cache_hit_share", "preemptions", "queued_s", "scheduled_s", "first_token_s",
    "last_token_s",
    "kv_cache_usage_max", "kv_cache_usage_mean", "running_requests_max", "waiting_requests_max", "engine_preemptions",
)


FINGERPRINT_TOKENS = 32  # tokens from each end of a completion that enter its fingerprint


def completion_fingerprint(token_ids: Sequence[int]) -> int:
    """CRC-32 of a completion's length and its first and last :data:`FINGERPRINT_TOKENS` token ids (all of them up
    to 64 tokens), written as little-endian int64: joins an engine context to its batch row offline at a cost that
    does not grow with the completion (a CRC over 1,024-token completions cost ~0.2 ms per rollout in Python).

    >>> completion_fingerprint([1, 2, 3]) == completion_fingerprint((1, 2, 3))
    True
    >>> completion_fingerprint([1, 2, 3]) != completion_fingerprint([1, 2, 4])
    True
    >>> long = list(range(100))
    >>> completion_fingerprint(long) != completion_fingerprint(long[:-1] + [7])  # the last token counts
    True
    """
    length = len(token_ids)
    head = list(token_ids[:FINGERPRINT_TOKENS])
    tail = list(token_ids[max(FINGERPRINT_TOKENS, length - FINGERPRINT_TOKENS):])
    values = array("q", [length, *head, *tail])
    if sys.byteorder != "little":
        values.byteswap()
    return zlib.crc32(values.tobytes())


def _share(part: float | None, whole: float | None) -> float | None:
    """``part / whole``, or None when either is missing or ``whole`` is 0.

    >>> _share(3, 4), _share(0, 0), _share(None, 4)
    (0.75, None, None)
    """
    if part is None or whole is None or whole == 0:
        return None
    return part / whole


@dataclass
class IterationLog:
    """Scheduler stats of each engine iteration, as vLLM's stat logger receives them (engine stats on).

    Columns (one entry per iteration): ``at`` (``time.monotonic()`` when recorded: the clock of the engine core's
    request timestamps on Linux), ``running``, ``waiting`` (requests), ``kv_usage`` (0–1), ``preempted`` (requests
    preempted in that iteration; None without iteration stats).
    """

    at: list[float] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)
    preempted: list[int | None] = field(default_factory=list)
    seconds: float = 0.0  # time spent in ``add`` (this log's own cost)

    def add(self, scheduler_stats: Any, iteration_stats: Any, at: float | None = None) -> None:
        if scheduler_stats is None:
            return
        self.at.append(time.monotonic() if at is None else at)
        self.running.append(int(scheduler_stats.num_running_reqs))
        self.waiting.append(int(scheduler_stats.num_waiting_reqs))
        self.kv_usage.append(float(scheduler_stats.kv_cache_usage))
        self.preempted.append(None if iteration_stats is None else int(iteration_stats.num_preempted_reqs))

    def drain(self) -> IterationLog:
        """The iterations so far, leaving this log empty."""
        taken = IterationLog(self.at, self.running, self.waiting, self.kv_usage, self.preempted, self.seconds)
        self.at, self.running, self.waiting, self.kv_usage, self.preempted, self.seconds = [], [], [], [], [], 0.0
        return taken

    def __len__(self) -> int:
        return len(self.at)

    @classmethod
    def attach(cls, llm: Any) -> IterationLog | None:
        """Keep the scheduler stats of this ``vllm.LLM``'s iterations: wraps its stat logger manager's ``record`` on
        the instance (vLLM calls it once per engine step anyway). None when engine stats are off."""
        engine = getattr(llm, "llm_engine", None)
        manager = getattr(engine, "logger_manager", None)
        if manager is None or not hasattr(manager, "record"):
            return None
        log = cls()
        original = manager.record

        def record(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            scheduler_stats = kwargs.get("scheduler_stats", args[0] if args else None)
            iteration_stats = kwargs.get("iteration_stats", args[1] if len(args) > 1 else None)
            log.add(scheduler_stats, iteration_stats)
            log.seconds += time.perf_counter() - started
            return original(*args, **kwargs)

        manager.record = record
        return log


_WINDOW_KEYS = ("kv_cache_usage_max", "kv_cache_usage_mean", "running_requests_max", "waiting_requests_max",
                "engine_preemptions")


def _range_max(values: Any, lo: Any, hi: Any) -> Any:
    """max(values[lo[i]:hi[i]]) for every i (all ranges non-empty), vectorised with a sparse table: O(n log n) to
    build, O(1) per range.

    >>> import numpy as np
    >>> _range_max(np.array([3, 1, 4, 1, 5, 9, 2]), np.array([0, 1, 3, 6]), np.array([2, 4, 6, 7])).tolist()
    [3, 4, 9, 2]
    """
    import numpy as np

    table = [values]
    while 2 ** len(table) <= len(values):
        previous, width = table[-1], 2 ** (len(table) - 1)
        table.append(np.maximum(previous[:-width], previous[width:]))
    level = np.floor(np.log2(hi - lo)).astype(np.int64)
    result = np.empty(len(lo), dtype=values.dtype)
    for k in np.unique(level):
        chosen = level == k
        row = table[k]
        result[chosen] = np.maximum(row[lo[chosen]], row[hi[chosen] - 2 ** k])
    return result


def window_stats_batch(log: IterationLog, starts: Sequence[float | None],
                       stops: Sequence[float | None]) -> list[dict[str, Any]]:
    """Engine state over each request's life: the iterations recorded from ``starts[i]`` (its scheduling) up to and
    including the first one recorded at or after ``stops[i]`` (its last token; vLLM records an iteration just after
    the engine core stamps its outputs). Keys: ``kv_cache_usage_max``, ``kv_cache_usage_mean``,
    ``running_requests_max``, ``waiting_requests_max``, ``engine_preemptions``; all None for a request without
    times or whose window holds no recorded iteration. Vectorised (numpy): O((iterations + requests) log iterations).

    >>> log = IterationLog()
    >>> for t, running, usage in [(1.0, 2, 0.1), (2.0, 8, 0.4), (3.0, 4, 0.2), (4.0, 1, 0.05)]:
    ...     log.at.append(t); log.running.append(running); log.waiting.append(0); log.kv_usage.append(usage); log.preempted.append(0)
    >>> first, late, untimed = window_stats_batch(log, [1.5, 5.0, None], [2.5, 6.0, None])
    >>> first["kv_cache_usage_max"], first["running_requests_max"], round(first["kv_cache_usage_mean"], 3)
    (0.4, 8, 0.3)
    >>> late["kv_cache_usage_max"] is None and untimed["running_requests_max"] is None
    True
    """
    import numpy as np

    empty = dict.fromkeys(_WINDOW_KEYS)
    results: list[dict[str, Any]] = [dict(empty) for _ in starts]
    timed = [i for i, (a, b) in enumerate(zip(starts, stops, strict=True)) if a is not None and b is not None]
    if not log.at or not timed:
        return results
    at = np.asarray(log.at, dtype=np.float64)
    lo = np.searchsorted(at, np.asarray([starts[i] for i in timed], dtype=np.float64), side="left")
    hi = np.minimum(np.searchsorted(at, np.asarray([stops[i] for i in timed], dtype=np.float64), side="left") + 1,
                    len(at))
    valid = lo < hi
    if not valid.any():
        return results
    index = [timed[i] for i in np.flatnonzero(valid)]
    lo, hi = lo[valid], hi[valid]
    usage = np.asarray(log.kv_usage, dtype=np.float64)
    usage_sum = np.concatenate(([0.0], np.cumsum(usage)))
    columns = {
        "kv_cache_usage_max": _range_max(usage, lo, hi).tolist(),
        "kv_cache_usage_mean": ((usage_sum[hi] - usage_sum[lo]) / (hi - lo)).tolist(),
        "running_requests_max": _range_max(np.asarray(log.running, dtype=np.int64), lo, hi).tolist(),
        "waiting_requests_max": _range_max(np.asarray(log.waiting, dtype=np.int64), lo, hi).tolist(),
    }
    if any(p is None for p in log.preempted):  # not given for some iteration: the count would be a guess
        columns["engine_preemptions"] = [None] * len(index)
    else:
        preempted_sum = np.concatenate(([0], np.cumsum(np.asarray(log.preempted, dtype=np.int64))))
        columns["engine_preemptions"] = (preempted_sum[hi] - preempted_sum[lo]).tolist()
    for position, i in enumerate(index):
        results[i] = {key: columns[key][position] for key in _WINDOW_KEYS}
    return results


def window_stats(log: IterationLog, start: float | None, stop: float | None) -> dict[str, Any]:
    """:func:`window_stats_batch` for one request."""
    return window_stats_batch(log, [start], [stop])[0]


def _since(timestamp: float | None, origin: float) -> float | None:
    return None if timestamp is None or timestamp <= 0 else timestamp - origin


def rollout_contexts(outputs: Iterable[Any], call_started: float, log: IterationLog | None, weight_version: int | None,
                     engine_call: int) -> list[dict[str, Any]]:
    """One context per completion of each ``RequestOutput`` (in vLLM's order: ``outputs[i].outputs[j]``), see
    :data:`ROLLOUT_FIELDS`. ``call_started``: ``time.monotonic()`` when the generate call began; ``log``: the
    iterations of that call (None: engine stats off, those fields stay None)."""
    outputs = list(outputs)
    # RequestStateStats (vLLM v1) has engine-core monotonic timestamps; anything else: no timing fields
    timings = [getattr(output, "metrics", None) for output in outputs]
    timings = [stats if stats is not None and hasattr(stats, "scheduled_ts") else None for stats in timings]
    starts = [stats.scheduled_ts if stats is not None and stats.scheduled_ts > 0 else None for stats in timings]
    stops = [stats.last_token_ts if stats is not None and stats.last_token_ts > 0 else None for stats in timings]
    windows = window_stats_batch(log if log is not None else IterationLog(), starts, stops)
    contexts = []
    for output, stats, start, stop, window in zip(outputs, timings, starts, stops, windows, strict=True):
        prompt_tokens = len(output.prompt_token_ids) if output.prompt_token_ids is not None else None
        cached = getattr(output, "num_cached_tokens", None)
        shared = {
            "engine_call": engine_call, "weight_version": weight_version, "prompt_tokens": prompt_tokens,
            "cached_tokens": cached, "prefix_cache_hit_share": _share(cached, prompt_tokens),
            "preemptions": int(stats.num_preemptions) if stats is not None else None,
            "queued_s": _since(stats.queued_ts, call_started) if stats is not None else None,
            "scheduled_s": _since(start, call_started),
            "first_token_s": _since(stats.first_token_ts, call_started) if stats is not None else None,
            "last_token_s": _since(stop, call_started),
            **window,
        }
        for completion in output.outputs:
            contexts.append({**shared, "generation_tokens": len(completion.token_ids),
                             "finish_reason": completion.finish_reason,
                             "completion_fingerprint": completion_fingerprint(completion.token_ids)})
    return [{name: context[name] for name in ROLLOUT_FIELDS} for context in contexts]


def engine_settings(llm: Any) -> dict[str, Any]:
    """The engine settings that shape scheduling and numerics, read from a ``vllm.LLM``'s config (None if absent)."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)

    def read(section: str, name: str) -> Any:
        value = getattr(getattr(config, section, None), name, None)
        return str(value).removeprefix("torch.") if name in ("dtype", "cache_dtype") and value is not None else value

    return {
        "dtype": read("model_config", "dtype"), "max_model_len": read("model_config", "max_model_len"),
        "enforce_eager": read("model_config", "enforce_eager"), "logprobs_mode": read("model_config", "logprobs_mode"),
        "max_num_seqs": read("scheduler_config", "max_num_seqs"),
        "max_num_batched_tokens": read("scheduler_config", "max_num_batched_tokens"),
        "block_size": read("cache_config", "block_size"), "cache_blocks": read("cache_config", "num_gpu_blocks"),
        "kv_cache_dtype": read("cache_config", "cache_dtype"),
        "enable_prefix_caching": read("cache_config", "enable_prefix_caching"),
        "gpu_memory_utilization": read("cache_config", "gpu_memory_utilization"),
        "tensor_parallel_size": read("parallel_config", "tensor_parallel_size"),
        "engine_stats": getattr(getattr(llm, "llm_engine", None), "log_stats", None),
    }


def summarise_iterations(log: IterationLog) -> dict[str, float]:
    """Per-step engine values over one generation's iterations (NaN when none were recorded).

    >>> log = IterationLog([1.0, 2.0], [3, 5], [1, 0], [0.25, 0.5], [0, 2])
    >>> summarise_iterations(log)
    {'kv_cache_usage_max': 0.5, 'kv_cache_usage_mean': 0.375, 'running_requests_max': 5.0, 'waiting_requests_max': 1.0, 'preemptions': 2.0, 'iterations': 2.0}
    """
    if not log.at:
        nan = math.nan
        return {"kv_cache_usage_max": nan, "kv_cache_usage_mean": nan, "running_requests_max": nan,
                "waiting_requests_max": nan, "preemptions": nan, "iterations": 0.0}
    preempted = [p for p in log.preempted if p is not None]
    return {"kv_cache_usage_max": max(log.kv_usage), "kv_cache_usage_mean": sum(log.kv_usage) / len(log.kv_usage),
            "running_requests_max": float(max(log.running)), "waiting_requests_max": float(max(log.waiting)),
            "preemptions": float(sum(preempted)) if len(preempted) == len(log.preempted) else math.nan,
            "iterations": float(len(log.at))}


# -- server mode: the Prometheus text of vLLM's /metrics ---------------------------------------------------------

# the families server_step_context and server_settings read (the rest of vLLM's ~300 lines are skipped before
# parsing: prometheus_client's parser takes ~30 ms for the whole text on a loaded 2-core CPU)
SERVER_FAMILIES = (
    "vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_preemptions",
    "vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:request_success", "vllm:request_queue_time_seconds",
    "vllm:time_to_first_token_seconds", "vllm:generation_tokens", "vllm:cache_config_info",
)


def keep_families(text: str, families: Sequence[str] = SERVER_FAMILIES) -> str:
    """The lines of Prometheus text (samples and their ``# HELP``/``# TYPE`` lines) whose family is in ``families``,
    without histogram buckets and ``_created`` samples.

    >>> text = "# TYPE a counter\\na_total 1.0\\n# TYPE b gauge\\nb{x=\\"1\\"} 2.0\\n"
    >>> keep_families(text, ("b",))
    '# TYPE b gauge\\nb{x="1"} 2.0\\n'
    """
    kept = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(maxsplit=3)
            name = parts[2] if len(parts) > 2 else ""
        else:
            name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.endswith(("_bucket", "_created")):  # histogram buckets and creation times: not read
            continue
        if any(name == family or name.startswith(family + "_") for family in families):
            kept.append(line + "\n")
    return "".join(kept)


def parse_prometheus(text: str) -> dict[str, float]:
    """vLLM's Prometheus text as ``{sample name: value}``, summed over label sets (engines, models, …) except
    histogram buckets (dropped). Sample names as exposed: counters end in ``_total``, histograms give ``_sum`` and
    ``_count``. Uses ``prometheus_client``'s parser (installed with vLLM).

    >>> text = '''# TYPE vllm:num_requests_running gauge
    ... vllm:num_requests_running{engine="0",model_name="m"} 3.0
    ... vllm:num_requests_running{engine="1",model_name="m"} 2.0
    ... # TYPE vllm:num_preemptions counter
    ... vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
    ... '''
    >>> parse_prometheus(text)
    {'vllm:num_requests_running': 5.0, 'vllm:num_preemptions_total': 7.0}
    """
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(("_bucket", "_created")):
                continue
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    return values


def server_settings(text: str) -> dict[str, Any]:
    r"""Engine settings a vLLM server exposes in its ``vllm:cache_config_info`` info metric (labels; values as
    strings in the text, converted where they are numbers or booleans): block size, cache blocks, prefix caching,
    KV-cache dtype, memory utilisation. Empty when the family is absent.

    >>> text = 'vllm:cache_config_info{block_size="32",enable_prefix_caching="True",num_gpu_blocks="32768",cache_dtype="auto"} 1.0\n'
    >>> server_settings(text)
    {'block_size': 32, 'cache_blocks': 32768, 'enable_prefix_caching': True, 'kv_cache_dtype': 'auto', 'gpu_memory_utilization': None}
    """
    from prometheus_client.parser import text_string_to_metric_families

    labels: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:cache_config_info"):
                labels = dict(sample.labels)
    if not labels:
        return {}

    def convert(value: str | None) -> Any:
        if value is None or value == "None":
            return None
        if value in ("True", "False"):
            return value == "True"
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                pass
        return value

    return {"block_size": convert(labels.get("block_size")), "cache_blocks": convert(labels.get("num_gpu_blocks")),
            "enable_prefix_caching": convert(labels.get("enable_prefix_caching")),
            "kv_cache_dtype": convert(labels.get("cache_dtype")),
            "gpu_memory_utilization": convert(labels.get("gpu_memory_utilization"))}


def server_step_context(now: dict[str, float], before: dict[str, float] | None, engines: int = 1) -> dict[str, float]:
    """Per-step engine values of a vLLM server from two ``/metrics`` scrapes (``before``: the previous step's, or
    None at the first step: then counters count from the server's start). Gauges (``kv_cache_usage``: mean over
    ``engines``, 0–1; ``running_requests``, ``waiting_requests``) are their values at scrape time; the rest are this
    step's deltas: ``preemptions``, ``prefix_cache_hit_share`` (hit / queried prompt tokens), ``requests_finished``,
    ``queue_seconds_mean`` and ``time_to_first_token_mean`` (per request), ``generation_tokens``. A family the
    server does not expose gives NaN.

    >>> before = {"vllm:num_preemptions_total": 2.0, "vllm:prefix_cache_queries_total": 100.0,
    ...           "vllm:prefix_cache_hits_total": 10.0}
    >>> now = {"vllm:num_preemptions_total": 5.0, "vllm:prefix_cache_queries_total": 300.0,
    ...        "vllm:prefix_cache_hits_total": 60.0,
    ...        "vllm:kv_cache_usage_perc": 0.5, "vllm:num_requests_running": 4.0}
    >>> step = server_step_context(now, before)
    >>> step["preemptions"], step["prefix_cache_hit_share"], step["kv_cache_usage"], step["running_requests"]
    (3.0, 0.25, 0.5, 4.0)
    >>> math.isnan(step["queue_seconds_mean"])
    True
    """
    before = before or {}
    nan = math.nan

    def gauge(name: str) -> float:
        return now.get(name, nan)

    def delta(name: str) -> float:
        return now[name] - before.get(name, 0.0) if name in now else nan

    def ratio(numerator: float, denominator: float) -> float:
        return (numerator / denominator if math.isfinite(numerator) and math.isfinite(denominator) and denominator > 0
                else nan)

    return {
        "kv_cache_usage": gauge("vllm:kv_cache_usage_perc") / max(engines, 1),
        "running_requests": gauge("vllm:num_requests_running"),
        "waiting_requests": gauge("vllm:num_requests_waiting"),
        "preemptions": delta("vllm:num_preemptions_total"),
        "prefix_cache_hit_share": ratio(delta("vllm:prefix_cache_hits_total"),
                                        delta("vllm:prefix_cache_queries_total")),
        "requests_finished": delta("vllm:request_success_total"),
        "queue_seconds_mean": ratio(delta("vllm:request_queue_time_seconds_sum"),
                                    delta("vllm:request_queue_time_seconds_count")),
        "time_to_first_token_mean": ratio(delta("vllm:time_to_first_token_seconds_sum"),
                                          delta("vllm:time_to_first_token_seconds_count")),
        "generation_tokens": delta("vllm:generation_tokens_total"),
    }


def scrape_metrics(base_url: str, timeout: float = 2.0) -> str:
    """The text of ``{base_url}/metrics`` (one HTTP GET)."""
    import urllib.request

    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout) as response:
        return response.read().decode()
