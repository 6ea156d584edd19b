"""W&B (offline) and trackio after a short real GRPO run: read back from disk what a person would see."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from test_trl_e2e import run_scenario

from rollout_guard.outputs.store import read_records


@pytest.fixture(scope="module")
def trackers(tmp_path_factory, tiny_model_dir):
    result, _ = run_scenario("trackers", tmp_path_factory, tiny_model_dir)
    out = result["out"]
    run_files = list(Path(out, "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1, run_files
    inspected = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_files[0])],
                               capture_output=True, text=True, timeout=300)
    assert inspected.returncode == 0, inspected.stderr[-3000:]
    records = [json.loads(line) for line in inspected.stdout.splitlines() if line.startswith("{")]
    result["wandb_records"] = records
    result["wandb_run_dir"] = run_files[0].parent
    return result


def guard_rows(result) -> list[dict]:
    return [json.loads(line) for line in (Path(result["guard_dir"]) / "metrics.jsonl").read_text().splitlines()]


def test_true_per_step_values_with_train_global_step(trackers):
    history = [r["history"]["item"] for r in trackers["wandb_records"] if r["type"] == "history"]
    ours = [item for item in history if "rollout_guard/max_abs_delta" in item]
    local = guard_rows(trackers)
    assert [item["train/global_step"] for item in ours] == [row["step"] for row in local] == [1, 2, 3, 4]
    for item, row in zip(ours, local, strict=True):
        for key in ("max_abs_delta", "p99_abs_delta", "quarantined", "quarantined_share", "max_score",
                    "nonfinite_engine_tokens", "rule/score"):
            assert item[f"rollout_guard/{key}"] == pytest.approx(row[key]), key
        for key in ("engine_max_logprob", "score_threshold", "noise/scale_r3"):  # how it works: a section of its own
            assert item[f"rollout_guard_internal/{key}"] == pytest.approx(row[key]), key
            assert f"rollout_guard/{key}" not in item
        # the engine's state next to the mismatch (engine stats on in this scenario)
        for key in ("engine/weight_version", "engine/kv_cache_usage_max", "engine/running_requests_max", "engine/prefix_cache_hit_share"):
            assert item[f"rollout_guard/{key}"] == pytest.approx(row[key]), key
        assert item["rollout_guard/engine/weight_version"] == row["step"]
        assert item["rollout_guard/log10_abs_delta._type"] == "histogram"
        assert len(item["rollout_guard/log10_abs_delta.bins"]) == len(item["rollout_guard/log10_abs_delta.values"]) + 1
        assert sum(item["rollout_guard/log10_abs_delta.values"]) == row["compared_tokens"]
    assert not any(key.startswith("rollout_guard/") and key.count("/") > 2 for item in ours for key in item)
    # TRL's window means of a few keys sit under a name that cannot be taken for the per-step values
    assert any("train/rollout_guard_window_mean/max_abs_delta" in item for item in history)
    assert not any(key.startswith("train/rollout_guard/") for item in history for key in item)
    metric_defs = [r["metric"] for r in trackers["wandb_records"] if r["type"] == "metric"]
    assert any(m.get("glob_name") == "rollout_guard/*" and m.get("step_metric") == "train/global_step" for m in metric_defs)
    assert any(m.get("glob_name") == "rollout_guard_internal/*" for m in metric_defs)


def test_chart_images_are_written_and_logged(trackers):
    history = [r["history"]["item"] for r in trackers["wandb_records"] if r["type"] == "history"]
    images = {
        key: item[key] for item in history for key in item
        if key.endswith(".path") and item.get(key.removesuffix(".path") + "._type") == "image-file"
    }
    assert any(key.startswith("rollout_guard/spike_chart") for key in images)
    assert any(key.startswith("rollout_guard/worst_sample") for key in images)
    # the engine charts (mismatch against the engine's state per step; each rollout against its context), at the end
    assert {"rollout_guard/engine_chart", "rollout_guard/engine_samples_chart"} <= {key.removesuffix(".path") for key in images}
    for relative in images.values():
        assert (trackers["wandb_run_dir"] / "files" / relative).stat().st_size > 10_000
    spike_steps = [item["train/global_step"] for item in history if "rollout_guard/spike_chart._type" in item]
    assert spike_steps[0] == 1 and len(spike_steps) == 2  # first spike, then the whole-run chart at the end


def test_quarantine_table_rows_hold_the_decoded_text(trackers):
    tables = sorted(Path(trackers["wandb_run_dir"], "files/media/table/rollout_guard").glob("quarantine_table_*.table.json"),
                    key=lambda path: int(path.name.split("_")[2]))
    rows, columns = [], None
    for path in tables:  # incremental: each file holds only that step's new rows
        content = json.loads(path.read_text())
        columns = content["columns"]
        rows.extend(content["data"])
    stored = list(read_records(Path(trackers["guard_dir"]) / "quarantine"))
    assert len(rows) == len(stored) == trackers["summary"]["quarantined"] >= 3
    assert len(tables) == len({record.step for record in stored})
    by_key = {(record.step, record.global_row): record for record in stored}
    for row in rows:
        cell = dict(zip(columns, row, strict=True))
        record = by_key[(cell["step"], cell["rollout"])]
        assert cell["prompt"] == record.prompt_text and cell["prompt"].endswith("=")
        assert cell["completion"] == record.completion_text and cell["injected"] is True
        assert cell["max_abs_delta"] == pytest.approx(record.stats["max_abs_delta"]) and cell["rules"]
        assert cell["why"] == record.explanation and cell["why"].startswith("suspect: ")
        assert cell["score"] == pytest.approx(record.stats["score"])


def test_alerts_are_recorded_and_throttled(trackers):
    alerts = [r["alert"] for r in trackers["wandb_records"] if r["type"] == "alert"]
    local = [json.loads(line) for line in (Path(trackers["guard_dir"]) / "alerts.jsonl").read_text().splitlines()]
    assert [a["title"] for a in alerts] == [a["title"] for a in local]
    kinds = [a["kind"] for a in local]
    assert sorted(kinds) == ["max_abs_delta", "quarantine_rate"]  # once each in 4 steps (cooldown 100 steps)
    assert all(a["level"] == "WARN" and "rollout_guard" in a["title"] for a in alerts)


def test_trackio_receives_the_same_scalars(trackers):
    import os

    os.environ["TRACKIO_DIR"] = str(trackers["out"] / "trackio")
    from trackio.sqlite_storage import SQLiteStorage

    logs = SQLiteStorage.get_logs("rollout-guard-test", "trackers")
    ours = [row for row in logs if "rollout_guard/max_abs_delta" in row]
    local = guard_rows(trackers)
    assert [row["train/global_step"] for row in ours] == [row["step"] for row in local]
    for row, expected in zip(ours, local, strict=True):
        assert row["rollout_guard/quarantined"] == expected["quarantined"]
        assert math.isclose(row["rollout_guard/max_abs_delta"], expected["max_abs_delta"], rel_tol=1e-6)
        assert row["rollout_guard/engine/weight_version"] == expected["engine/weight_version"] == expected["step"]
        assert math.isclose(row["rollout_guard/engine/kv_cache_usage_max"], expected["engine/kv_cache_usage_max"], rel_tol=1e-6)


def test_the_guard_settings_are_in_the_wandb_run_config(trackers):
    configs = [json.dumps(r) for r in trackers["wandb_records"] if r["type"] == "config"]
    assert any("rollout_guard" in text and "false_alarm_budget" in text for text in configs), configs[:2]
