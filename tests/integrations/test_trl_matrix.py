"""TRL's settings checked against TRL itself: real GRPOTrainer runs of tests/integrations/trl_matrix.py.

With nothing excluded, the guard's replica must reproduce the advantages TRL computed, in every setting; with
quarantined rows, the loss and gradient TRL computes from the guarded batch must equal those of the batch without
those rows, for every loss type, even when those rows hold NaN or ±inf.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rollout_guard.action import group_relative_advantages
from rollout_guard.outputs.store import read_records
from tests.processes import launch

SCRIPT = Path(__file__).with_name("trl_matrix.py")


def run_matrix(name: str, out: Path, model_dir: Path, steps: int, processes: int = 1) -> tuple[int, str]:
    done = launch(SCRIPT, name, "--out", str(out), "--model", str(model_dir), "--steps", str(steps),
                  processes=processes, timeout=900, env={"TRL_EXPERIMENTAL_SILENCE": "1"}, log=out / "run.log")
    return done.returncode, (out / "run.log").read_text()


def load(out: Path, name: str = "result.pt") -> dict:
    return torch.load(out / name, weights_only=False)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, tiny_model_dir):
    """Transformers rollouts need no engine process: this one runs here (saves a Python start and the imports)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("trl_matrix", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path_factory.mktemp("matrix")
    script.run("matrix", out, str(tiny_model_dir), steps=8)
    return load(out)


@pytest.fixture(scope="module")
def nonfinite(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("loss")
    code, log = run_matrix("loss", out, tiny_model_dir, steps=2)
    assert code == 0, log[-6000:]
    return load(out)


def replica(result: dict, step: int, excluded: torch.Tensor | None = None) -> torch.Tensor:
    scale, aggregation = result["settings"][step]
    return group_relative_advantages(result["rewards"][step], result["reward_weights"], result["num_generations"], excluded=excluded,
                                     scale_rewards=scale, aggregation=aggregation)


def loss_mask(batch: dict) -> torch.Tensor:
    return batch["completion_mask"] * batch["tool_mask"] if "tool_mask" in batch else batch["completion_mask"]


def test_the_replica_reproduces_trl_in_every_advantage_setting(matrix):
    assert matrix["error"] is None
    assert sorted(set(matrix["settings"])) == sorted({("group", "sum_then_normalize"), ("batch", "sum_then_normalize"),
                                                      ("none", "sum_then_normalize"), ("group", "normalize_then_sum")})
    assert len(matrix["raw"]) == 4, "steps_per_generation=4 with gradient_accumulation_steps=2: one generation per 2 steps"
    rewards = torch.cat(matrix["rewards"])
    assert rewards.shape[1] == 2 and rewards.isnan().any() and rewards.isnan().all(dim=1).any(), "None rewards, some rows all None"
    for step, raw in enumerate(matrix["raw"]):
        assert {"old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps", "tool_mask"} <= raw.keys()
        assert (raw["tool_mask"][:, :2] == 0).all()
        # TRL's own advantages, with nothing excluded: the guard's arithmetic reproduces them
        assert torch.allclose(replica(matrix, step), raw["advantages"], atol=1e-6, rtol=1e-6), matrix["settings"][step]
        assert matrix["reports"][step]["check_failed_on"] == []
        assert raw["advantages"].abs().sum() > 0, "a setting with all-zero advantages would prove nothing"
    truncated = torch.cat([raw["completion_mask"].sum(1) == 0 for raw in matrix["raw"]])
    assert truncated.any(), "mask_truncated_completions must have masked some rollouts"


def test_quarantine_with_tool_masks_truncation_and_none_rewards(matrix):
    quarantined_total = truncated_quarantined = 0
    for step, (raw, guarded, injected, report) in enumerate(
        zip(matrix["raw"], matrix["guarded"], matrix["injected"], matrix["reports"], strict=True)
    ):
        quarantined = report["quarantined"]
        # truncated rollouts (TRL zeroed their masks) are judged too, tool tokens left out: all injected ones caught
        assert torch.equal(quarantined, injected), step
        truncated_quarantined += int((quarantined & (raw["completion_mask"].sum(1) == 0)).sum())
        quarantined_total += int(quarantined.sum())
        assert not guarded["completion_mask"][quarantined].any()
        assert torch.allclose(guarded["advantages"], replica(matrix, step, excluded=quarantined), atol=1e-6)
        assert int(guarded["num_items_in_batch"]) == int(loss_mask(guarded).sum())
    assert quarantined_total >= 4 and truncated_quarantined >= 1, (quarantined_total, truncated_quarantined)


def test_records_store_none_rewards_and_locate_the_onset_token_despite_tool_masks(matrix):
    """A record's onset token indexes its own token lists (the loss-mask tokens, tool tokens left out): the engine
    and trainer logprobs there are the ones the guard read at the onset."""
    records = list(read_records(Path(matrix["guard_dir"]) / "quarantine"))
    assert len(records) == sum(int(r["metrics"]["suspect"]) for r in matrix["reports"]) > 0
    assert any(r.reward is None or None in r.rewards_per_func.values() for r in records), "a record with a None reward"
    located = 0
    for record in records:
        onset = int(record.stats["onset_token"])
        if onset < 0 or not record.full_evidence:
            continue
        assert onset < len(record.completion_ids), (record.step, record.global_row)
        assert record.engine_logprobs[onset] == pytest.approx(record.stats["onset_engine_logprob"], abs=1e-4)
        assert record.trainer_logprobs[onset] == pytest.approx(record.stats["onset_trainer_logprob"], abs=1e-4)
        assert record.explanation.startswith("suspect: from token ")
        located += 1
    assert located > 0


@pytest.mark.parametrize("fixture", ["matrix", "nonfinite"])
def test_guarded_loss_and_gradient_equal_those_without_the_quarantined_rows(fixture, request):
    result = request.getfixturevalue(fixture)
    losses = result["losses"]
    assert set(losses) == {"grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"}
    for loss_type, values in losses.items():
        gradient, reference = values["gradient"], values["reference_gradient"]
        assert math.isfinite(values["loss"]) and gradient.isfinite().all(), loss_type
        assert values["loss"] == pytest.approx(values["reference_loss"], rel=1e-5, abs=1e-7), loss_type
        assert torch.allclose(gradient, reference, rtol=1e-4, atol=1e-6 * float(reference.abs().max())), loss_type
        assert gradient.abs().sum() > 0, f"{loss_type}: the kept rows must carry a gradient for this to mean something"


def test_nan_and_inf_in_quarantined_rows_never_reach_the_loss(nonfinite):
    """Trainer, engine and reference logprobs NaN/±inf and an infinite IS ratio, beta > 0, vLLM colocate."""
    assert nonfinite["error"] is None
    step = nonfinite["loss_step"]
    written, report = nonfinite["written"][step], nonfinite["reports"][step]
    assert written.sum() == 4 and report["quarantined"][written].all()
    raw, guarded = nonfinite["raw"][step], nonfinite["guarded"][step]
    assert not raw["old_per_token_logps"][written].isfinite().all() and not raw["ref_per_token_logps"][written].isfinite().all()
    for key in ("old_per_token_logps", "sampling_per_token_logps", "ref_per_token_logps", "importance_sampling_ratio"):
        assert guarded[key].isfinite().all(), key
    for loss_type, values in nonfinite["losses"].items():  # the control: TRL's batch as built is poisoned
        assert not math.isfinite(values["raw_loss"]) or not values["raw_gradient_finite"], loss_type


def test_groups_spanning_processes_and_failures_on_one_process(tmp_path, tiny_model_dir):
    """Two processes, 6 rows each, groups of 4 (the middle group spans both). Step 3: one process loses the reward
    matrix, so it cannot act: every process skips the step. Step 4: one process's replica differs from TRL: every
    process raises at that step (none trains on alone, none waits for the other)."""
    code, log = run_matrix("span", tmp_path, tiny_model_dir, steps=4, processes=2)
    ranks = [load(tmp_path, f"result-rank{rank}.pt") for rank in range(2)]
    assert code != 0 and all("TRL's advantages differ" in (r["error"] or "") and "at step 4 on process(es) [1]" in r["error"]
                             for r in ranks), log[-4000:]
    assert ranks[1]["faults"] == {"rewards": 3, "replica": 4}
    assert [r["steps"] for r in ranks] == [[1, 2, 3], [1, 2, 3]]
    group = ranks[0]["num_generations"]
    for step in range(3):
        reports = [r["reports"][step] for r in ranks]
        assert torch.equal(reports[0]["suspect"], reports[1]["suspect"])
        injected = torch.cat([r["injected"][step] for r in ranks])
        rewards = ranks[0]["rewards"][step]
        if step < 2:
            assert torch.equal(reports[0]["quarantined"], injected)
            expected = group_relative_advantages(rewards, ranks[0]["reward_weights"], group, excluded=injected)
            for rank, result in enumerate(ranks):
                assert torch.allclose(result["guarded"][step]["advantages"], expected[rank * 6 : (rank + 1) * 6], atol=1e-6)
                assert torch.allclose(result["raw"][step]["advantages"],
                                      group_relative_advantages(rewards, ranks[0]["reward_weights"], group)[rank * 6 : (rank + 1) * 6], atol=1e-6)
        else:  # the step one process could not act on: skipped everywhere, nobody quarantines alone
            assert injected.any(), "the skipped step must have had something to quarantine"
            assert [r["skipped"] for r in reports] == [True, True]
            for result in ranks:
                for key, value in result["raw"][step].items():
                    assert torch.equal(value.nan_to_num(7.0), result["guarded"][step][key].nan_to_num(7.0)), key
        normalisers = {int(r["guarded"][step]["num_items_in_batch"]) for r in ranks}
        assert normalisers == {sum(int(loss_mask(r["guarded"][step]).sum()) for r in ranks)}
    assert sum(int(torch.cat([r["injected"][s] for r in ranks]).sum()) for s in range(2)) >= 2
