"""Property-based tests over generated batches: data problems become verdicts, structural problems become
errors that name the field, and the guard never crashes training.

Tensors are built from a drawn seed plus drawn shapes and fault patterns (NaN, ±inf, huge values, empty and
fully masked rows), so each example is cheap and hypothesis still controls everything that matters.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_guard.config import GuardConfig
from rollout_guard.errors import GuardError, GuardInputError
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.guard import RolloutGuard
from rollout_guard.integrations.trl import NEUTRAL_FILL, GroupSettings, evidence_of, quarantine_batch
from rollout_guard.statistics import COLUMN
from rollout_guard.verdict import RULE_BIT

FUZZ = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
SPECIALS = (math.nan, math.inf, -math.inf, 1e30, -1e30, 0.0, -1e-45)


@st.composite
def batches(draw) -> dict:
    groups = draw(st.integers(0, 4))
    group_size = draw(st.sampled_from([1, 2, 4]))
    length = draw(st.integers(0, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    rows = groups * group_size
    lengths = torch.randint(0, length + 1, (rows,), generator=generator)
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).long()
    engine = -torch.rand(rows, length, generator=generator) * draw(st.sampled_from([0.1, 3.0, 30.0]))
    trainer = engine + draw(st.sampled_from([0.0, 1e-6, 0.5, 12.0])) * torch.randn(rows, length, generator=generator)
    for tensor in (engine, trainer):
        if draw(st.booleans()):
            special = draw(st.sampled_from(SPECIALS))
            hits = torch.rand(rows, length, generator=generator) < draw(st.sampled_from([0.02, 0.3, 1.0]))
            tensor[hits] = special
    corrupt = torch.rand(rows, generator=generator) < draw(st.sampled_from([0.0, 0.25, 1.0]))
    engine[corrupt] = -0.01
    trainer[corrupt] = -9.0
    rewards = torch.rand(rows, draw(st.integers(1, 2)), generator=generator)
    if draw(st.booleans()):
        rewards[torch.rand(rows, generator=generator) < 0.3] = math.nan
    return {
        "mask": mask, "engine": None if draw(st.integers(0, 9)) == 0 else engine,
        "trainer": None if draw(st.integers(0, 9)) == 0 else trainer,
        "group_size": group_size, "rewards": rewards,
        "mode": draw(st.sampled_from(["quarantine", "monitor"])),
        "scale": draw(st.sampled_from(["group", "batch", "none"])),
        "aggregation": draw(st.sampled_from(["sum_then_normalize", "normalize_then_sum"])),
    }


def check_report(case: dict, report) -> None:
    rows = case["mask"].shape[0]
    assert report.suspect.shape == (rows,) and not report.skipped
    assert not (report.quarantined & ~report.suspect).any()
    if case["mode"] == "monitor":
        assert not report.quarantined.any() and not report.local_quarantined.any()
    assert ((report.reasons != 0) == report.suspect).all()
    empty = case["mask"].sum(dim=1) == 0
    assert not report.suspect[empty].any(), "a sample with no token in the loss mask cannot be suspect"
    if case["engine"] is not None:
        bad_engine = (case["mask"].bool() & ~torch.isfinite(case["engine"])).any(dim=1)
        fired = (report.reasons & RULE_BIT["nonfinite_engine"]) != 0
        assert torch.equal(fired, bad_engine), "a NaN/inf engine logprob in the loss mask is evidence"
    metrics = report.metrics
    assert metrics["samples"] == rows and metrics["tokens"] == case["mask"].sum().item()
    assert all(isinstance(v, float) and not math.isinf(v) or math.isnan(v) for k, v in metrics.items() if k != "max_abs_delta")
    assert report.samples[:, COLUMN["tokens"]].sum().item() == case["mask"].sum().item()


def test_data_problems_become_verdicts_never_crashes():
    calls = 0

    @settings(FUZZ, max_examples=10_000)
    @given(batches())
    def run(case: dict) -> None:
        nonlocal calls
        calls += 1
        if case["engine"] is None and case["trainer"] is None:
            return
        guard = RolloutGuard(GuardConfig(mode=case["mode"]))
        evidence = RolloutEvidence(mask=case["mask"], engine_logprobs=case["engine"], trainer_logprobs=case["trainer"])
        check_report(case, guard.inspect(evidence, step=1, batch_size=case["mask"].shape[0]))

    run()
    assert calls >= 10_000


def test_quarantine_batch_keeps_the_loss_consistent():
    calls = 0

    @settings(FUZZ, max_examples=3_000)
    @given(batches())
    def run(case: dict) -> None:
        nonlocal calls
        calls += 1
        if case["trainer"] is None:
            case["trainer"] = case["mask"].float() * -0.5
        mask = case["mask"]
        batch = {
            "completion_mask": mask, "sampling_per_token_logps": case["engine"], "old_per_token_logps": case["trainer"],
            "advantages": torch.zeros(mask.shape[0]), "num_items_in_batch": mask.sum(),
            "ref_per_token_logps": case["trainer"].flip(0), "importance_sampling_ratio": case["trainer"].exp().sum(-1, keepdim=True),
        }
        report = RolloutGuard(GuardConfig(mode=case["mode"])).inspect(evidence_of(batch), step=1, batch_size=mask.shape[0])
        settings_ = GroupSettings(torch.ones(case["rewards"].shape[1]), case["group_size"], case["scale"], case["aggregation"])
        out = quarantine_batch(batch, report, case["rewards"], settings_)
        q = report.quarantined
        assert not out["completion_mask"][q].any()
        assert torch.equal(out["completion_mask"][~q], mask[~q])
        assert int(out["num_items_in_batch"]) == int(out["completion_mask"].sum())
        assert out["num_items_in_batch"].dtype == batch["num_items_in_batch"].dtype
        assert torch.isfinite(out["advantages"]).all()
        assert (out["advantages"][q] == 0).all()
        for key, fill in NEUTRAL_FILL.items():  # nothing non-finite left where the loss computes before masking
            if out.get(key) is not None:
                assert (out[key][q] == fill).all() and torch.equal(out[key][~q].nan_to_num(7.0), batch[key][~q].nan_to_num(7.0))
        if mask.shape[0]:
            fully_quarantined = q.view(-1, case["group_size"]).all(dim=1).repeat_interleave(case["group_size"])
            assert (out["advantages"][fully_quarantined] == 0).all()

    run()
    assert calls >= 3_000


STRUCTURAL = [
    ("mask", lambda b: b.pop("completion_mask")),
    ("mask", lambda b: b.__setitem__("completion_mask", b["completion_mask"].float())),
    ("mask", lambda b: b.__setitem__("completion_mask", b["completion_mask"].unsqueeze(-1))),
    ("engine_logprobs", lambda b: b.__setitem__("sampling_per_token_logps", b["sampling_per_token_logps"][:, :-1])),
    ("engine_logprobs", lambda b: b.__setitem__("sampling_per_token_logps", b["sampling_per_token_logps"].long())),
    ("trainer_logprobs", lambda b: b.__setitem__("old_per_token_logps", b["old_per_token_logps"].tolist())),
    ("trainer_logprobs", lambda b: b.__setitem__("old_per_token_logps", b["old_per_token_logps"].to("meta"))),
    ("engine_logprobs/trainer_logprobs", lambda b: (b.pop("sampling_per_token_logps"), b.pop("old_per_token_logps"))),
]


def structural_batch(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    mask = (torch.rand(4, 5, generator=generator) < 0.8).long()
    engine = -torch.rand(4, 5, generator=generator)
    return {"completion_mask": mask, "sampling_per_token_logps": engine, "old_per_token_logps": engine.clone()}


@pytest.mark.parametrize(("field", "breakage"), STRUCTURAL)
def test_structural_problems_name_the_field_first_step_and_are_counted_later(field, breakage):
    calls = 0

    @settings(FUZZ, max_examples=150)
    @given(st.integers(0, 2**31 - 1), st.booleans())
    def run(seed: int, strict: bool) -> None:
        nonlocal calls
        calls += 1
        guard = RolloutGuard(GuardConfig(strict=strict))
        good = structural_batch(seed)
        broken = structural_batch(seed)
        breakage(broken)

        def inspect(batch: dict):
            try:
                evidence = evidence_of(batch)
            except Exception as error:  # noqa: BLE001 - what the adapter does
                evidence = error
            return guard.inspect(evidence, step=guard.totals.steps + 1, batch_size=4)

        with pytest.raises(GuardInputError) as first:
            inspect(broken)
        assert field in first.value.field and "Fix:" in str(first.value)
        assert not inspect(good).skipped
        if strict:
            with pytest.raises(GuardInputError):
                inspect(broken)
        else:
            later = inspect(broken)
            assert later.skipped and not later.quarantined.any() and guard.totals.failures == 1
            assert not inspect(good).skipped

    run()
    assert calls >= 150


def test_a_failure_on_one_process_is_a_skip_on_every_process():
    """Two ranks (threads): rank 1's batch is broken after the first step; both ranks skip the same step."""
    import threading

    barrier = threading.Barrier(2)
    slots: list = [None, None]

    def gather_for(rank: int):
        def gather(tensor):
            slots[rank] = tensor
            barrier.wait()
            out = torch.cat(slots)
            barrier.wait()
            return out
        return gather

    guards = [RolloutGuard(GuardConfig(), gather=gather_for(r), process_index=r) for r in range(2)]
    outcomes: list = [[], []]

    def run(rank: int) -> None:
        for step in (1, 2, 3):
            batch = structural_batch(step * 10 + rank)
            if rank == 1 and step == 2:
                batch["sampling_per_token_logps"] = batch["sampling_per_token_logps"][:, :2]
            try:
                evidence = evidence_of(batch)
            except GuardError as error:
                evidence = error
            outcomes[rank].append(guards[rank].inspect(evidence, step=step, batch_size=4).skipped)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert outcomes == [[False, True, False], [False, True, False]]
    assert [g.totals.failures for g in guards] == [1, 1]
