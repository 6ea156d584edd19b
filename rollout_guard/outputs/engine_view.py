"""The engine context next to the mismatch: per-step rows for the engine chart, per-rollout rows for the per-sample
view, and the sink that writes them (``engine_samples.jsonl``, ``engine.png``, ``engine_samples.png``).

The contexts come from the adapter (``rollout_guard.integrations.trl.engine_context``); this module only joins
them to the guard's per-sample statistics and draws them. Missing values stay None (JSON null) / NaN.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from rollout_guard.guard import HISTORY_ROWS
from rollout_guard.outputs.records import json_safe
from rollout_guard.statistics import COLUMN
from rollout_guard.outputs.sinks import Sink

logger = logging.getLogger("rollout_guard")

ENGINE_PREFIX = "engine/"
# per-step values the engine chart draws, with the mismatch values next to them
HISTORY_KEYS = ("max_abs_delta", "quarantined_share", "suspect_share", "engine/kv_cache_usage_max",
                "engine/kv_cache_usage_mean", "engine/running_requests_max", "engine/waiting_requests_max",
                "engine/weight_version", "engine/preemptions",
                "engine/prefix_cache_hit_share", "engine/kv_cache_usage", "engine/running_requests")
SAMPLES_FILE = "engine_samples.jsonl"
SAMPLE_ROWS = 4096
"""rollouts. :class:`EngineContextSink` keeps at most this many rows for the per-rollout chart it redraws during
training (:class:`WorstRows`; the step chart keeps at most ``HISTORY_ROWS``); ``engine_samples.jsonl`` keeps every
rollout."""


def _number(value: Any) -> float:
    return (float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            else math.nan)


def _size(value: Any) -> float:
    """A value to rank rows by: the number, or −inf where it is missing or not finite."""
    number = _number(value)
    return -math.inf if math.isnan(number) else number


class WorstRows:
    """At most ``limit`` rows spread over everything added, for a chart redrawn during a run. One row per added row
    until ``limit`` rows are held; then each two neighbouring rows become the worse of them (the larger ``key``, the
    earlier on ties) and every later row stands for twice as many added rows (:attr:`stride`, doubled at each
    fill). Memory and the time to draw the rows therefore stay flat over any number of steps, and a bad row is
    hidden only by a worse neighbour.

    >>> rows = WorstRows(4, key=lambda row: row["bad"])
    >>> for step in range(1, 11):
    ...     rows.add({"step": step, "bad": 1.0 if step == 6 else 0.0})
    >>> [row["step"] for row in rows.rows], rows.stride, rows.added
    ([1, 6, 9], 4, 10)
    """

    def __init__(self, limit: int, key: Callable[[Any], Any]) -> None:
        if limit < 2:
            raise ValueError(f"limit={limit!r}: use at least 2 rows")
        self.limit, self.key = limit, key
        self.stride = 1  # added rows per held row
        self.added = 0
        self._rows: list[Any] = []
        self._spans: list[int] = []  # added rows each held row stands for

    @property
    def rows(self) -> list[Any]:
        """The held rows, in the order added (a new list)."""
        return list(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, row: Any) -> None:
        self.added += 1
        if self._rows and self._spans[-1] < self.stride:
            self._rows[-1] = max(self._rows[-1], row, key=self.key)
            self._spans[-1] += 1
        else:
            self._rows.append(row)
            self._spans.append(1)
        if len(self._rows) >= self.limit:
            pairs = range(0, len(self._rows), 2)
            self._rows = [max(self._rows[i:i + 2], key=self.key) for i in pairs]
            self._spans = [sum(self._spans[i:i + 2]) for i in pairs]
            self.stride *= 2


def _step_badness(row: dict[str, float]) -> tuple[float, float, float]:
    return _size(row.get("quarantined_share")), _size(row.get("suspect_share")), _size(row.get("max_abs_delta"))


def _rollout_badness(row: dict[str, Any]) -> tuple[bool, float]:
    return bool(row.get("suspect")), _size(row.get("max_abs_delta"))


def _engine_row(row: dict[str, Any]) -> dict[str, float] | None:
    """A ``metrics.jsonl`` row as the engine chart draws it (NaN where missing); None without any ``engine/`` value."""
    if not any(key.startswith(ENGINE_PREFIX) for key in row):
        return None
    return {"step": row["step"], **{key: _number(row.get(key)) for key in HISTORY_KEYS}}


def engine_history(metrics_rows: Iterable[dict[str, Any]]) -> list[dict[str, float]]:
    """Per-step rows for :func:`rollout_guard.outputs.charts.engine_chart` from ``metrics.jsonl`` rows (NaN where missing);
    steps without any ``engine/`` value are left out.

    >>> rows = [{"step": 1, "max_abs_delta": 0.01, "quarantined_share": 0.0, "engine/weight_version": 1.0},
    ...         {"step": 2, "max_abs_delta": 9.0, "quarantined_share": 0.5, "engine/weight_version": 2.0}, {"step": 3}]
    >>> [(row["step"], row["engine/weight_version"], row["quarantined_share"]) for row in engine_history(rows)]
    [(1, 1.0, 0.0), (2, 2.0, 0.5)]
    """
    return [engine for engine in map(_engine_row, metrics_rows) if engine is not None]


def sample_rows(lines: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One dict per rollout from ``engine_samples.jsonl`` lines: step, global row, |Δ| statistics, verdict and the
    engine context fields (the last line of a step wins: a resumed run writes its steps again).

    >>> line = {"step": 3, "rows": [0, 1], "max_abs_delta": [0.1, 12.0], "suspect": [False, True],
    ...         "context": {"weight_version": [3, 3], "kv_cache_usage_max": [0.1, None]}}
    >>> [(r["row"], r["suspect"], r["weight_version"], r["kv_cache_usage_max"]) for r in sample_rows([line])]
    [(0, False, 3, 0.1), (1, True, 3, None)]
    """
    by_step: dict[int, dict[str, Any]] = {}
    for line in lines:
        by_step[int(line["step"])] = line
    rows = []
    for step in sorted(by_step):
        line = by_step[step]
        context = line.get("context") or {}
        for index, row in enumerate(line["rows"]):
            sample = {"step": step, "row": row}
            for key in ("max_abs_delta", "mean_abs_delta", "suspect", "quarantined", "injected"):
                values = line.get(key)
                sample[key] = values[index] if values is not None else None
            sample.update({name: values[index] for name, values in context.items()})
            rows.append(sample)
    return rows


def samples_line(step: int, rows: range, samples: Any, suspect: Any, quarantined: Any, contexts: list[dict | None],
                 injected: list[bool] | None) -> dict[str, Any]:
    """One ``engine_samples.jsonl`` line: this process's rows of the step (global row numbers), their |Δ|
    statistics (from the guard's per-sample table), verdict, injection ground truth, and the contexts column-wise."""
    names: list[str] = []
    for context in contexts:
        for name in context or {}:
            if name not in names:
                names.append(name)
    columns = {name: [None if context is None else context.get(name) for context in contexts] for name in names}
    return json_safe({
        "step": step, "rows": list(rows),
        "max_abs_delta": [float(samples[row, COLUMN["max_abs_delta"]]) for row in rows],
        "mean_abs_delta": [float(samples[row, COLUMN["mean_abs_delta"]]) for row in rows],
        "suspect": [bool(suspect[row]) for row in rows], "quarantined": [bool(quarantined[row]) for row in rows],
        "injected": injected, "context": columns,
    })


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return list(iter_jsonl(path))


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """The JSON lines of ``path``, one at a time (none if it does not exist); lines that are not JSON are skipped."""
    if not path.is_file():
        return
    with path.open("rb") as handle:
        for line in handle:
            if line.strip():
                try:
                    yield json.loads(line)
                except ValueError:
                    continue


class EngineContextSink(Sink):
    """Writes each step's per-rollout engine context next to its |Δ| (``engine_samples.jsonl``) and draws
    ``engine.png`` (per step: max |Δ| and quarantined share against KV-cache usage, running requests and weight
    version) and ``engine_samples.png`` (per rollout). The per-step ``engine/*`` values themselves travel in the
    step's metrics (``metrics.jsonl``, W&B, trackio). Each step's context is the one its report carries
    (:attr:`rollout_guard.guard.StepReport.engine_context`, an object with ``rows``, ``injected``), not the
    collector's latest: on the background writer a step may be written after the next step's rollouts exist (a
    latest-context source joined a lagging step to the next one's context, or dropped its line). ``wandb``: also send
    the charts to the active W&B run.

    The charts are drawn from rows held in memory, at most ``HISTORY_ROWS`` steps and :data:`SAMPLE_ROWS` rollouts
    (:class:`WorstRows`: of neighbouring steps the one with the larger quarantined share, of neighbouring rollouts
    a suspect one, then the larger max |Δ|), so the sink's memory and each redraw's time do not grow with the step
    count; the files keep every step and rollout."""

    def __init__(self, directory: str | Path, chart_every_steps: int = 50, wandb: bool = False) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.chart_every_steps = chart_every_steps
        self.wandb = wandb
        self.path = self.directory / SAMPLES_FILE
        self._history = WorstRows(HISTORY_ROWS, _step_badness)
        self._samples = WorstRows(SAMPLE_ROWS, _rollout_badness)
        self._steps = 0

    @property
    def history(self) -> list[dict[str, float]]:
        """The engine chart's rows (:func:`engine_history`'s), at most ``HISTORY_ROWS``."""
        return self._history.rows

    @property
    def samples(self) -> list[dict[str, Any]]:
        """The per-rollout chart's rows (:func:`sample_rows`'), at most :data:`SAMPLE_ROWS`."""
        return self._samples.rows

    def on_records(self, records: list, guard: Any) -> None:
        pass

    def on_step(self, report: Any, guard: Any) -> None:
        step = report.engine_context
        if step is None or report.skipped:
            return
        line = samples_line(report.step, range(report.local_rows.start, report.local_rows.stop), report.samples,
                            report.suspect, report.quarantined, step.rows, step.injected)
        with self.path.open("a") as handle:
            handle.write(json.dumps(line) + "\n")
        self._add_history({"step": report.step, **report.metrics})
        for sample in sample_rows([line]):
            self._samples.add(sample)
        self._steps += 1
        if self._steps % self.chart_every_steps == 0:
            self.draw()

    def _add_history(self, metrics_row: dict[str, Any]) -> None:
        row = _engine_row(metrics_row)
        if row is not None:
            self._history.add(row)

    def on_resume(self, step: int, guard: Any) -> None:
        """Training resumed from the checkpoint of ``step``: drop later lines (those steps run again) and take the
        charts' earlier steps from ``engine_samples.jsonl`` and ``metrics.jsonl``."""
        kept = [line for line in read_jsonl(self.path) if int(line.get("step", 0)) <= step]
        self.path.write_text("".join(json.dumps(line) + "\n" for line in kept))
        self._samples = WorstRows(SAMPLE_ROWS, _rollout_badness)
        for sample in sample_rows(kept):
            self._samples.add(sample)
        self._history = WorstRows(HISTORY_ROWS, _step_badness)
        for row in iter_jsonl(self.directory / "metrics.jsonl"):
            if int(row.get("step", 0)) <= step:
                self._add_history(row)

    def draw(self) -> list[Path]:
        """Redraw both charts from the rows held (:attr:`history`, :attr:`samples`; needs matplotlib, the ``charts``
        extra)."""
        try:
            from rollout_guard.outputs.charts import engine_chart, engine_samples_chart
        except ImportError:
            return []
        paths = []
        history = self.history
        if history:
            paths.append(engine_chart(history, self.directory / "engine.png"))
        samples = self.samples
        if samples:
            title = ("" if self._samples.stride == 1 else
                     f"Each rollout's mismatch against its engine context ({len(samples)} of {self._samples.added} "
                     f"rollouts, each the worst of up to {self._samples.stride} neighbours)")
            paths.append(engine_samples_chart(samples, self.directory / "engine_samples.png", title))
        return paths

    def on_end(self, guard: Any) -> None:
        paths = self.draw()
        if self.wandb and paths:
            try:
                import wandb

                if wandb.run is not None:
                    wandb.run.log({f"rollout_guard/{path.stem}_chart": wandb.Image(str(path)) for path in paths}
                                  | {"train/global_step": self.history[-1]["step"] if self.history else 0})
            except Exception as error:  # noqa: BLE001
                logger.warning("rollout_guard: engine charts not sent to W&B (%s: %s)", type(error).__name__, error)


def engine_summary(engine: dict[str, Any] | None) -> str:
    """A record's engine context in one line (report tables), fields absent from the record shown as '–'.

    >>> engine_summary({"name": "vllm", "rollout": {"weight_version": 3, "kv_cache_usage_max": 0.0123,
    ...                 "running_requests_max": 16, "cached_tokens": 0, "prompt_tokens": 13, "preemptions": None,
    ...                 "scheduled_s": 0.5, "last_token_s": 1.25}})
    'weights v3 · KV cache ≤ 1.23 % · running ≤ 16 · prefix hit 0/13 · preempted – · ran 0.5–1.25 s'
    >>> engine_summary({"name": "transformers"})
    '–'
    """
    context = (engine or {}).get("rollout")
    if not context:
        return "–"

    def show(value: Any, fmt: str = "{}") -> str:
        return "–" if value is None else fmt.format(value)

    usage = context.get("kv_cache_usage_max")
    return (f"weights v{show(context.get('weight_version'))} · KV cache ≤ "
            f"{show(None if usage is None else 100 * usage, '{:.3g} %')} · "
            f"running ≤ {show(context.get('running_requests_max'))} · "
            f"prefix hit {show(context.get('cached_tokens'))}/"
            f"{show(context.get('prompt_tokens'))} · preempted {show(context.get('preemptions'))} · "
            f"ran {show(context.get('scheduled_s'), '{:.3g}')}–{show(context.get('last_token_s'), '{:.3g}')} s")
