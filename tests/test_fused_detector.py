"""The fused detector step (Triton kernels, rollout_guard.detector.fused) equals the torch reference: the
judgement, the per-row statistics, the histograms and the learned state, on healthy, corrupted and borderline
batches; in Triton's interpreter on the CPU, and on the GPU where there is one."""

from __future__ import annotations

import math

import pytest
import torch

from rollout_guard.detector import RULE_BIT, Detector
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.packet import AGGREGATES, partial_aggregates
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
    trainer[3, 17] = engine[3, 17] + 4.0  # a trainer-favouring spike (kept or flagged: see _case)
    engine[4, 5] = math.nan  # a NaN engine logprob
    trainer[5, 30] = -math.inf  # an infinite trainer logprob
    trainer[6, 2] = engine[6, 2] - 30.0  # over the ceiling
    mask[7] = 0  # nothing to read
    trainer[8, 60:64] = engine[8, 60:64] - torch.tensor([2.0, 4.0, 6.0, 9.0])  # a few grey tokens
    mask[0, 128:384] = 0  # a stretch the loss leaves out (a tool's output): whole blocks of a row with nothing to read
    injected[1:9] = True
    return injected


CASES = {
    # name: (rows, tokens, seed, offset of the healthy centre (nats), warm steps before[, zero tolerance (nats)])
    "corrupted_after_warm_up": (12, 700, 0, 0.0, 3),
    "corrupted_fresh": (12, 513, 1, 0.0, 0),
    "offset_centre": (10, 300, 2, 1.3, 2),
    "single_block": (9, 250, 3, 0.0, 1),
    "zero_tolerance": (12, 300, 4, 0.0, 1, 2.0),
    "many_chunks": (10, 2600, 5, 0.0, 2),
    "many_chunks_in_tiles": (10, 2600, 6, 0.0, 2),
    "many_rows": (140, 300, 7, 0.0, 1),  # the batch's aggregates read in several tiles of rows (fused.ROW_TILE)
}
TILES = {"many_chunks_in_tiles": 2}  # a row's chunk partials read this many at a time (fused.CHUNK_BLOCK)


def _case(name: str, device: str = "cpu") -> None:
    """The reference on the CPU against the fused step on ``device`` (the CPU: Triton's interpreter)."""
    from rollout_guard.detector import fused

    rows, length, seed, offset, warm, *tolerance = CASES[name]
    tolerance = tolerance[0] if tolerance else None
    reference = Detector(tolerance=tolerance)
    for step in range(warm):
        engine, trainer, mask = _batch(rows, length, 100 + step, offset)
        reference.update(reference.judge(engine, trainer, mask).kept_counts)
    candidate = Detector(tolerance=tolerance, device=device)
    candidate.load_state_dict(reference.state_dict())
    engine, trainer, mask = _batch(rows, length, seed, offset)
    injected = _corrupt(engine, trainer, mask)
    expected = reference.judge(engine, trainer, mask, injected)
    samples, histogram = summarise(RolloutEvidence(mask, engine, trainer, injected), expected)
    tiles = fused.CHUNK_BLOCK
    fused.CHUNK_BLOCK = TILES.get(name, tiles)
    try:
        got = candidate._judge_fused(engine.to(device), trainer.to(device), mask.to(device), injected.to(device))
    finally:
        fused.CHUNK_BLOCK = tiles
    got = type(got)(*(value.cpu() if isinstance(value, torch.Tensor) else value for value in got))
    assert got.reasons.tolist() == expected.reasons.tolist()
    assert got.onset.tolist() == expected.onset.tolist()
    torch.testing.assert_close(got.score, expected.score, atol=2e-3, rtol=1e-4)
    torch.testing.assert_close(got.samples, samples.double(), atol=2e-3, rtol=1e-4, equal_nan=True)
    assert torch.equal(got.delta_histogram, histogram)
    assert torch.equal(got.kept_counts, expected.kept_counts)
    torch.testing.assert_close(got.noise.centre.cpu(), expected.noise.centre)
    torch.testing.assert_close(got.noise.scale.cpu(), expected.noise.scale)
    torch.testing.assert_close(got.noise.tokens.cpu(), expected.noise.tokens)
    torch.testing.assert_close(got.growth, expected.growth, equal_nan=True)
    # the packet's order: statistics, verdict bits, |Δ| histogram, kept histogram, noise, aggregates
    width = len(fused.ROW_COLUMNS)
    torch.testing.assert_close(got.record[: rows * width], got.samples.flatten(), rtol=0, atol=0, equal_nan=True)
    assert got.record[rows * width: rows * (width + 1)].tolist() == got.reasons.double().tolist()
    noise = torch.cat([got.noise.centre.cpu(), got.noise.scale.cpu(), got.growth])
    torch.testing.assert_close(got.record[-len(AGGREGATES) - len(noise): -len(AGGREGATES)], noise.double(), rtol=0,
                               atol=0, equal_nan=True)
    # the batch's aggregates, computed on the device with the verdict
    torch.testing.assert_close(got.record[-len(AGGREGATES):], partial_aggregates(samples, expected.reasons),
                               atol=2e-3, rtol=1e-4)
    # the learned state is the same either way: the learning kernel, from one and from three processes' histograms
    state, early = candidate.counts, candidate.early_scale
    reference.update(expected.kept_counts)
    candidate.update(got.kept_counts.to(device))
    torch.testing.assert_close(candidate.counts.cpu(), reference.counts)
    torch.testing.assert_close(candidate.early_scale.cpu(), reference.early_scale)
    early_tokens = state.sum(1).max().item() + 1.0  # a region reaches it with this step's tokens: the scale recorded
    by_ranks = torch.stack([got.kept_counts, torch.zeros_like(got.kept_counts), got.kept_counts]).to(device)
    counts, scale = fused.learn_on_device(state, early, by_ranks, early_tokens)
    want_counts, want_scale = fused.learn(state.cpu(), early.cpu(), 2 * got.kept_counts, early_tokens)
    torch.testing.assert_close(counts.cpu(), want_counts)
    torch.testing.assert_close(scale.cpu(), want_scale)
    assert (want_scale != early.cpu()).any() or not got.kept_counts.any()
    assert fused.ROW_COLUMNS[COLUMN["score"]] == "score"
    suspect = (expected.reasons != 0).tolist()
    # row 7 reads none; row 3's trainer-favouring spike is kept where the batch's other corrupted rows reach as deep
    # on the engine's side this early in the run (Detector.down_reference), flagged where they do not
    assert [suspect[i] for i in (0, 1, 2, 4, 5, 6, 7, 8)] == [False] + [True] * 5 + [False, True], suspect
    assert not any(suspect[9:]), suspect
    if tolerance is not None:  # the tolerance bit on exactly the rows with a read token beyond it
        read = mask.bool() & torch.isfinite(engine) & torch.isfinite(trainer)
        beyond = (((engine - trainer).abs() > tolerance) & read).any(-1)
        assert ((got.reasons & RULE_BIT["tolerance"]) != 0).tolist() == beyond.tolist() and beyond[[1, 3, 6, 8]].all()


def _edge_bucket_case(device: str = "cpu") -> None:
    """The kernels' search-free bucketing equals ``torch.bucketize`` over the noise's edges: at every edge, one float32
    step either side of it, ±0, ±inf and values spread from 10⁻⁴ to 10³ nats either way."""
    import triton
    import triton.language as tl

    from rollout_guard.detector import _kernels, fused
    from rollout_guard.detector.noise import EDGES

    globals()["_kernels"] = _kernels  # a jitted function finds what it calls among its module's globals

    @triton.jit
    def bucket(values_ptr, edges_ptr, out_ptr, size, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < size
        tl.store(out_ptr + offsets, _kernels._edge_bucket(tl.load(values_ptr + offsets, mask=inside, other=0.0),
                                                          edges_ptr), mask=inside)

    edges = torch.tensor(EDGES, dtype=torch.float32)
    spread = torch.logspace(-4, 3, 3001)
    values = torch.cat([edges, torch.nextafter(edges, edges + 1), torch.nextafter(edges, edges - 1), spread, -spread,
                        torch.tensor([0.0, -0.0, math.inf, -math.inf])])
    want = torch.bucketize(values, edges, right=True)
    values = values.to(device)
    out = torch.empty(values.shape, dtype=torch.int32, device=device)
    bucket[(triton.cdiv(len(values), 1024),)](values, fused._constants(values.device, 1.0).edges, out, len(values),
                                              BLOCK=1024)
    assert torch.equal(out.cpu().long(), want)


def test_the_fused_step_equals_the_torch_reference_in_the_interpreter():
    """Reasons, onsets and kept histograms equal; scores and statistics within float32 rounding."""
    from tests.triton_interpreter import check_in_interpreter

    pytest.importorskip("triton")
    check_in_interpreter(__file__, [*CASES, "edge_bucket"], timeout=900)


def test_the_search_free_bucketing_equals_torch_bucketize_on_the_gpu():
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _edge_bucket_case("cuda")


@pytest.mark.parametrize("name", list(CASES))
def test_the_fused_step_equals_the_torch_reference_on_the_gpu(name: str):
    """The same, compiled, on a CUDA device."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _case(name, "cuda")


def test_a_batch_of_more_rows_than_the_fused_grid_holds_is_judged_by_the_reference_on_the_gpu():
    """Past fused.MAX_ROWS rows (CUDA's grid limit) the GPU judges with the torch reference: the same verdicts as
    the CPU's, a corrupted row among them flagged."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from rollout_guard.detector import fused

    rows = fused.MAX_ROWS + 1
    generator = torch.Generator().manual_seed(0)
    engine = -torch.rand(rows, 4, generator=generator)
    trainer = engine + 0.02 * torch.randn(rows, 4, generator=generator)
    trainer[rows - 1] = engine[rows - 1] - 12.0
    mask = torch.ones(rows, 4, dtype=torch.bool)
    want = Detector().judge(engine, trainer, mask)
    got = Detector(device="cuda").judge(engine.cuda(), trainer.cuda(), mask.cuda())
    assert got.record is None  # the reference's judgement: no fused record
    assert torch.equal(got.reasons.cpu(), want.reasons)
    assert want.reasons[rows - 1] != 0


if __name__ == "__main__":
    import functools
    import sys

    from tests.triton_interpreter import run_cases

    cases = {name: functools.partial(_case, name) for name in CASES} | {"edge_bucket": _edge_bucket_case}
    sys.exit(1 if run_cases(cases, sys.argv[1:]) else 0)
