"""The fused detector step (Triton kernels, rollout_guard.detector.fused) equals the torch reference: the
judgement, the per-row statistics and the histograms, on healthy, corrupted and borderline batches, in Triton's
interpreter on the CPU (the GPU benchmark compares them on the device)."""

from __future__ import annotations

import math

import pytest
import torch

from rollout_guard.detector import RULE_BIT, Detector
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.statistics import COLUMN, summarise


def _batch(rows: int, length: int, seed: int, offset: float = 0.0, scale: float = 0.05):
    generator = torch.Generator().manual_seed(seed)
    engine = -6.0 * torch.rand(rows, length, generator=generator) ** 2
    noise = scale * torch.distributions.Laplace(0.0, 1.0).sample((rows, length))
    trainer = engine - offset - noise
    lengths = torch.randint(length // 3, length + 1, (rows,), generator=generator)
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return engine, trainer, mask


def _corrupt(engine: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Every kind of row the detector tells apart; (B,) injected labels."""
    injected = torch.zeros(engine.shape[0], dtype=torch.bool)
    trainer[1, 40] = engine[1, 40] - 9.2  # one token the engine favours by 9.2 nats
    trainer[2, 60:] -= 1.5  # the engine off by 1.5 nats from token 100 on
    trainer[3, 17] = engine[3, 17] + 4.0  # a trainer-favouring spike
    engine[4, 5] = math.nan  # a NaN engine logprob
    trainer[5, 30] = -math.inf  # an infinite trainer logprob
    trainer[6, 2] = engine[6, 2] - 30.0  # over the ceiling
    mask[7] = 0  # nothing to read
    trainer[8, 60:64] = engine[8, 60:64] - torch.tensor([2.0, 4.0, 6.0, 9.0])  # a few grey tokens
    injected[1:9] = True
    return injected


CASES = {
    # name: (rows, tokens, seed, offset of the healthy centre (nats), warm steps before[, zero tolerance (nats)])
    "corrupted_after_warm_up": (12, 700, 0, 0.0, 3),
    "corrupted_fresh": (12, 513, 1, 0.0, 0),
    "offset_centre": (10, 300, 2, 1.3, 2),
    "single_block": (9, 250, 3, 0.0, 1),
    "zero_tolerance": (12, 300, 4, 0.0, 1, 2.0),
}


def _case(name: str) -> None:
    from rollout_guard.detector import fused

    rows, length, seed, offset, warm, *tolerance = CASES[name]
    tolerance = tolerance[0] if tolerance else None
    reference = Detector(tolerance=tolerance)
    for step in range(warm):
        engine, trainer, mask = _batch(rows, length, 100 + step, offset)
        reference.update(reference.judge(engine, trainer, mask).kept_counts)
    candidate = Detector(tolerance=tolerance)
    candidate.load_state_dict(reference.state_dict())
    engine, trainer, mask = _batch(rows, length, seed, offset)
    injected = _corrupt(engine, trainer, mask)
    expected = reference.judge(engine, trainer, mask, injected)
    samples, histogram = summarise(RolloutEvidence(mask, engine, trainer, injected), expected)
    got = candidate._judge_fused(engine, trainer, mask, injected)
    assert got.reasons.tolist() == expected.reasons.tolist()
    assert got.onset.tolist() == expected.onset.tolist()
    torch.testing.assert_close(got.score, expected.score, atol=2e-3, rtol=1e-4)
    torch.testing.assert_close(got.samples, samples, atol=2e-3, rtol=1e-4, equal_nan=True)
    assert torch.equal(got.delta_histogram, histogram)
    assert torch.equal(got.kept_counts, expected.kept_counts)
    torch.testing.assert_close(got.noise.centre, expected.noise.centre)
    torch.testing.assert_close(got.noise.scale, expected.noise.scale)
    torch.testing.assert_close(got.growth, expected.growth, equal_nan=True)
    # the learned state is the same either way
    reference.update(expected.kept_counts)
    candidate.update(got.kept_counts)
    torch.testing.assert_close(candidate.counts, reference.counts)
    assert fused.ROW_COLUMNS[COLUMN["score"]] == "score"
    suspect = (expected.reasons != 0).tolist()
    assert suspect[:9] == [False] + [True] * 6 + [False, True] and not any(suspect[9:]), suspect  # row 7 reads none
    if tolerance is not None:  # the tolerance bit on exactly the rows with a read token beyond it
        read = mask.bool() & torch.isfinite(engine) & torch.isfinite(trainer)
        beyond = (((engine - trainer).abs() > tolerance) & read).any(-1)
        assert ((got.reasons & RULE_BIT["tolerance"]) != 0).tolist() == beyond.tolist() and beyond[[1, 3, 6, 8]].all()


def test_the_fused_step_equals_the_torch_reference_in_the_interpreter():
    """Reasons, onsets and kept histograms equal; scores and statistics within float32 rounding."""
    from tests.triton_interpreter import check_in_interpreter

    pytest.importorskip("triton")
    check_in_interpreter(__file__, list(CASES), timeout=600)


if __name__ == "__main__":
    import functools
    import sys

    from tests.triton_interpreter import run_cases

    cases = {name: functools.partial(_case, name) for name in CASES}
    sys.exit(1 if run_cases(cases, sys.argv[1:]) else 0)
