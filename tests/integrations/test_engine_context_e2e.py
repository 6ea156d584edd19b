"""Engine context end to end: real TRL GRPOTrainer, real vLLM (CPU build, engine stats on, a 6-block KV cache so that
requests queue), tiny local model, and a fault that depends on engine state: rollouts are corrupted only once the
engine has had 3 weight syncs. The joined per-step metrics, the chart data and the records must show it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_trl_e2e import run_scenario

from rollout_guard.outputs.engine_view import SAMPLES_FILE, engine_history, read_jsonl, sample_rows
from rollout_guard.integrations.vllm_context import completion_fingerprint
from rollout_guard.outputs.store import read_records

AFTER_SYNCS = 3  # the scenario's gate (grpo_scenario.SCENARIOS["engine_state"])
STEPS = 5


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory, tiny_model_dir):
    result, log = run_scenario("engine_state", tmp_path_factory, tiny_model_dir, steps=STEPS)
    guard_dir = Path(result["guard_dir"])
    result["metrics"] = [json.loads(line) for line in (guard_dir / "metrics.jsonl").read_text().splitlines()]
    result["samples"] = read_jsonl(guard_dir / SAMPLES_FILE)
    result["records"] = list(read_records(guard_dir / "quarantine"))
    result["log"] = log
    return result


def test_joined_step_metrics_and_chart_data_show_the_dependence(engine_run):
    history = engine_history(engine_run["metrics"])  # what engine.png draws
    assert [row["step"] for row in history] == list(range(1, STEPS + 1))
    # TRL syncs the weights before each step's generation: version = step
    assert [row["engine/weight_version"] for row in history] == [float(s) for s in range(1, STEPS + 1)]
    for row in history:
        if row["engine/weight_version"] < AFTER_SYNCS:
            assert row["quarantined_share"] == 0 and row["max_abs_delta"] < 1e-3, row
        else:
            assert row["quarantined_share"] > 0 and row["max_abs_delta"] > 3, row
    # the constrained engine shows in its own values: requests queued, the cache full at some point
    for row in history:
        assert row["engine/running_requests_max"] <= 6 and row["engine/waiting_requests_max"] >= 1, row
        assert 0.5 <= row["engine/kv_cache_usage_max"] <= 1.0 and row["engine/preemptions"] >= 0, row
    guard_dir = Path(engine_run["guard_dir"])
    assert (guard_dir / "engine.png").stat().st_size > 20_000 and (guard_dir / "engine_samples.png").stat().st_size > 20_000


def test_records_carry_the_context_that_explains_them(engine_run):
    records = engine_run["records"]
    assert len(records) >= 5 and all(record.injected for record in records)
    for record in records:
        context, settings = record.engine["rollout"], record.engine["settings"]
        assert context["weight_version"] >= AFTER_SYNCS, context
        assert record.step == context["weight_version"]  # the version that produced it is the step's
        for name in ("kv_cache_usage_max", "running_requests_max", "scheduled_s", "last_token_s", "preemptions", "cached_tokens"):
            assert context[name] is not None, (name, context)
        assert 0 <= context["scheduled_s"] <= context["first_token_s"] <= context["last_token_s"]
        assert settings["dtype"] == "float32" and settings["cache_blocks"] == 6 and settings["engine_stats"] is True
        assert settings["max_num_batched_tokens"] == 4096 and settings["block_size"] >= 1


def test_every_row_is_joined_to_its_own_engine_output_clean_rows_included(engine_run):
    """The context of each batch row (suspect or clean) is the engine's output for that row: its fingerprint of the
    completion tokens and its length equal those of the completion TRL put in that row."""
    lines = {line["step"]: line for line in engine_run["samples"]}
    clean_with_context = 0
    for index, (raw, injected) in enumerate(zip(engine_run["raw"], engine_run["injected"], strict=True)):
        line = lines[index + 1]
        context = line["context"]
        assert line["injected"] == injected.tolist()
        for row in range(raw["completion_ids"].shape[0]):
            ids = raw["completion_ids"][row][raw["completion_mask"][row].bool()].tolist()
            assert context["generation_tokens"][row] == len(ids), (index, row)
            assert context["completion_fingerprint"][row] == completion_fingerprint(ids), (index, row)
            if not line["suspect"][row]:
                assert context["weight_version"][row] == index + 1 and context["kv_cache_usage_max"][row] is not None
                clean_with_context += 1
    assert clean_with_context >= 40  # clean negatives (steps before the gate and unselected rows after it)
    # the per-sample view: suspect rollouts are exactly the injected ones, all at weight version >= the gate
    samples = sample_rows(engine_run["samples"])
    assert len(samples) == STEPS * 16
    assert all(s["weight_version"] >= AFTER_SYNCS for s in samples if s["suspect"])
    assert [s["suspect"] for s in samples] == [s["injected"] for s in samples]
    # rollouts of one step saw different engine states (the 6-block cache makes later requests queue)
    assert len({s["queued_s"] is not None and round(s["scheduled_s"], 3) for s in samples if s["step"] == 1}) > 1


def test_the_cost_of_the_context_is_recorded_every_step(engine_run):
    """Every step records what building the contexts took next to the generation it describes. How small it is, is a
    speed figure and lives in ``benchmarks/engine_context_overhead.py`` (a timed assertion here failed once in CI on a
    busy 2-core machine); this prints it."""
    costs = [row["engine/context_seconds"] for row in engine_run["metrics"]]
    generation = [row["engine/generation_seconds"] for row in engine_run["metrics"]]
    assert len(costs) == len(generation) == STEPS
    assert all(math.isfinite(cost) and cost >= 0 for cost in costs), costs
    assert all(math.isfinite(seconds) and seconds > 0 for seconds in generation), generation
    step = engine_run["train_seconds"] / STEPS
    print(f"engine context: {1e3 * sum(costs) / len(costs):.2f} ms per step (max {1e3 * max(costs):.2f}, "
          f"{100 * max(c / g for c, g in zip(costs, generation, strict=True)):.2f} % of its generation at most); "
          f"generation {sum(generation) / len(generation):.2f} s; step {step:.2f} s")


def test_report_shows_the_engine_context(engine_run, tmp_path):
    from rollout_guard.outputs.report import build_report

    page = build_report(engine_run["guard_dir"], tmp_path / "report.html").read_text()
    assert "Mismatch against the engine&#x27;s state per step" in page or "Mismatch against the engine's state per step" in page
    assert "Each rollout against its engine context" in page
    assert page.count("weights v") >= len(engine_run["records"])  # the engine column of the records table
    assert not math.isnan(sum(row["engine/kv_cache_usage_mean"] for row in engine_run["metrics"]))
    assert torch.is_tensor(engine_run["injected"][0])
