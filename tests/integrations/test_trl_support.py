"""The trainer's log-mass of the engine's support, captured in the pass that computes its logprobs (real TRL
GRPOTrainer, tiny local model, transformers rollouts; no vLLM)."""

from __future__ import annotations

import pytest
import torch

from tests.integrations.test_trl_attach import make_trainer

pytestmark = pytest.mark.trl_range  # also on the oldest supported TRL (1.14: full logits, no fused LM head)


@pytest.fixture(scope="module")
def high_entropy_model(tiny_model_dir):
    from rollout_guard.testing.tiny_model import TinyModelRecipe, build_tiny_model

    return build_tiny_model(tiny_model_dir.parent, TinyModelRecipe(train_steps=5))  # barely trained: flat


@pytest.mark.parametrize("settings", [(5, 1.0, 0.0), (0, 0.8, 0.0), (5, 0.9, 0.05)])
def test_captured_mass_is_the_full_logits_mass_at_each_completion_token(high_entropy_model, tmp_path, settings):
    """Through TRL's own scoring call (its fused LM head never makes the logits): the hook's log Z per completion
    token equals the one from the full logits of an ordinary forward, position by position."""
    from rollout_guard.integrations.trl.support import SupportCapture
    from rollout_guard.support import kept_log_mass

    top_k, top_p, min_p = settings
    trainer = make_trainer(high_entropy_model, tmp_path, top_k=top_k, top_p=top_p, min_p=min_p or None, temperature=0.7)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 30, (6, 14), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded prompt
    width = 9
    capture = SupportCapture(trainer, settings)
    with torch.no_grad(), capture.active():
        logprobs, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width, batch_size=4)
    assert len(capture.calls) == 1 and capture.calls[0].shape == logprobs.shape == (6, width)
    assert "_get_per_token_logps_and_entropies" not in vars(trainer), "the instance is left as it was"
    with torch.no_grad():
        logits = trainer.model(input_ids=ids, attention_mask=mask).logits[:, -width - 1 : -1].float() / 0.7
    expected = kept_log_mass(logits, top_k=top_k, top_p=top_p, min_p=min_p)
    assert float(expected.max()) < -0.05, "the setting must cut real mass for the check to mean something"
    torch.testing.assert_close(capture.calls[0], expected, atol=1e-4, rtol=0)
    shifted = kept_log_mass(trainer.model(input_ids=ids, attention_mask=mask).logits[:, -width:].float() / 0.7,
                            top_k=top_k, top_p=top_p, min_p=min_p)
    assert not torch.allclose(capture.calls[0], shifted, atol=1e-2), "control: one position off is told apart"


def test_a_token_whose_recomputed_logprob_disagrees_keeps_log_z_zero(high_entropy_model, tmp_path, monkeypatch):
    """A logit transform the module does not know (here: a wrong scale) must not bend the comparison: those
    tokens keep log Z = 0, as without the option."""
    import rollout_guard.integrations.trl.support as support

    trainer = make_trainer(high_entropy_model, tmp_path, top_k=5)
    monkeypatch.setattr(support, "logit_transform", lambda config: (3.0, None))
    capture = support.SupportCapture(trainer, (5, 1.0, 0.0))
    ids = torch.randint(3, 30, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), capture.active():
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids), 6)
    assert float((capture.calls[0] == 0).float().mean()) > 0.9


def test_settings_that_change_the_logits_fall_back_to_the_detector_centres(high_entropy_model, tmp_path):
    from rollout_guard.integrations.trl.support import support_settings

    assert support_settings(make_trainer(high_entropy_model, tmp_path / "a", top_k=5, top_p=0.9)) == (5, 0.9, 0.0)
    assert support_settings(make_trainer(high_entropy_model, tmp_path / "b")) is None  # nothing cut
    assert support_settings(make_trainer(high_entropy_model, tmp_path / "c", top_k=5, repetition_penalty=1.1)) is None
    assert support_settings(make_trainer(high_entropy_model, tmp_path / "d", top_p=0.9)) is None  # a sort per token
    penalised = make_trainer(high_entropy_model, tmp_path / "f", top_k=5, generation_kwargs={"presence_penalty": 1.0})
    assert support_settings(penalised) is None  # an additive penalty of 1.0 changes the engine's logits
    assert support_settings(make_trainer(high_entropy_model, tmp_path / "e", min_p=0.05)) == (0, 1.0, 0.05)


@pytest.mark.parametrize("compare", [True, False])
def test_a_top_k_step_is_judged_on_the_engine_support(high_entropy_model, tmp_path, compare):
    """One GRPO step of a barely trained policy sampled with top_k = 5: on the engine's support
    the clean samples' |Δ| is the fp32 noise of two computations of the same model; without it, the log of the
    mass outside the top 5, ≈ 1 nat on every token."""
    from rollout_guard import GuardConfig
    from rollout_guard.integrations.trl import attach_guard

    trainer = make_trainer(high_entropy_model, tmp_path / "trainer", top_k=5)
    guarded = attach_guard(trainer, GuardConfig(compare_on_engine_support=compare, output_dir=str(tmp_path / "guard")),
                           keep_steps=True)
    assert (guarded.support is not None) is compare
    trainer.train()
    evidence = guarded.steps[0].evidence
    mask = evidence["mask"].bool()
    delta = (evidence["engine"] - evidence["trainer"])[mask].abs()
    if compare:
        assert float(delta.max()) < 1e-3, float(delta.max())
    else:
        assert float(delta.mean()) > 0.5, float(delta.mean())
    assert not guarded.steps[0].report.suspect.any()


def test_a_failing_hook_never_stops_training(high_entropy_model, tmp_path, monkeypatch):
    """A model whose LM head the hook cannot call: the step it fails in is not judged (a failure, counted and
    reported), and from the next the guard compares off the support, the offset left to the detector's centres."""
    import rollout_guard.integrations.trl.support as support
    from rollout_guard import GuardConfig
    from rollout_guard.integrations.trl import attach_guard

    def broken(*args, **kwargs):
        raise RuntimeError("an LM head the hook cannot call")

    monkeypatch.setattr(support, "token_log_mass", broken)
    trainer = make_trainer(high_entropy_model, tmp_path / "trainer", top_k=5, max_steps=2)
    guarded = attach_guard(trainer, GuardConfig(output_dir=str(tmp_path / "guard")), keep_steps=True)
    trainer.train()
    assert len(guarded.steps) == 2 and guarded.support is None
    assert guarded.steps[0].report.skipped and not guarded.steps[1].report.skipped
    assert guarded.guard.totals.failures == 1
    assert guarded.guard.noise_resets == 1  # the noise learned on the support is forgotten
    evidence = guarded.steps[1].evidence
    assert float((evidence["engine"] - evidence["trainer"])[evidence["mask"].bool()].abs().mean()) > 0.5  # uncorrected
    assert not guarded.steps[1].report.suspect.any()


STEPS, FAIL = 12, 8  # the hook fails from step FAIL of STEPS


def test_a_hook_that_fails_mid_run_leaves_no_healthy_row_flagged(high_entropy_model, tmp_path, monkeypatch):
    """The hook fails at step 8, after seven steps in which the detector learned its noise on the support (top_k
    = 5, a flat policy: off the support the offset is ≈ 1.3 nats on every token). That step passes unjudged and the
    detector's noise starts over off the support: no healthy row is flagged before, at or after the switch."""
    import rollout_guard.integrations.trl.support as support
    from rollout_guard import GuardConfig
    from rollout_guard.integrations.trl import attach_guard

    trainer = make_trainer(high_entropy_model, tmp_path / "trainer", top_k=5, max_steps=STEPS,
                           per_device_train_batch_size=256, num_generations=16)
    working = support.token_log_mass

    def failing_from_step_fail(*args, **kwargs):
        if trainer.state.global_step >= FAIL - 1:  # scoring the rollouts of step FAIL
            raise RuntimeError("out of memory in the LM-head projection")
        return working(*args, **kwargs)

    monkeypatch.setattr(support, "token_log_mass", failing_from_step_fail)
    guarded = attach_guard(trainer, GuardConfig(output_dir=str(tmp_path / "guard")), keep_steps=True)
    trainer.train()
    assert guarded.stop_reason is None and len(guarded.steps) == STEPS
    before = guarded.steps[FAIL - 2].report.metrics
    assert max(abs(before[f"noise/centre_r{region}"]) for region in range(4)) < 0.05, "centres set on the support"
    assert [step.report.skipped for step in guarded.steps] == [i == FAIL - 1 for i in range(STEPS)]
    assert guarded.guard.totals.failures == 1 and guarded.support is None and guarded.guard.noise_resets == 1
    delta = [float((s.evidence["engine"] - s.evidence["trainer"])[s.evidence["mask"].bool()].abs().mean())
             for s in guarded.steps if not s.report.skipped]
    assert max(delta[:FAIL - 1]) < 1e-3 < 0.5 < min(delta[FAIL - 1:]), delta  # on the support, then off it
    flagged = [int(step.report.suspect.sum()) for step in guarded.steps]
    assert not any(flagged), flagged


def test_a_run_resumed_on_another_basis_starts_its_noise_over(high_entropy_model, tmp_path, monkeypatch):
    """A run whose hook failed is saved with its noise learned off the support; resumed with a working hook it
    compares on the support again, d ≈ 1.3 nats lower on every token, so the restored noise (centred on the offset)
    no longer holds: the basis is saved with the sampling settings and the noise starts over at the first step, as
    at a change of setting, and no healthy row is flagged."""
    import rollout_guard.integrations.trl.support as support
    from rollout_guard import GuardConfig
    from rollout_guard.integrations.trl import attach_guard

    settings = dict(top_k=5, per_device_train_batch_size=256, num_generations=16)
    first = make_trainer(high_entropy_model, tmp_path / "first", max_steps=12, **settings)
    working = support.token_log_mass

    def failing_from_step_2(*args, **kwargs):
        if first.state.global_step >= 1:
            raise RuntimeError("out of memory in the LM-head projection")
        return working(*args, **kwargs)

    monkeypatch.setattr(support, "token_log_mass", failing_from_step_2)
    guarded = attach_guard(first, GuardConfig(output_dir=str(tmp_path / "guard")), keep_steps=True)
    first.train()
    assert guarded.support is None and guarded.guard.noise_resets == 1
    centres = [guarded.steps[-1].report.metrics[f"noise/centre_r{region}"] for region in range(4)]
    assert max(centres) > 0.5, f"the offset learned off the support: {centres}"
    (tmp_path / "checkpoint").mkdir()
    guarded.save_state(tmp_path / "checkpoint")
    monkeypatch.setattr(support, "token_log_mass", working)
    second = make_trainer(high_entropy_model, tmp_path / "second", max_steps=3, **settings)
    resumed = attach_guard(second, GuardConfig(output_dir=str(tmp_path / "guard2")), keep_steps=True)
    assert resumed.load_state(tmp_path / "checkpoint") and resumed.guard.noise_resets == 1
    second.train()
    assert resumed.support is not None and resumed.guard.noise_resets == 2
    evidence = resumed.steps[0].evidence
    assert float((evidence["engine"] - evidence["trainer"])[evidence["mask"].bool()].abs().max()) < 1e-3
    flagged = [int(step.report.suspect.sum()) for step in resumed.steps]
    assert not any(flagged), flagged


def test_a_hook_that_fails_on_one_process_changes_every_process_alike(high_entropy_model, tmp_path):
    """Two CPU processes (gloo); the hook fails from step 4 on rank 1 only. The flag travels in the step's one
    gather, so both ranks skip that step, stop comparing on the support and start the detector's noise over
    together: the same metrics, verdicts and guard state on both, and no healthy row flagged."""
    from pathlib import Path

    from tests.integrations.support_failure import FAIL, STEPS
    from tests.processes import launch

    done = launch(Path(__file__).with_name("support_failure.py"), high_entropy_model, tmp_path, processes=2,
                  env={"TRL_EXPERIMENTAL_SILENCE": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    for result in ranks:
        assert [step["skipped"] for step in result["steps"]] == [i == FAIL - 1 for i in range(STEPS)]
        assert result["steps"][FAIL - 1]["check_flags"] == [0, 2]
        assert result["failures"] == 1 and not result["support"]
        assert result["resets"] == 1
        assert not any(step["suspect"].any() for step in result["steps"])
    for mine, theirs in zip(*(result["steps"] for result in ranks), strict=True):
        assert mine["metrics"].keys() == theirs["metrics"].keys()
        assert all(a == b or (a != a and b != b) for a, b in zip(mine["metrics"].values(), theirs["metrics"].values(),
                                                                 strict=True)), (mine["metrics"], theirs["metrics"])
        assert torch.equal(mine["suspect"], theirs["suspect"])
    for result in ranks:  # the guard's state but each step's timing
        for row in result["state"]["totals"]["history"]:
            row.pop("guard_seconds")
    assert repr(ranks[0]["state"]) == repr(ranks[1]["state"])
    after = ranks[0]["steps"][FAIL]["evidence"]  # rank 0, the step after: off the support as on rank 1
    assert float((after["engine"] - after["trainer"])[after["mask"].bool()].abs().mean()) > 0.5


def test_a_hybrid_model_with_a_logit_multiplier_is_captured_exactly(tiny_model_dir, tmp_path):
    """FalconH1 (attention ∥ Mamba2, the AI21 case) multiplies its logits by ``lm_head_multiplier``: read as TRL's
    fused head reads it, the captured log Z matches the model's own full logits, and no token falls back."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_guard.testing.tiny_model import TinyModelRecipe, build_tiny_model
    from rollout_guard.integrations.trl.support import SupportCapture
    from rollout_guard.support import kept_log_mass

    source = build_tiny_model(tiny_model_dir.parent, TinyModelRecipe(architecture="falcon_h1", train_steps=5))
    model = AutoModelForCausalLM.from_pretrained(str(source))
    model.config.lm_head_multiplier = 0.37
    model.save_pretrained(str(tmp_path / "scaled"))
    AutoTokenizer.from_pretrained(str(source)).save_pretrained(str(tmp_path / "scaled"))
    trainer = make_trainer(tmp_path / "scaled", tmp_path / "trainer", top_k=4)
    assert trainer.model.model.lm_head_multiplier == 0.37
    ids = torch.randint(3, 30, (4, 12), generator=torch.Generator().manual_seed(2))
    capture = SupportCapture(trainer, (4, 1.0, 0.0))
    with torch.no_grad(), capture.active():
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids), 7)
        logits = trainer.model(input_ids=ids).logits[:, -8:-1].float()
    expected = kept_log_mass(logits, top_k=4)
    assert bool((expected < -0.05).all()), "a real cut on every token"
    torch.testing.assert_close(capture.calls[0], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", ["root", "head"])
def test_a_policy_sharded_over_two_processes_is_captured_exactly(high_entropy_model, tmp_path, layout):
    """FSDP2 over two CPU processes (gloo), as accelerate's FSDP2 plugin shards a policy: outside the forward each
    process holds about half of the LM head (in the root unit, or in a unit of its own); through TRL's scoring call
    the hook's log Z still equals an unsharded copy's, and no token falls back. (On one H200, accelerate's FSDP1
    and FSDP2 plugins run the whole GRPO loop of ``examples/two_process_grpo.py --top-k 5``.)"""
    import json
    import os
    import sys
    from pathlib import Path

    from tests.processes import run_group

    worker = Path(__file__).with_name("sharded_support.py")
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(worker), str(high_entropy_model), str(tmp_path), layout]
    done = run_group(command, timeout=300, capture_output=True, text=True, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for result in results:
        assert result["error"] is None
        assert result["local_head_rows"] < result["vocabulary"], "the LM head must really be sharded"
        assert result["cut"] < -0.05, "top_k = 5 must cut real mass for the check to mean something"
        assert result["max_difference"] < 1e-4 and result["fell_back"] == 0, result


def test_a_head_whose_weight_is_gathered_only_in_its_forward_is_read_by_its_output_size():
    """A head whose weight is empty (``param.data`` of shape (0,)) except in its own forward, as DeepSpeed ZeRO-3
    keeps it, emulated with ZeRO-3's two hooks on an ``nn.Linear``. The hook calls the head as a module, so the
    logits are whole; the tile size and the ids' range come from the head's output size (``out_features``), not
    the weight (empty here: a vocabulary of 0, a division by zero). Real ZeRO-3 also gathers a parameter that is
    read during any forward, so there the weight's shape would have been whole, at the cost of gathering the head
    early and registering it as an external parameter of the root (deepspeed 0.19.8 on CPU); this emulation has no
    such getter."""
    from rollout_guard.integrations.trl.support import token_log_mass

    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)
    hidden = torch.randn(2, 5, 16, generator=generator)
    ids = torch.randint(0, 300, (2, 5), generator=generator)
    expected = token_log_mass(hidden, ids, head, 1.0, None, 0.7, (5, 1.0, 0.0))
    full = head.weight.data
    head.weight.data = torch.empty(0)
    head.register_forward_pre_hook(lambda module, args: setattr(module.weight, "data", full))
    head.register_forward_hook(lambda module, args, output: setattr(module.weight, "data", torch.empty(0)))
    got = token_log_mass(hidden, ids, head, 1.0, None, 0.7, (5, 1.0, 0.0))
    assert head.weight.numel() == 0  # emptied again after each forward
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)
