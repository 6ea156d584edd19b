"""The fused Triton kernel against the pure-torch reference packet, in Triton's interpreter on CPU.

The kernel runs on CUDA in training; here ``TRITON_INTERPRET=1`` runs the same kernel source on CPU tensors, with
small blocks so that every row crosses block boundaries (the CUSUM, maxima and first-divergent index are carried
from block to block). ``benchmarks/statistics_speed.py`` checks the compiled kernel against the reference on a GPU.
"""

from __future__ import annotations

import functools
import math
import sys

import pytest
import torch

from rollout_guard import GuardConfig, RolloutEvidence
from rollout_guard.packet import AGGREGATES, PacketLayout, reference_packet
from rollout_guard.statistics import COLUMN, SAMPLE_COLUMNS, Thresholds
from tests.triton_interpreter import check_in_interpreter, run_cases

pytest.importorskip("triton")  # installed with the `cpu` extra (vLLM's dependency) and on CUDA machines

BLOCK = 32
INDEX_COLUMNS = ("tokens", "compared_tokens", "confident_wrong_tokens", "first_divergent_token",
                 "nonfinite_engine_tokens", "nonfinite_trainer_tokens", "injected", "drift_start")


def assert_same_packet(reference: torch.Tensor, fused: torch.Tensor, batch: int) -> None:
    layout = PacketLayout(batch)
    assert reference.shape == fused.shape
    assert torch.equal(reference[:2], fused[:2])
    ref, got = reference[layout.samples].view(batch, -1), fused[layout.samples].view(batch, -1)
    for name in SAMPLE_COLUMNS:
        a, b = ref[:, COLUMN[name]], got[:, COLUMN[name]]
        assert torch.equal(torch.isnan(a), torch.isnan(b)), name
        if name in INDEX_COLUMNS:
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), (name, a.tolist(), b.tolist())
        else:  # float32 sums in another order
            torch.testing.assert_close(b.nan_to_num(), a.nan_to_num(), rtol=2e-5, atol=2e-4, msg=name)
    assert torch.equal(reference[layout.reasons], fused[layout.reasons]), (reference[layout.reasons], fused[layout.reasons])
    assert torch.equal(reference[layout.histogram], fused[layout.histogram])
    calibration_ref, calibration_got = reference[layout.calibration].view(4, -1), fused[layout.calibration].view(4, -1)
    assert torch.equal(calibration_ref[:, 0], calibration_got[:, 0])  # token counts: exact
    assert torch.equal(calibration_ref[:, 3:], calibration_got[:, 3:])  # candidates and their histogram: exact
    torch.testing.assert_close(calibration_got[:, 1:3], calibration_ref[:, 1:3], rtol=1e-5, atol=1e-3)
    assert reference[layout.kept_rows] == fused[layout.kept_rows]
    for (name, _), a, b in zip(AGGREGATES, reference[layout.aggregates].tolist(), fused[layout.aggregates].tolist(), strict=True):
        assert b == pytest.approx(a, rel=2e-5, abs=1e-3), name


def mixed_batch(generator: torch.Generator, rows: int = 10, length: int = 150) -> RolloutEvidence:
    """Clean rows, a late-onset drift that crosses blocks, a mid-row dip that resets the CUSUM, confident-wrong
    tokens, a spike, non-finite values inside and outside the mask, holes in the mask (tool tokens), an empty row."""
    engine = -torch.rand(rows, length, generator=generator) * 4
    trainer = engine + 0.05 * torch.randn(rows, length, generator=generator)
    trainer[1, 90:] -= 2.5  # late onset, crosses the 32-token blocks
    trainer[2, 10:40] += 3.0  # the running sum dips (trainer above engine), then a later rise
    trainer[2, 100:] -= 3.0
    engine[3, 20:25] = -0.01
    trainer[3, 20:25] = -9.0  # confident-wrong run
    trainer[4, 77] -= 12.0  # one spike
    trainer[5, 60] = math.nan
    engine[6, 33] = -math.inf
    engine[7, 149] = math.nan  # outside the mask below
    lengths = torch.tensor([150, 150, 150, 64, 131, 100, 33, 140, 0, 97])[:rows]
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).long()
    mask[9, 40:70] = 0  # a hole in the mask
    injected = torch.zeros(rows, dtype=torch.bool)
    injected[1:5] = True
    return RolloutEvidence(mask=mask, engine_logprobs=engine, trainer_logprobs=trainer, injected=injected)


CALIBRATED = Thresholds(torch.tensor([0.0, 0.1, 0.3, 0.05]), torch.tensor([0.5, 0.6, 1.0, 0.5]),
                        torch.tensor([3.0, 3.5, 5.0, 4.0]), torch.tensor([2.5, math.inf, math.inf, math.inf]),
                        torch.tensor([1.0, 1.0, 0.0, 1.0]))  # bucket 2 judged in nats, the others by w·|x|


def case_mixed_batch(fused, thresholds):
    config = GuardConfig()
    table = Thresholds.fixed(config) if thresholds == "fixed" else CALIBRATED
    evidence = mixed_batch(torch.Generator().manual_seed(1))
    reference = reference_packet(evidence, config, table)
    assert int((reference[PacketLayout(10).reasons] != 0).sum()) >= 4, "the batch must exercise the rules"
    assert_same_packet(reference, fused(evidence, config, table, block=BLOCK), 10)


def case_calibrated_drift_threshold(fused):
    """The calibrated drift threshold reaches the kernel's verdict (one row's CUSUM lies between it and the
    configured ceiling: flagged with it, not without)."""
    config = GuardConfig()
    evidence = mixed_batch(torch.Generator().manual_seed(4))
    evidence.trainer_logprobs[0, 100:104] -= 1.6  # a short drift: CUSUM ≈ 4 · (1.6 − 0.5) = 4.4 nats
    layout = PacketLayout(10)
    fixed = reference_packet(evidence, config, CALIBRATED)
    lowered = reference_packet(evidence, config, CALIBRATED, drift_threshold=3.0)
    assert fixed[layout.reasons][0] == 0 and lowered[layout.reasons][0] != 0, "row 0 must sit between 3 and 6 nats"
    assert_same_packet(lowered, fused(evidence, config, CALIBRATED, block=BLOCK, drift_threshold=3.0), 10)


def case_rules_off_bool_mask_and_bf16(fused):
    config = GuardConfig(spike_delta=None, mean_delta=None, confident_wrong_tokens=None, spike_excess=None,
                         drift_threshold=None, nonfinite_trainer_tokens=2)
    base = mixed_batch(torch.Generator().manual_seed(2))
    evidence = RolloutEvidence(mask=base.mask.bool(), engine_logprobs=base.engine_logprobs.bfloat16(),
                               trainer_logprobs=base.trainer_logprobs.bfloat16())
    reference = reference_packet(evidence, config, Thresholds.fixed(config))
    assert_same_packet(reference, fused(evidence, config, Thresholds.fixed(config), block=BLOCK), 10)


def case_one_side_only(fused, side):
    config = GuardConfig()
    base = mixed_batch(torch.Generator().manual_seed(3))
    evidence = RolloutEvidence(mask=base.mask, engine_logprobs=base.engine_logprobs if side == "engine" else None,
                               trainer_logprobs=base.trainer_logprobs if side == "trainer" else None)
    reference = reference_packet(evidence, config, CALIBRATED)
    assert_same_packet(reference, fused(evidence, config, CALIBRATED, block=BLOCK), 10)


def case_ties_and_one_block(fused):
    """Exact ties in the CUSUM (constant increments, masked stretches) decide drift_start by torch.cummin's and
    argmax's tie rules; and a row shorter than one block."""
    config = GuardConfig()
    engine = torch.full((3, 96), -0.1)
    trainer = engine.clone()
    trainer[0, :] -= 2.5  # every increment equal: the rise starts at 0
    trainer[1, :10] += 2.0  # dip, then a masked stretch at the minimum across a block boundary, then a rise
    trainer[1, 40:] -= 3.0
    mask = torch.ones(3, 96, dtype=torch.long)
    mask[1, 10:40] = 0
    mask[2, 20:] = 0
    evidence = RolloutEvidence(mask=mask, engine_logprobs=engine, trainer_logprobs=trainer)
    reference = reference_packet(evidence, config, Thresholds.fixed(config))
    assert_same_packet(reference, fused(evidence, config, Thresholds.fixed(config), block=BLOCK), 3)
    assert_same_packet(reference, fused(evidence, config, Thresholds.fixed(config), block=128), 3)
    starts = reference[PacketLayout(3).samples].view(3, -1)[:, COLUMN["drift_start"]].tolist()
    assert starts[:2] == [0.0, 40.0], starts  # the rise starts after the last position of the minimum


def case_histogram_bin_edges(fused):
    """|Δ| and |x| exactly on every histogram edge and one float32 step below it (the kernel guesses a bin
    from the logarithm and corrects it against the edges)."""
    from rollout_guard.statistics import DELTA_BIN_EDGES, EXCESS_EDGES

    edges = torch.cat([DELTA_BIN_EDGES.float(), torch.tensor(EXCESS_EDGES, dtype=torch.float32)]).clamp(max=60.0)
    values = torch.cat([edges, torch.nextafter(edges, torch.zeros_like(edges)), edges * 1.0000001]).clamp(min=0.0)
    width = 64
    values = torch.nn.functional.pad(values, (0, (-values.numel()) % width)).view(-1, width)
    engine = torch.zeros_like(values)
    evidence = RolloutEvidence(mask=torch.ones_like(values, dtype=torch.long), engine_logprobs=engine, trainer_logprobs=-values)
    config = GuardConfig()
    reference = reference_packet(evidence, config, Thresholds.fixed(config))
    assert_same_packet(reference, fused(evidence, config, Thresholds.fixed(config), block=BLOCK), values.shape[0])


def case_batch_centres(fused):
    """A first step (no centre known): the batch's own centres and allowances reach the kernel through its
    parameter table, and the packet's calibration sums are moved back to the calibration's centres alike."""
    from rollout_guard.fused_statistics import kernel_parameters, with_centres
    from rollout_guard.packet import reanchor
    from rollout_guard.statistics import batch_thresholds

    config = GuardConfig()
    generator = torch.Generator().manual_seed(5)
    trainer = -0.2 - 2.5 * torch.rand(12, 120, generator=generator)
    engine = (trainer + 0.8 + 0.1 * torch.randn(12, 120, generator=generator)).clamp(max=-0.01)  # a top-p offset
    trainer[2, 60:] = engine[2, 60:] - 0.8 - 1.2  # a late drift of 1.2 nats per token beyond the offset
    evidence = RolloutEvidence(mask=torch.ones(12, 120, dtype=torch.long), engine_logprobs=engine, trainer_logprobs=trainer)
    fixed, layout = Thresholds.fixed(config), PacketLayout(12)
    judged, shift, _ = batch_thresholds(evidence, config, fixed, torch.ones(4, dtype=torch.bool))
    assert float(shift.abs().max()) > 0.5, "the batch must move some centre"
    reference = reanchor(reference_packet(evidence, config, judged), layout, shift)
    assert reference[layout.reasons].tolist()[2] != 0, "the drift must be caught around the batch's centre"
    table = with_centres(kernel_parameters(config, fixed, "cpu"), judged)
    assert_same_packet(reference, reanchor(fused(evidence, config, table, block=BLOCK), layout, shift), 12)


def case_batch_spike_thresholds(fused):
    """A step before calibration: the batch's own spike thresholds reach the kernel through its parameter table
    (a 3-nat single spike in a quiet batch fires there, not at the fixed 4 nats)."""
    from rollout_guard.fused_statistics import kernel_parameters, with_centres
    from rollout_guard.statistics import batch_thresholds

    config = GuardConfig(spike_delta=None, mean_delta=None, confident_wrong_tokens=None)
    generator = torch.Generator().manual_seed(6)
    engine = -1.0 - 0.4 * torch.rand(12, 120, generator=generator)
    trainer = engine - 0.05 * torch.randn(12, 120, generator=generator)
    trainer[4, 17] -= 3.0  # one spike
    evidence = RolloutEvidence(mask=torch.ones(12, 120, dtype=torch.long), engine_logprobs=engine,
                               trainer_logprobs=trainer)
    fixed, layout = Thresholds.fixed(config), PacketLayout(12)
    every = torch.ones(4, dtype=torch.bool)
    judged, _, _ = batch_thresholds(evidence, config, fixed, every, spiky=every, spike_floor=1.5)
    assert float(judged.spike[2]) == 1.5, "the batch reads the floor"
    reference = reference_packet(evidence, config, judged)
    assert [i for i, reason in enumerate(reference[layout.reasons].tolist()) if reason] == [4]
    table = with_centres(kernel_parameters(config, fixed, "cpu"), judged)
    assert_same_packet(reference, fused(evidence, config, table, block=BLOCK), 12)


def case_row_scaling(fused):
    """Each row's own spike threshold (rollout_guard.statistics.spike_per_row) reaches the kernel: the same 3.4-nat
    spike fires in an 8-token row (threshold 4 + 0.5 ln(8/100) = 2.7) and not in a 150-token one (4.2)."""
    from rollout_guard.fused_statistics import kernel_parameters
    from rollout_guard.statistics import RowScaling

    config = GuardConfig(spike_delta=None, mean_delta=None, confident_wrong_tokens=None)
    generator = torch.Generator().manual_seed(7)
    engine = torch.full((4, 150), -0.5)  # where the surprise weight is 1
    trainer = engine - 0.05 * torch.randn(4, 150, generator=generator)
    trainer[0, 5] -= 3.4
    trainer[1, 120] -= 3.4
    mask = (torch.arange(150).unsqueeze(0) < torch.tensor([8, 150, 40, 150]).unsqueeze(1)).long()
    evidence = RolloutEvidence(mask=mask, engine_logprobs=engine, trainer_logprobs=trainer)
    scaling = RowScaling(torch.tensor([0.0, 0.4, 0.6, 0.5]), 1.5, 100.0)
    layout = PacketLayout(4)
    alike = reference_packet(evidence, config, CALIBRATED)
    reference = reference_packet(evidence, config, CALIBRATED, scaling=scaling)
    assert alike[layout.reasons].tolist() == [0, 0, 0, 0]
    assert [bool(r) for r in reference[layout.reasons].tolist()] == [True, False, False, False]
    table = kernel_parameters(config, CALIBRATED, "cpu", scaling=scaling)
    assert_same_packet(reference, fused(evidence, config, table, block=BLOCK), 4)


def case_joint_drift(fused):
    """The drift rule's joint part reaches the kernel's verdict: a 3.9-nat token under a 4-nat threshold followed
    by two 1.3-nat ones (CUSUM 3.4 + 1.6 = 5.0, under 6) fires it (−0.1 + 0.25 · (5.0 − 6) > −0.4); the token
    alone (CUSUM 3.4) does not, nor does anything with ``joint_margin=None``."""
    config = GuardConfig(spike_delta=None, mean_delta=None, confident_wrong_tokens=None)
    engine = torch.full((3, 80), -0.5)  # where the surprise weight is 1
    trainer = engine - 0.05  # x = 0 around the bucket's centre of 0.05
    trainer[0, 40], trainer[0, 41:43] = -0.5 - 0.05 - 3.9, -0.5 - 0.05 - 1.3
    trainer[1, 40] = -0.5 - 0.05 - 3.9
    evidence = RolloutEvidence(mask=torch.ones(3, 80, dtype=torch.long), engine_logprobs=engine, trainer_logprobs=trainer)
    layout, off = PacketLayout(3), GuardConfig(spike_delta=None, mean_delta=None, confident_wrong_tokens=None,
                                               joint_margin=None)
    reference = reference_packet(evidence, config, CALIBRATED)
    assert reference[layout.reasons].tolist() == [64.0, 0.0, 0.0], reference[layout.reasons]  # the drift bit
    assert reference_packet(evidence, off, CALIBRATED)[layout.reasons].tolist() == [0.0, 0.0, 0.0]
    assert_same_packet(reference, fused(evidence, config, CALIBRATED, block=BLOCK), 3)
    assert_same_packet(reference_packet(evidence, off, CALIBRATED), fused(evidence, off, CALIBRATED, block=BLOCK), 3)


def case_changepoint(fused):
    """The change-point score, computed beside the kernel, reaches its column and the ``changepoint`` rule: a
    0.4-nat lag over a row's last 60 tokens (below the spike and drift thresholds) fires it at its threshold and
    not with the rule off; a row with no read token (score −inf) and a NaN score never fire."""
    from rollout_guard.changepoint import changepoint_score
    from rollout_guard.fused_statistics import kernel_parameters

    config = GuardConfig(changepoint_budget=0.001)
    generator = torch.Generator().manual_seed(8)
    engine = -0.2 - 0.25 * torch.rand(6, 150, generator=generator)  # bucket 3, where the surprise weight is ~1
    trainer = engine - 0.05 - 0.2 * torch.randn(6, 150, generator=generator)
    trainer[0, 90:] -= 0.4
    engine[5], trainer[5] = -6.0, -6.05  # no token read: −inf
    evidence = RolloutEvidence(mask=torch.ones(6, 150, dtype=torch.long), engine_logprobs=engine,
                               trainer_logprobs=trainer)
    score = changepoint_score(engine, trainer, evidence.mask, CALIBRATED.centre, torch.tensor([0.0, 0.3, 0.3, 0.2]))
    score[4] = math.nan
    layout = PacketLayout(6)
    reference = reference_packet(evidence, config, CALIBRATED, changepoint=score, changepoint_threshold=3.0)
    assert reference[layout.reasons].tolist() == [128.0, 0.0, 0.0, 0.0, 0.0, 0.0], reference[layout.reasons]
    assert reference_packet(evidence, config, CALIBRATED)[layout.reasons].tolist() == [0.0] * 6
    table = kernel_parameters(config, CALIBRATED, "cpu", changepoint_threshold=3.0)
    assert_same_packet(reference, fused(evidence, config, table, block=BLOCK, changepoint=score), 6)
    off = reference_packet(evidence, config, CALIBRATED, changepoint=score)  # scored, not judged
    assert off[layout.reasons].tolist() == [0.0] * 6
    assert_same_packet(off, fused(evidence, config, CALIBRATED, block=BLOCK, changepoint=score), 6)


CASES = {
    "the change-point rule": case_changepoint,
    "the drift rule's joint part": case_joint_drift,
    "mixed batch, fixed thresholds": lambda fused: case_mixed_batch(fused, "fixed"),
    "mixed batch, calibrated thresholds": lambda fused: case_mixed_batch(fused, "calibrated"),
    "mixed batch, calibrated drift threshold": case_calibrated_drift_threshold,
    "rules off, bool mask, bf16": case_rules_off_bool_mask_and_bf16,
    "engine logprobs only": lambda fused: case_one_side_only(fused, "engine"),
    "trainer logprobs only": lambda fused: case_one_side_only(fused, "trainer"),
    "ties and one block": case_ties_and_one_block,
    "histogram bin edges": case_histogram_bin_edges,
    "the batch's own centres": case_batch_centres,
    "the batch's own spike thresholds": case_batch_spike_thresholds,
    "each row's own spike threshold": case_row_scaling,
}


def test_fused_kernel_matches_the_reference_in_the_interpreter():
    check_in_interpreter(__file__, list(CASES))


if __name__ == "__main__":
    from rollout_guard.fused_statistics import fused_packet  # after TRITON_INTERPRET=1 (the parent sets it)

    sys.exit(1 if run_cases({name: functools.partial(case, fused_packet) for name, case in CASES.items()}, sys.argv[1:])
             else 0)
