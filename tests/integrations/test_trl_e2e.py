"""End to end: real TRL GRPOTrainer, real vLLM (CPU build), tiny local model, corruption injected.

Each scenario runs in its own process (tests/integrations/grpo_scenario.py); these tests check what it saved.
Tests marked ``trl_range`` also run on the oldest supported TRL (``make test-trl-oldest``, in CI).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from rollout_guard.statistics import COLUMN
from rollout_guard.outputs.store import read_records
from rollout_guard.verdict import RULE_BIT
from tests.processes import launch, run_group

SCENARIO_SCRIPT = Path(__file__).with_name("grpo_scenario.py")


def run_scenario(name: str, tmp_path_factory, model_dir: Path, steps: int = 4, extra: tuple[str, ...] = (),
                 processes: int = 1, out: Path | None = None) -> tuple[dict, str]:
    out = out or tmp_path_factory.mktemp(name)
    log_path = out / "scenario.log"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(out), "TRACKIO_DIR": str(out / "trackio"), "WANDB_SILENT": "true"}
    if processes == 1:  # vLLM's colocated engine opens a torch.distributed store: never on a port another run holds
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            env["MASTER_PORT"] = str(sock.getsockname()[1])
    completed = launch(SCENARIO_SCRIPT, name, "--out", str(out), "--model", str(model_dir), "--steps", str(steps),
                       *extra, processes=processes, timeout=900, env=env, log=log_path)
    log_text = log_path.read_text()
    assert completed.returncode == 0, f"scenario {name} failed:\n{log_text[-6000:]}"
    if processes == 1:
        result = torch.load(out / "result.pt", weights_only=False)
    else:
        result = {"ranks": [torch.load(out / f"result-rank{rank}.pt", weights_only=False) for rank in range(processes)]}
    result["out"] = out
    return result, log_text


@pytest.fixture(scope="module")
def colocate(tmp_path_factory, tiny_model_dir):
    result, log = run_scenario("colocate", tmp_path_factory, tiny_model_dir)
    return {**result, "log": log}


def reference_advantages(rewards: torch.Tensor, group: int, excluded: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """Independent reference: per group, mean and Bessel std over the kept samples' rewards only."""
    out = torch.zeros(rewards.shape[0])
    total = rewards.nansum(dim=1)
    for start in range(0, len(total), group):
        kept = [i for i in range(start, start + group) if not excluded[i]]
        if len(kept) < 2:
            continue
        values = total[kept]
        mean, std = values.mean(), values.std()
        for i in kept:
            out[i] = (total[i] - mean) / (std + eps)
    return out


def check_quarantine_batches(result: dict) -> int:
    """The shared assertions of a quarantine-mode run; returns how many samples were injected."""
    group = result["num_generations"]
    injected_total = 0
    for step, (raw, guarded, rewards, injected, report) in enumerate(
        zip(result["raw"], result["guarded"], result["rewards"], result["injected"], result["reports"], strict=True)
    ):
        quarantined = report["quarantined"]
        injected_total += int(injected.sum())
        # every injected sample quarantined, no clean one
        assert torch.equal(quarantined, injected), f"step {step}: quarantined {quarantined.tolist()} vs injected {injected.tolist()}"
        # zero loss mask on quarantined rows; other rows untouched
        assert not guarded["completion_mask"][quarantined].any()
        assert torch.equal(guarded["completion_mask"][~quarantined], raw["completion_mask"][~quarantined])
        # TRL's own advantages equal the reference with nothing excluded (the reference is right) ...
        assert torch.allclose(raw["advantages"], reference_advantages(rewards, group, torch.zeros_like(quarantined)), atol=1e-5)
        # ... and the guarded advantages equal it with the quarantined samples left out of their groups
        assert torch.allclose(guarded["advantages"], reference_advantages(rewards, group, quarantined), atol=1e-5)
        assert (guarded["advantages"][quarantined] == 0).all()
        untouched_groups = ~quarantined.view(-1, group).any(dim=1).repeat_interleave(group)
        assert torch.equal(guarded["advantages"][untouched_groups], raw["advantages"][untouched_groups])
        # the loss normaliser counts exactly the loss tokens that remain
        assert int(guarded["num_items_in_batch"]) == int(guarded["completion_mask"].sum())
        assert int(raw["num_items_in_batch"]) == int(raw["completion_mask"].sum())
    return injected_total


@pytest.mark.trl_range
def test_colocate_quarantines_exactly_the_injected_samples(colocate):
    injected_total = check_quarantine_batches(colocate)
    assert injected_total >= 3, "the scenario must inject enough samples to mean something"
    assert colocate["summary"]["quarantined"] == injected_total
    assert colocate["summary"]["caught"] == injected_total and colocate["summary"]["false_alarms"] == 0


@pytest.mark.trl_range
def test_quarantined_rows_cannot_move_the_loss_for_any_trl_loss_type(colocate):
    invariance = colocate["loss_invariance"]
    assert invariance["quarantined_rows"] >= 1
    assert set(invariance["losses"]) == {"grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"}
    for loss_type, losses in invariance["losses"].items():
        assert losses["guarded"] != 0.0, f"{loss_type}: the kept samples must carry a loss for this to mean something"
        assert losses["guarded"] == losses["guarded_garbage"], loss_type
        assert losses["raw"] != losses["raw_garbage"], f"{loss_type}: the control did not move"


@pytest.mark.trl_range
def test_colocate_engine_stays_in_sync_with_the_trainer(colocate):
    """The CPU shim's weight sync keeps clean samples at fp32 agreement while the weights change (lr 5e-4)."""
    assert colocate["raw"][0]["advantages"].abs().sum() > 0
    assert any(float(row.get("grad_norm", 0) or 0) > 0 for row in colocate["log_history"])
    for report in colocate["reports"]:
        assert report["metrics"]["kept_max_abs_delta"] < 1e-3


@pytest.mark.trl_range
def test_colocate_logs_step_metrics_and_writes_evidence(colocate):
    guard_dir = Path(colocate["guard_dir"])
    lines = [json.loads(line) for line in (guard_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, len(colocate["reports"]) + 1))
    for line, report in zip(lines, colocate["reports"], strict=True):
        assert line["quarantined"] == report["metrics"]["quarantined"]
        assert line["max_abs_delta"] == pytest.approx(report["metrics"]["max_abs_delta"])
    # TRL's own metrics carry window means under a name of their own, never the per-step `rollout_guard/` names
    logged = [row for row in colocate["log_history"] if "rollout_guard_window_mean/max_abs_delta" in row]
    assert len(logged) == len(colocate["reports"])
    assert not any(key.startswith("rollout_guard/") for row in colocate["log_history"] for key in row)
    assert (guard_dir / "spikes.png").stat().st_size > 10_000
    records = list(read_records(guard_dir / "quarantine"))
    assert len(records) == colocate["summary"]["quarantined"]
    for record in records:
        assert record.injected is True and record.action == "quarantined" and record.rules
        assert record.prompt_text.endswith("=") and len(record.completion_ids) == len(record.engine_logprobs)
        engine_mean = sum(record.engine_logprobs) / len(record.engine_logprobs)
        trainer_mean = sum(record.trainer_logprobs) / len(record.trainer_logprobs)
        assert engine_mean - trainer_mean > 2.0  # the signature: the trainer finds the engine's tokens far less likely
        assert record.advantage_after == 0.0 and record.sampling["temperature"] == 1.0
        assert record.engine["name"] == "vllm" and record.engine["mode"] == "colocate"


def test_injection_in_a_single_group_batch_writes_real_text_from_another_prompt(tmp_path_factory, tiny_model_dir):
    """With TRL's default layout (one group per generation batch) the foreign context is a prompt of an earlier
    step, so a corrupted completion is real text, not a lone EOS (what the copy model answers to a reversed prompt)."""
    result, _ = run_scenario("single_group", tmp_path_factory, tiny_model_dir, steps=6)
    lengths = []
    for raw, injected, report in zip(result["raw"], result["injected"], result["reports"], strict=True):
        assert raw["completion_mask"].shape[0] == result["num_generations"], "one group per generation batch"
        lengths += raw["completion_mask"][injected].sum(dim=1).tolist()
        assert torch.equal(report["suspect"], injected)
    assert len(lengths) >= 4
    assert sum(length >= 3 for length in lengths) >= 0.75 * len(lengths), f"corrupted completion lengths {lengths}"


@pytest.mark.trl_range
@pytest.mark.parametrize("scenario", ["topk_high_entropy", "topk_high_entropy_offset"])
def test_processed_logprobs_of_a_high_entropy_top_k_policy_are_not_corruption(tmp_path_factory, tiny_model_dir, scenario):
    """top_k=5 on a barely trained policy, no corruption: the processed logprobs sit above the trainer's by about
    the log of the mass outside the top 5, on every token. By default the trainer's logprobs are compared on vLLM's
    top-5 support (the offset is gone: what is left is the engine's and the trainer's float32 noise); with
    ``compare_on_engine_support=False`` the offset stays and the detector's centres must absorb it."""
    from rollout_guard.testing.tiny_model import TinyModelRecipe, build_tiny_model

    model = build_tiny_model(tiny_model_dir.parent, TinyModelRecipe(train_steps=5))  # barely trained: high entropy
    result, log = run_scenario(scenario, tmp_path_factory, model, steps=4)
    assert len(result["reports"]) == 4 and "stopped training" not in log
    offsets = [report["metrics"]["mean_abs_delta"] for report in result["reports"]]
    if scenario == "topk_high_entropy":
        assert max(offsets) < 0.01, f"on the engine's support only numeric noise is left: {offsets}"
        assert "the guard compares the trainer's on the same support" in log
    else:
        assert min(offsets) > 0.5, f"the scenario must produce a real processed-logprob offset: {offsets}"
    for report in result["reports"]:
        assert not report["suspect"].any(), report["metrics"]
    if scenario == "topk_high_entropy_offset":  # the control: judged about a centre of 0, the offset is a lag
        centres = [report["metrics"][f"noise/centre_r{region}"] for report in result["reports"] for region in range(4)]
        assert max(centres) > 0.5, f"the detector's centres took the offset: {centres}"


@pytest.mark.trl_range
def test_a_plain_training_script_prints_alerts_and_a_summary(colocate):
    """The scenario configures no logging: the default sinks' ConsoleSink still shows alerts and the summary."""
    log, summary, guard_dir = colocate["log"], colocate["summary"], colocate["guard_dir"]
    assert f"rollout_guard: 4 steps, {summary['rollouts']} rollouts judged; {summary['quarantined']} quarantined" in log
    assert "rollout_guard: " in log and "of rollouts quarantined at step 1. " in log  # the alert, when it happened
    assert log.index("of rollouts quarantined at step 1") < log.index("rollouts judged")
    assert "  worst step: " in log and "score" in log.split("  rules fired: ")[1].splitlines()[0]
    assert f"  injected {summary['injected']}: caught {summary['caught']}, missed 0, false alarms 0" in log
    assert f"  report: rollout-guard report {guard_dir}" in log and f"{guard_dir}/quarantine" in log


def test_monitor_mode_reports_but_changes_nothing(tmp_path_factory, tiny_model_dir):
    """Monitor means monitor: 90 % of rollouts corrupted (above the circuit breaker's default share) and a replica of
    TRL's advantages that differs: both alert, nothing is changed, and training runs all its steps."""
    result, log = run_scenario("monitor", tmp_path_factory, tiny_model_dir)
    assert result["global_step"] == 4 and len(result["reports"]) == 4
    assert all(r["metrics"]["suspect_share"] > 0.5 for r in result["reports"][:1])
    alerts = [json.loads(line) for line in (Path(result["guard_dir"]) / "alerts.jsonl").read_text().splitlines()]
    assert {a["kind"] for a in alerts if a["level"] == "ERROR"} == {"circuit_breaker", "advantage_replica"}
    summary = json.loads((Path(result["guard_dir"]) / "summary.json").read_text())
    assert "stopped" not in summary and "would have stopped training at step 1" in summary["would_have_stopped"]
    assert "monitor mode: quarantine mode (on_ceiling='stop') would have stopped training at step 1" in log
    assert sum(int(i.sum()) for i in result["injected"]) >= 3
    for raw, guarded, injected, report in zip(result["raw"], result["guarded"], result["injected"], result["reports"], strict=True):
        assert torch.equal(report["suspect"], injected)
        assert not report["quarantined"].any()
        assert raw.keys() == guarded.keys()
        for key in raw:
            assert torch.equal(raw[key].nan_to_num(123.0), guarded[key].nan_to_num(123.0)), key
    records = list(read_records(Path(result["guard_dir"]) / "quarantine"))
    assert records and all(record.action == "monitored" for record in records)


@pytest.mark.trl_range
def test_without_importance_sampling_the_guard_computes_trainer_logprobs(tmp_path_factory, tiny_model_dir):
    result, log = run_scenario("no_is_correction", tmp_path_factory, tiny_model_dir)
    assert all("old_per_token_logps" not in raw for raw in result["raw"])
    assert check_quarantine_batches(result) >= 3
    assert log.count("extra no-grad forward pass") == 1


def test_truncated_rows_are_judged_and_flagged_ones_leave_the_baseline(tmp_path_factory, tiny_model_dir):
    """mask_truncated_completions=True, completions cut at 6 tokens: TRL zeroes the masks of the rollouts that never
    reach EOS (about half), yet their rewards set their groups' baselines. The guard judges them on their engine
    logprobs and its own trainer logprobs (TRL's were computed under a zero mask), quarantines the corrupted ones
    (baseline without them: the hand-computed reference) and keeps the clean ones; the loss normaliser still counts
    loss tokens only."""
    result, log = run_scenario("truncated", tmp_path_factory, tiny_model_dir)
    assert check_quarantine_batches(result) >= 3  # quarantined == injected, reference advantages, loss-token count
    injected_truncated = clean_truncated = 0
    for raw, guarded, injected, report, evidence in zip(result["raw"], result["guarded"], result["injected"],
                                                        result["reports"], result["evidence"], strict=True):
        truncated = raw["completion_mask"].sum(dim=1) == 0  # TRL masked them out
        injected_truncated += int((truncated & injected).sum())
        clean_truncated += int((truncated & ~injected).sum())
        # judged: every completion token of a truncated row (6 here) is in the judged mask, none in the loss mask
        assert (report["samples"][truncated, COLUMN["tokens"]] == 6).all()
        assert (evidence["mask"][truncated].sum(dim=1) == 6).all() and not guarded["completion_mask"][truncated].any()
        # TRL's logprobs of those rows are not theirs (1.16: exactly 0.0); the guard's pass matches the engine's on a
        # clean truncated row as closely as TRL's own logprobs do on a clean complete one
        clean = truncated & ~injected
        assert not torch.equal(raw["old_per_token_logps"][truncated], evidence["trainer"][truncated])
        delta = ((evidence["trainer"] - evidence["engine"]).abs() * evidence["mask"])[clean]
        assert delta.max() < 1e-3
        # the loss normaliser: TRL's count minus the loss tokens of quarantined complete rows only
        quarantined = report["quarantined"]
        kept_loss_tokens = int(raw["completion_mask"][~quarantined].sum())
        assert int(guarded["num_items_in_batch"]) == kept_loss_tokens
    assert injected_truncated >= 2 and clean_truncated >= 4, (injected_truncated, clean_truncated)
    passes = [p for p in result["truncated_passes"] if p]
    assert passes and all(p["rows"] <= 16 for p in passes)


CLEAN_NOISE = 0.5  # nats: bf16 engine vs fp32 re-scoring on clean Mamba2 rollouts (≤ 0.14 seen; audit test: ≤ 0.44)
# nats: a rollout whose engine logprobs differ from the re-scoring by more is strongly corrupted, and the detector
# promises to quarantine it: on this engine's healthy noise (≤ 0.5 nats) a 3-nat disagreement is many scales out
# (docs/detector.md, "Measured on real engines"). A new request that reads another's stale state is off from its
# first token.
STRONG = 3.0


@dataclass
class StaleStateTruth:
    """Per step, (B,) bool masks of the rollouts by their transformers re-scoring (independent of the guard).

    ``strong``: max |engine − re-scored| > :data:`STRONG`, corrupted beyond doubt; ``clean``: ≤ :data:`CLEAN_NOISE`,
    bf16 noise; ``grey``: in between. Real stale-state corruption produces grey rollouts as well as strong ones, and
    whether a run has any depends on the engine's scheduling and the CPU's kernels: the guard may keep or drop them.
    """

    strong: list[torch.Tensor]
    grey: list[torch.Tensor]
    clean: list[torch.Tensor]

    @classmethod
    def of(cls, result: dict) -> StaleStateTruth:
        rescored = result["rescored_max_delta"]
        return cls(strong=[r > STRONG for r in rescored], clean=[r <= CLEAN_NOISE for r in rescored],
                   grey=[(r > CLEAN_NOISE) & (r <= STRONG) for r in rescored])

    def count(self, masks: list[torch.Tensor], within: list[torch.Tensor] | None = None) -> int:
        within = within or [torch.ones_like(m) for m in masks]
        return int(sum(int((m & w).sum()) for m, w in zip(masks, within, strict=True)))


def check_stale_state_verdicts(result: dict, truth: StaleStateTruth, record_property) -> None:
    """What the guard promises on a real engine, per class of rollout: every strong one quarantined (its group's
    advantages those of the hand-computed reference without every quarantined row), no clean one quarantined, grey
    ones either way (counted, and reported as the test's properties); the summary and the loss normaliser agree."""
    group = result["num_generations"]
    quarantined = [report["quarantined"] for report in result["reports"]]
    for step, (guarded, rewards, dropped, strong, clean) in enumerate(zip(
            result["guarded"], result["rewards"], quarantined, truth.strong, truth.clean, strict=True)):
        assert not (strong & ~dropped).any(), f"step {step}: strong rows kept: {(strong & ~dropped).nonzero().flatten().tolist()}"
        assert not (clean & dropped).any(), f"step {step}: clean rows quarantined: {(clean & dropped).nonzero().flatten().tolist()}"
        assert not guarded["completion_mask"][dropped].any(), f"step {step}: quarantined rows left in the loss"
        assert torch.allclose(guarded["advantages"], reference_advantages(rewards, group, dropped), atol=1e-5)
        assert int(guarded["num_items_in_batch"]) == int(guarded["completion_mask"].sum())
    assert result["summary"]["quarantined"] == sum(int(q.sum()) for q in quarantined)
    grey, grey_quarantined = truth.count(truth.grey), truth.count(truth.grey, quarantined)
    record_property("grey_rollouts", grey)
    record_property("grey_rollouts_quarantined", grey_quarantined)
    print(f"rollouts: {truth.count(truth.strong)} strong, {grey} grey ({grey_quarantined} quarantined), "
          f"{truth.count(truth.clean)} clean")


def test_stale_state_fault_in_a_grpo_loop_is_quarantined_and_nothing_else(tmp_path_factory, mamba2_dir, record_property):
    """The engine-level fault of vLLM PR #32118 (a new 1-token request reads the Mamba state a finished request left
    in its recycled slot) inside TRL's colocate engine, a real GRPO loop, the guard attached in quarantine mode.
    Ground truth: every rollout re-scored with transformers. Every strongly corrupted rollout is quarantined, no
    clean one is, and the groups' advantages are those of the hand-computed reference without the quarantined rows;
    the detector scores every clean row."""
    result, log = run_scenario("stale_state", tmp_path_factory, mamba2_dir, steps=4)
    truth = StaleStateTruth.of(result)
    assert result["fault_stats"]["new_rows_run_as_decode"] > 0, result["fault_stats"]
    assert truth.count(truth.strong) >= 1, "the fault corrupted no rollout strongly: the test checks nothing"
    check_stale_state_verdicts(result, truth, record_property)
    for step, (report, clean) in enumerate(zip(result["reports"], truth.clean, strict=True)):
        scores = report["samples"][:, COLUMN["score"]]
        assert torch.isfinite(scores[clean]).all(), f"step {step}: a clean row not scored"


def test_stale_state_control_without_the_fault_quarantines_nothing(tmp_path_factory, mamba2_dir, record_property):
    """The same engine settings (token budget 8, 12 state slots) without the fault: no new request runs as a decode
    step, the rollouts agree with the re-scoring to bf16 noise (any that do not are counted as grey and may go
    either way), no clean rollout is quarantined, and the detector scored every rollout."""
    result, log = run_scenario("stale_state_control", tmp_path_factory, mamba2_dir, steps=2)
    truth = StaleStateTruth.of(result)
    assert result["fault_stats"]["new_rows_run_as_decode"] == 0
    assert truth.count(truth.strong) == 0, [r.max().item() for r in result["rescored_max_delta"]]
    check_stale_state_verdicts(result, truth, record_property)
    assert result["summary"]["rollouts"] == 96 and truth.count(truth.clean) > 0.9 * 96
    assert all(torch.isfinite(report["samples"][:, COLUMN["score"]]).all() for report in result["reports"])


def test_without_vllm_and_without_trl_logprobs_the_guard_runs_no_forward_pass_and_says_it_checks_nothing(
        tmp_path_factory, tiny_model_dir):
    """use_vllm=False, one generation per step: the rollouts come from the trainer's own model and TRL computes no
    logprobs before the loss. A forward pass would feed only the non-finite rule on the trainer's side, which the
    loss's own forward pass meets anyway: the guard runs none, says so once, and passes the batches through."""
    result, log = run_scenario("no_vllm", tmp_path_factory, tiny_model_dir)
    assert result["no_grad_forwards"] == []  # neither TRL nor the guard scored the rollouts before the loss
    assert log.count("use_vllm=False: the rollouts come from the trainer's own model") == 1
    assert "NON-FINITE VALUES ONLY" in log and "nothing to check and passes every batch through" in log
    assert result["reports"] == [] and result["global_step"] == 4
    assert result["summary"]["checks"] == "nothing (no logprobs; batches pass through)"
    assert "checks: nothing (no logprobs; batches pass through)" in log  # the end-of-training summary


@pytest.mark.parametrize("scenario, key, rule", [
    ("no_vllm_nan", "old_per_token_logps", "nonfinite_trainer"),
    ("engine_only", "sampling_per_token_logps", "nonfinite_engine"),
])
def test_single_sided_modes_catch_nan_without_an_extra_forward_pass(tmp_path_factory, tiny_model_dir, scenario, key, rule):
    """Trainer-only (use_vllm=False, TRL's own old logprobs) and engine-only (no IS correction,
    compute_trainer_logprobs=False): NaN and +inf are caught (rows 1 and 6, nothing else), no forward pass is added
    to TRL's own, and the attach line and the summary say these modes check non-finite values only."""
    result, log = run_scenario(scenario, tmp_path_factory, tiny_model_dir)
    reports = result["reports"]
    assert reports and result["global_step"] == 4
    generations = len(reports)
    for raw, guarded, report in zip(result["raw"], result["guarded"], reports, strict=True):
        assert not raw[key][[1, 6], 0].isfinite().any()
        written = torch.zeros_like(report["quarantined"])
        written[[1, 6]] = True
        assert torch.equal(report["quarantined"], written)
        assert (report["reasons"][written] & RULE_BIT[rule]).all()
        assert guarded[key].isfinite().all() and not guarded["completion_mask"][written].any()
    if scenario == "no_vllm_nan":  # TRL's one pass per generation for its old logprobs; the guard adds none
        assert "sampling_per_token_logps" not in result["raw"][0]
        assert result["no_grad_forwards"] == [32] * generations  # one call over the 32-row generation batch
        assert log.count("NON-FINITE VALUES ONLY") == 1
    else:  # no pass at all before the loss
        assert "old_per_token_logps" not in result["raw"][0]
        assert result["no_grad_forwards"] == []
        assert log.count("NON-FINITE engine logprobs ONLY") == 1
    assert "extra no-grad forward pass" not in log
    assert result["summary"]["checks"] == "non-finite values only"
    assert "checks: non-finite values only" in log


def test_without_weight_sync_the_engine_drifts(tmp_path_factory, tiny_model_dir):
    """Negative control for the CPU shim: with sync disabled and a large learning rate, engine and trainer
    disagree more and more (the measurement the sync test relies on can fail)."""
    result, _ = run_scenario("no_weight_sync", tmp_path_factory, tiny_model_dir)
    drift = [report["metrics"]["max_abs_delta"] for report in result["reports"]]
    assert drift[0] < 1e-3 and drift[-1] > 0.1, drift


@pytest.mark.trl_range
def test_server_mode_quarantines_exactly_the_injected_samples(tmp_path_factory, tiny_model_dir):
    """vllm_mode='server' against a real vLLM server process (CPU build). Only TRL's weight sync is bypassed (it
    needs CUDA/NCCL); learning_rate=0 keeps the served weights equal to the trainer's. See grpo_scenario.py."""
    result, _ = run_scenario("server", tmp_path_factory, tiny_model_dir)
    assert check_quarantine_batches(result) >= 3
    records = list(read_records(Path(result["guard_dir"]) / "quarantine"))
    assert records and all(record.engine["mode"] == "server" for record in records)
    # engine context in server mode: the server's /metrics once per step (per-step values; no per-request fields)
    rows = [json.loads(line) for line in (Path(result["guard_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [row["engine/weight_version"] for row in rows] == [row["step"] for row in rows]
    for row in rows:
        assert row["engine/generation_tokens"] > 0 and row["engine/requests_finished"] > 0, row
        assert row["engine/running_requests"] >= 0 and 0 <= row["engine/kv_cache_usage"] <= 1, row
        assert 0 <= row["engine/prefix_cache_hit_share"] <= 1, row
        assert math.isfinite(row["engine/scrape_seconds"]) and row["engine/scrape_seconds"] >= 0, row  # recorded, not raced
    for record in records:
        assert record.engine["rollout"]["weight_version"] == record.step
        assert record.engine["rollout"]["server_step"]["generation_tokens"] > 0
        assert record.engine["rollout"]["kv_cache_usage_max"] is None  # per-request fields: missing, not guessed
        assert record.engine["settings"]["block_size"] is not None  # from vllm:cache_config_info


def test_circuit_breaker_stops_training_cleanly_and_train_raises_with_the_reason(tmp_path_factory, tiny_model_dir):
    result, log = run_scenario("breaker", tmp_path_factory, tiny_model_dir)
    assert result["global_step"] == 1, "training must stop after the first step whose share is above the ceiling"
    assert len(result["reports"]) == 1 and result["reports"][0]["metrics"]["suspect_share"] > 0.5
    assert result["reports"][0]["metrics"]["over_ceiling"] == 1.0
    tripped = result["tripped"]  # CircuitBreakerTripped from trainer.train(): the reason, said there once
    assert tripped.startswith("rollout_guard stopped training") and "max_quarantine_share=0.5" in tripped
    assert "Training ended cleanly after step 1 of 4" in tripped
    assert "max_quarantine_share=0.5 for" not in log, "the log does not repeat the exception's reason"
    summary = json.loads((Path(result["guard_dir"]) / "summary.json").read_text())
    assert summary["stopped"].startswith("rollout_guard stopped training")
    alerts = [json.loads(line) for line in (Path(result["guard_dir"]) / "alerts.jsonl").read_text().splitlines()]
    assert [a["kind"] for a in alerts if a["level"] == "ERROR"] == ["circuit_breaker"]


def test_resume_restores_the_guard_state_from_the_checkpoint(tmp_path_factory, tiny_model_dir):
    first, _ = run_scenario("colocate", tmp_path_factory, tiny_model_dir, steps=4, extra=("--save-steps", "2"))
    checkpoint = first["out"] / "trainer" / "checkpoint-2"
    saved = json.loads((checkpoint / "rollout_guard_state.json").read_text())
    assert saved["totals"]["steps"] == 2 and [row["step"] for row in saved["totals"]["history"]] == [1, 2]
    assert (first["out"] / "trainer" / "checkpoint-4" / "rollout_guard_state.json").is_file()
    guard_dir = Path(first["guard_dir"])
    first_records = [(r.step, r.global_row) for r in read_records(guard_dir / "quarantine")]
    assert {step for step, _ in first_records} & {3, 4}, "the first run wrote records after the checkpoint"
    # resumed into the same folders, as a crashed job is restarted
    resumed, _ = run_scenario("colocate", tmp_path_factory, tiny_model_dir, steps=4, extra=("--resume-from", str(checkpoint)),
                              out=first["out"])
    assert resumed["guard_dir"] == first["guard_dir"]
    # one metrics line and one set of records per step: what the first run wrote after the checkpoint is replaced
    steps = [json.loads(line)["step"] for line in (guard_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    records = [(r.step, r.global_row) for r in read_records(guard_dir / "quarantine")]
    assert len(records) == len(set(records)) and [r for r in records if r[0] <= 2] == [r for r in first_records if r[0] <= 2]
    assert sum(1 for step, _ in records if step > 2) == sum(int(r["metrics"]["suspect"]) for r in resumed["reports"])
    state = resumed["guard_state"]
    assert [row["step"] for row in state["totals"]["history"]] == [1, 2, 3, 4]
    assert state["totals"]["history"][:2] == saved["totals"]["history"]
    assert state["totals"]["steps"] == 4 and state["totals"]["rollouts"] == 64
    assert len(resumed["reports"]) == 2, "the resumed run guards only steps 3 and 4"
    resumed_new = sum(int(r["metrics"]["quarantined"]) for r in resumed["reports"])
    assert state["totals"]["quarantined"] == saved["totals"]["quarantined"] + resumed_new
    # alert baselines and cooldowns survive the restart: the first run alerted at step 1; a fresh monitor would
    # alert again at step 3 (baseline 0), the restored one stays quiet within its cooldown
    assert first["reports"][0]["alerts"] and saved["alerts"]["last_alert_step"]
    assert state["alerts"]["last_alert_step"] == saved["alerts"]["last_alert_step"]
    assert all(not r["alerts"] for r in resumed["reports"])


def test_two_processes_agree_and_match_one_process_on_the_same_data(tmp_path_factory, tiny_model_dir):
    result, _ = run_scenario("colocate", tmp_path_factory, tiny_model_dir, steps=3, processes=2)
    rank0, rank1 = result["ranks"]
    assert (rank0["num_processes"], rank1["num_processes"]) == (2, 2)
    group = rank0["num_generations"]
    injected_total = 0
    for step in range(len(rank0["reports"])):
        r0, r1 = rank0["reports"][step], rank1["reports"][step]
        # both ranks log identical step metrics and reach the same global verdict; the engine's values (engine/*)
        # are each process's own engine (colocate mode: one engine per process), not the guard's step metrics
        ignored = ("guard_seconds", "overhead_seconds")
        same = {k: v for k, v in r0["metrics"].items() if k not in ignored and not k.startswith("engine/")}
        other = {k: v for k, v in r1["metrics"].items() if k not in ignored and not k.startswith("engine/")}
        assert same.keys() == other.keys() and all(v == other[k] or (math.isnan(v) and math.isnan(other[k])) for k, v in same.items())
        # weight syncs are collective: both engines have the same weight version; each maps its own rows
        assert r0["metrics"]["engine/weight_version"] == r1["metrics"]["engine/weight_version"] == step + 1
        assert r0["metrics"]["engine/unmapped_rows"] == r1["metrics"]["engine/unmapped_rows"] == 0
        assert torch.equal(r0["suspect"], r1["suspect"])
        injected = torch.cat([rank0["injected"][step], rank1["injected"][step]])
        injected_total += int(injected.sum())
        assert torch.equal(r0["quarantined"], injected)
        rows = len(rank0["injected"][step])
        rewards = rank0["rewards"][step]
        assert torch.equal(rewards, rank1["rewards"][step])
        expected = reference_advantages(rewards, group, injected)
        for rank, result_rank in enumerate((rank0, rank1)):
            guarded = result_rank["guarded"][step]
            local = injected[rank * rows : (rank + 1) * rows]
            assert not guarded["completion_mask"][local].any(), "excluded on the rank that holds them"
            assert torch.allclose(guarded["advantages"], expected[rank * rows : (rank + 1) * rows], atol=1e-5)
        total_tokens = sum(int(r["guarded"][step]["completion_mask"].sum()) for r in (rank0, rank1))
        assert int(rank0["guarded"][step]["num_items_in_batch"]) == int(rank1["guarded"][step]["num_items_in_batch"]) == total_tokens
        # a single process given the same data decides the same
        from rollout_guard import GuardConfig, RolloutEvidence, RolloutGuard

        width = max(r["raw"][step]["completion_mask"].shape[1] for r in (rank0, rank1))

        def padded(key: str) -> torch.Tensor:
            parts = [r["raw"][step][key] for r in (rank0, rank1)]
            return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])

        alone = RolloutGuard(GuardConfig(max_quarantine_share=0.95)).inspect(
            RolloutEvidence(mask=padded("completion_mask"), engine_logprobs=padded("sampling_per_token_logps"),
                            trainer_logprobs=padded("old_per_token_logps")), step=step + 1)
        assert torch.equal(alone.suspect, r0["suspect"])
        assert alone.metrics["max_abs_delta"] == pytest.approx(r0["metrics"]["max_abs_delta"])
        assert alone.metrics["tokens"] == r0["metrics"]["tokens"]
    assert injected_total >= 3


@pytest.mark.trl_range
def test_a_trl_whose_advantages_differ_from_the_replica_stops_at_the_first_step(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("replica_mismatch")
    done = run_group([sys.executable, str(SCENARIO_SCRIPT), "replica_mismatch", "--out", str(out), "--model", str(tiny_model_dir)],
                     timeout=900, capture_output=True, text=True)
    assert done.returncode != 0
    assert "TRL's advantages differ from rollout_guard's replica" in done.stderr and "at step 1 on process(es) [0]" in done.stderr
    assert f"installed trl {importlib.metadata.version('trl')}; rollout_guard supports trl 1.14–1.16" in done.stderr
    assert not (out / "result.pt").exists()


@pytest.fixture(scope="module")
def engine_nan(tmp_path_factory, tiny_model_dir):
    result, log = run_scenario("engine_nan", tmp_path_factory, tiny_model_dir, steps=3)
    return {**result, "log": log}


def test_a_nan_engine_logprob_that_trl_counts_as_a_match_is_still_quarantined(engine_nan):
    """vLLM reports a NaN logprob for the first token of rows 1 and 6: TRL's ratio and its sampling metrics treat
    it as a perfect match (finite, no sign of it), and the guard still quarantines exactly those rows for it."""
    for raw, report in zip(engine_nan["raw"], engine_nan["reports"], strict=True):
        assert torch.isnan(raw["sampling_per_token_logps"][[1, 6], 0]).all()
        assert torch.isfinite(raw["importance_sampling_ratio"][[1, 6]]).all(), "TRL's ratio hides the NaN"
        flagged = (report["reasons"] & RULE_BIT["nonfinite_engine"]) != 0
        assert torch.nonzero(flagged).flatten().tolist() == [1, 6]
        assert report["quarantined"][[1, 6]].all()
    differences = [row["sampling/sampling_logp_difference/max"] for row in engine_nan["log_history"]
                   if "sampling/sampling_logp_difference/max" in row]
    assert differences and all(math.isfinite(value) for value in differences)


def test_trls_correction_and_the_rewards_of_suspect_rows_are_step_metrics(engine_nan):
    """The trl_is/* metrics count the rows whose ratio TRL's sequence_mask zeroed (read from the ratio TRL put in
    its batch), and their overlap with the verdict; the reward/* metrics compare the suspect rows' rewards."""
    from rollout_guard.outcomes import reward_metrics

    both = 0
    for raw, report, rewards in zip(engine_nan["raw"], engine_nan["reports"], engine_nan["rewards"], strict=True):
        metrics, suspect = report["metrics"], report["suspect"]
        zeroed = raw["importance_sampling_ratio"].flatten() == 0
        assert metrics["trl_is/corrected_rows"] == int(zeroed.sum())
        assert metrics["trl_is/corrected_tokens"] == int(raw["completion_mask"][zeroed].sum())
        assert metrics["trl_is/both"] == int((zeroed & suspect).sum())
        assert metrics["trl_is/only_trl"] == int((zeroed & ~suspect).sum())
        assert metrics["trl_is/only_guard"] == int((~zeroed & suspect).sum())
        both += metrics["trl_is/both"]
        total = (rewards * engine_nan["reward_weights"]).nansum(dim=1)
        expected = reward_metrics(total, engine_nan["num_generations"], suspect)
        assert metrics["reward/suspect_mean"] == pytest.approx(expected["reward/suspect_mean"])
        assert metrics["reward/suspect_above_group_median"] == pytest.approx(
            expected["reward/suspect_above_group_median"], nan_ok=True)
    assert both > 0 and engine_nan["summary"]["steps"] == 3
    summary = engine_nan["log"]
    assert "TRL's importance-sampling correction zeroed or clipped" in summary and "reward: suspect rollouts" in summary
