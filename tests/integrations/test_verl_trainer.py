"""The guarded verl trainer's hook, driven as verl's v1 trainer drives it (``make test-verl``): verl's own config
(Hydra), a real Ray + TransferQueue holding the batch as verl's agent loop writes it, the guarded
``_compute_advantage`` next to verl's own."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed here: `make test-verl` runs these tests")

import ray  # noqa: E402
import transfer_queue as tq  # noqa: E402
import verl  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from transfer_queue import KVBatchMeta  # noqa: E402
from verl.trainer.ppo.v1 import PPOTrainerSync, get_trainer_cls  # noqa: E402
from verl.utils.tensordict_utils import list_of_dict_to_tensordict  # noqa: E402

from rollout_guard.errors import CircuitBreakerTripped, GuardConfigError  # noqa: E402

GROUP = 4
EPSILON = 1e-6


@pytest.fixture(scope="module", autouse=True)
def transfer_queue():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    yield
    tq.close()
    ray.shutdown()


def verl_config(tmp_path, *overrides: str):
    """verl's own ppo_trainer config (Hydra), GRPO with groups of GROUP, checkpoints under tmp_path."""
    folder = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=folder, version_base=None):
        return compose("ppo_trainer", overrides=[
            "algorithm.adv_estimator=grpo", f"actor_rollout_ref.rollout.n={GROUP}",
            f"trainer.default_local_dir={tmp_path / 'checkpoints'}", *overrides])


def guarded_trainer(tmp_path, *overrides: str):
    trainer = get_trainer_cls("guarded_sync")(verl_config(tmp_path, "trainer.v1.trainer_mode=guarded_sync", *overrides))
    trainer.global_steps = 1
    return trainer


def put_batch(partition: str, rows: list[dict], groups: int) -> KVBatchMeta:
    """Rows into the TransferQueue as verl's agent loop and old-logprob pass leave them: keys
    ``{uid}_{trajectory}_{output}``, jagged per-row tensors. Each row dict gives ``score``, ``engine`` and ``trainer``
    (per-token logprobs)."""
    keys, fields = [], []
    for index, row in enumerate(rows):
        group, trajectory = index // GROUP, index % GROUP
        length = len(row["engine"])
        scores = torch.zeros(length)
        scores[-1] = row["score"]
        keys.append(f"p{group}_{trajectory}_0")
        fields.append({
            "uid": f"p{group}", "prompts": torch.arange(3, dtype=torch.int64) + 10 * group,
            "responses": torch.arange(length, dtype=torch.int64) + 100,
            "response_mask": torch.ones(length, dtype=torch.int64),
            "rm_scores": scores, "rollout_log_probs": torch.tensor(row["engine"], dtype=torch.float32),
            "old_log_probs": torch.tensor(row["trainer"], dtype=torch.float32),
        })
    assert len(rows) == groups * GROUP
    tq.kv_batch_put(keys=keys, partition_id=partition, fields=list_of_dict_to_tensordict(fields))
    return KVBatchMeta(partition_id=partition, keys=keys, tags=[{} for _ in keys])


def clean_rows(groups: int, seed: int = 0, length: int = 12) -> list[dict]:
    """Healthy rows: the engine within ~0.02 nat of the trainer on every token, rewards 0 or 1."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for index in range(groups * GROUP):
        trainer = -torch.rand(length, generator=generator) * 3
        engine = trainer + 0.02 * torch.randn(length, generator=generator)
        rows.append({"score": float(index % 2), "engine": engine.tolist(), "trainer": trainer.tolist()})
    return rows


def corrupt(row: dict) -> dict:
    """Confident gibberish: from token 4 on the engine is sure (−0.01) of tokens the trainer gives −9 nats."""
    engine, trainer = list(row["engine"]), list(row["trainer"])
    for token in range(4, len(engine)):
        engine[token], trainer[token] = -0.01, -9.0
    return {**row, "engine": engine, "trainer": trainer}


def read(meta: KVBatchMeta, *fields: str) -> dict[str, torch.Tensor]:
    data = tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=list(fields))
    padded = data.to_padded_tensor()
    return {field: padded[field] for field in fields}


def first_token(values: torch.Tensor) -> torch.Tensor:
    return values[:, 0]


def test_installing_the_package_registers_the_trainers_once_verl_imports_its_v1_trainers():
    """The ``verl.plugins`` entry point, in a fresh process: ``import verl`` alone imports none of the adapter's
    trainers; importing verl's v1 trainers registers them."""
    import subprocess
    import sys

    code = ("import sys, verl; before = 'rollout_guard.integrations.verl.trainer' in sys.modules; "
            "from verl.trainer.ppo.v1 import get_trainer_cls; "
            "print(before, get_trainer_cls('guarded_sync').__module__)")
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300,
                            check=True)
    assert result.stdout.split()[-2:] == ["False", "rollout_guard.integrations.verl.trainer"]


def test_the_guarded_trainers_run_as_the_mode_they_guard(tmp_path):
    trainer = guarded_trainer(tmp_path)
    assert type(trainer).__name__ == "GuardedSyncTrainer" and isinstance(trainer, PPOTrainerSync)
    assert trainer.trainer_mode == "sync" and trainer.parameter_sync_step == 1
    colocated = get_trainer_cls("guarded_colocate_async")(
        verl_config(tmp_path, "trainer.v1.trainer_mode=guarded_colocate_async"))
    assert colocated.trainer_mode == "colocate_async" and type(colocated.replay_buffer).__name__ == "ReplayBufferAsync"
    assert get_trainer_cls("guarded_separate_async").base_mode == "separate_async"


def test_with_nothing_suspect_the_guarded_hook_writes_what_verls_own_writes(tmp_path):
    rows = clean_rows(groups=3)
    plain = PPOTrainerSync(verl_config(tmp_path, "trainer.v1.trainer_mode=sync"))
    plain.global_steps = 1
    verl_meta = put_batch("verl_clean", rows, groups=3)
    guarded_meta = put_batch("guarded_clean", rows, groups=3)
    plain._compute_advantage(verl_meta, {})
    metrics: dict = {}
    guarded_trainer(tmp_path)._compute_advantage(guarded_meta, metrics)
    expected, got = read(verl_meta, "advantages", "returns"), read(guarded_meta, "advantages", "returns")
    for key in ("advantages", "returns"):
        assert torch.equal(got[key], expected[key]), key
    assert metrics["rollout_guard/quarantined"] == 0 and metrics["rollout_guard/suspect"] == 0
    assert metrics["rollout_guard/guarded"] == 1


def test_a_corrupted_rollout_is_quarantined_before_the_advantages_and_leaves_its_group_baseline(tmp_path):
    rows = clean_rows(groups=3, seed=1)
    rows[5] = corrupt(rows[5])  # group 1, reward 1
    trainer = guarded_trainer(tmp_path)
    meta = put_batch("guarded_corrupt", rows, groups=3)
    metrics: dict = {}
    trainer._compute_advantage(meta, metrics)
    out = read(meta, "advantages", "response_mask")
    assert metrics["rollout_guard/quarantined"] == 1
    assert not out["response_mask"][5].any() and out["response_mask"][[4, 6, 7]].all()
    assert not out["advantages"][5].any()
    kept = torch.tensor([rows[row]["score"] for row in (4, 6, 7)])
    expected = (kept - kept.mean()) / (kept.std() + EPSILON)
    torch.testing.assert_close(first_token(out["advantages"])[[4, 6, 7]], expected, rtol=1e-5, atol=1e-5)
    # verl alone gives the siblings other advantages: the corrupted row's reward votes in its baseline
    plain = PPOTrainerSync(verl_config(tmp_path, "trainer.v1.trainer_mode=sync"))
    plain.global_steps = 1
    verl_meta = put_batch("verl_corrupt", rows, groups=3)
    plain._compute_advantage(verl_meta, {})
    assert not torch.allclose(first_token(read(verl_meta, "advantages")["advantages"])[[4, 6, 7]], expected)
    # the record, with its evidence, in the guard's store
    store = tmp_path / "checkpoints" / "rollout_guard"
    trainer.rollout_guard.close()
    lines = [json.loads(line) for path in store.rglob("*.jsonl") for line in path.read_text().splitlines()
             if '"completion_ids"' in line]
    assert [(line["global_row"], line["action"]) for line in lines] == [(5, "quarantined")]
    assert lines[0]["completion_ids"] == list(range(100, 112))
    assert lines[0]["engine_logprobs"][5] == pytest.approx(-0.01)
    assert lines[0]["advantage_after"] == 0.0 and lines[0]["advantage_before"] != 0.0
    assert lines[0]["stats"]["onset_token"] == 4.0 and "score" in lines[0]["rules"]
    assert lines[0]["explanation"].startswith("suspect: from token 4 (engine -0.01, trainer -9 nats)")


def test_monitor_mode_reports_the_rollout_and_changes_nothing(tmp_path):
    rows = clean_rows(groups=2, seed=2)
    rows[2] = corrupt(rows[2])
    trainer = guarded_trainer(tmp_path, "+rollout_guard.mode=monitor")
    plain = PPOTrainerSync(verl_config(tmp_path, "trainer.v1.trainer_mode=sync"))
    plain.global_steps = 1
    meta, verl_meta = put_batch("monitor", rows, groups=2), put_batch("monitor_verl", rows, groups=2)
    metrics: dict = {}
    trainer._compute_advantage(meta, metrics)
    plain._compute_advantage(verl_meta, {})
    assert metrics["rollout_guard/suspect"] == 1 and metrics["rollout_guard/quarantined"] == 0
    assert torch.equal(read(meta, "advantages")["advantages"], read(verl_meta, "advantages")["advantages"])


def rs_rejected_rows() -> list[dict]:
    """Healthy rows, one of which verl's seq_max_k2 veto at 0.02 rejects (0.5·Δ² = 0.08 on one token, the trainer
    0.4 nat above the engine) while the guard keeps it (a trainer-favouring 0.4 nat, inside the prior's noise)."""
    rows = clean_rows(groups=2, seed=3)
    trainer_lp = list(rows[1]["trainer"])
    trainer_lp[0] = rows[1]["engine"][0] + 0.4
    rows[1] = {**rows[1], "trainer": trainer_lp, "score": 50.0}
    return rows


RS = ("algorithm.rollout_correction.rollout_rs=seq_max_k2", "algorithm.rollout_correction.rollout_rs_threshold=0.02")


def test_rows_rejected_whole_by_verls_rollout_rs_leave_the_baseline_too(tmp_path):
    rows = rs_rejected_rows()
    trainer = guarded_trainer(tmp_path, *RS)
    meta = put_batch("rejected", rows, groups=2)
    metrics: dict = {}
    trainer._compute_advantage(meta, metrics)
    out = read(meta, "advantages", "response_mask")
    assert metrics["rollout_guard/quarantined"] == 0 and metrics["rollout_guard/rejected_by_verl"] == 1
    assert not out["response_mask"][1].any() and not out["advantages"][1].any()
    kept = torch.tensor([rows[row]["score"] for row in (0, 2, 3)])
    expected = (kept - kept.mean()) / (kept.std() + EPSILON)
    torch.testing.assert_close(first_token(out["advantages"])[[0, 2, 3]], expected, rtol=1e-5, atol=1e-5)


def test_monitor_mode_leaves_verls_own_baseline_as_it_is(tmp_path):
    rows = rs_rejected_rows()
    plain = PPOTrainerSync(verl_config(tmp_path, "trainer.v1.trainer_mode=sync", *RS))
    plain.global_steps = 1
    meta, verl_meta = put_batch("rejected_monitor", rows, groups=2), put_batch("rejected_verl", rows, groups=2)
    metrics: dict = {}
    guarded_trainer(tmp_path, *RS, "+rollout_guard.mode=monitor")._compute_advantage(meta, metrics)
    plain._compute_advantage(verl_meta, {})
    assert metrics["rollout_guard/rejected_by_verl"] == 1
    assert torch.equal(read(meta, "advantages")["advantages"], read(verl_meta, "advantages")["advantages"])


def test_bypass_mode_checks_the_engine_alone_and_says_so(tmp_path, caplog):
    rows = clean_rows(groups=2, seed=4)
    rows[3] = {**rows[3], "engine": [math.nan] + rows[3]["engine"][1:]}
    rows[6] = corrupt(rows[6])  # engine against trainer: not judged in bypass mode
    for row in rows:
        row["trainer"] = row["engine"]  # verl copies the engine's logprobs into old_log_probs
    with caplog.at_level("WARNING", logger="rollout_guard"):
        trainer = guarded_trainer(tmp_path, "algorithm.rollout_correction.bypass_mode=true")
    assert "NaN/±inf only" in caplog.text
    meta = put_batch("bypass", rows, groups=2)
    metrics: dict = {}
    trainer._compute_advantage(meta, metrics)
    out = read(meta, "response_mask", "old_log_probs", "rollout_log_probs")
    assert metrics["rollout_guard/quarantined"] == 1 and not out["response_mask"][3].any()
    assert torch.isfinite(out["old_log_probs"]).all() and torch.isfinite(out["rollout_log_probs"]).all()


def test_a_burst_over_the_ceiling_stops_before_the_actor_update(tmp_path):
    rows = [corrupt(row) if index % GROUP != 0 else row for index, row in enumerate(clean_rows(groups=2, seed=5))]
    trainer = guarded_trainer(tmp_path)
    with pytest.raises(CircuitBreakerTripped, match="before updating the actor"):
        trainer._compute_advantage(put_batch("burst", rows, groups=2), {})
    assert (tmp_path / "checkpoints" / "rollout_guard" / "summary.json").is_file()


@pytest.mark.parametrize(("override", "field"), [("+rollout_guard.mod=monitor", "mod"),
                                                 ("+rollout_guard.mode=quarantin", "mode"),
                                                 ("+rollout_guard.false_alarm_budget=2", "false_alarm_budget")])
def test_a_bad_guard_setting_fails_in_one_line_before_verl_builds_anything(tmp_path, override, field):
    with pytest.raises(GuardConfigError, match=f"GuardConfig.{field}=") as caught:
        guarded_trainer(tmp_path, override)
    assert "\n" not in str(caught.value)


def test_the_guards_state_survives_a_checkpoint(tmp_path):
    rows = clean_rows(groups=2, seed=6)
    rows[1] = corrupt(rows[1])
    trainer = guarded_trainer(tmp_path)
    trainer._compute_advantage(put_batch("state", rows, groups=2), {})
    folder = tmp_path / "checkpoints" / "global_step_1"
    folder.mkdir(parents=True)
    trainer.rollout_guard.save(folder, 1)
    resumed = guarded_trainer(tmp_path)
    assert resumed.rollout_guard.resume(folder)
    assert resumed.rollout_guard.guard.totals.quarantined == 1
    assert resumed.rollout_guard.guard.state_dict() == trainer.rollout_guard.guard.state_dict()


def test_the_example_launch_script_composes_with_verls_config_and_selects_the_guard(tmp_path, monkeypatch):
    """examples/verl_grpo/run_grpo_guarded.sh: every override names a key of verl's config, and its guard settings
    are valid (the script itself needs GPUs and a vLLM server)."""
    import shlex
    from pathlib import Path

    from rollout_guard.integrations.verl import VerlGuard

    script = (Path(__file__).resolve().parents[2] / "examples" / "verl_grpo" / "run_grpo_guarded.sh").read_text()
    command = script[script.index("python3 -m verl.trainer.main_ppo"):script.index('"$@"')].replace("\\\n", " ")
    monkeypatch.setenv("DATA", str(tmp_path))
    monkeypatch.setenv("MODEL", "model")
    overrides = [os.path.expandvars(word) for word in shlex.split(command)[3:]]
    config = verl_config(tmp_path, *overrides)
    assert config.trainer.v1.trainer_mode == "guarded_sync" and get_trainer_cls("guarded_sync")
    assert VerlGuard(config).config.max_quarantine_share == 0.5
