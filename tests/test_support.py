"""``kept_log_mass`` against vLLM's own sampler code: the mass of what its min-p, top-k and top-p leave."""

from __future__ import annotations

import math

import pytest
import torch

from rollout_guard.support import kept_log_mass


def vllm_kept_log_mass(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The log-mass of the tokens vLLM 0.31's sampler leaves finite (its min-p processor's rule, then its PyTorch
    top-k/top-p), relative to the whole vocabulary."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    processed = logits.clone()
    if min_p > 0:  # vllm/v1/sample/logits_processor/builtin.py, MinPLogitsProcessor.apply
        probabilities = processed.softmax(dim=-1)
        invalid = probabilities < probabilities.amax(dim=-1, keepdim=True) * min_p
        processed = processed.masked_fill(invalid, -math.inf)
    k = torch.full((logits.shape[0],), top_k) if top_k > 0 else None
    p = torch.full((logits.shape[0],), top_p) if top_p < 1 else None
    processed = apply_top_k_top_p_pytorch(processed, k, p)
    return torch.logsumexp(processed, dim=-1) - torch.logsumexp(logits, dim=-1)


@pytest.mark.parametrize("top_k, top_p, min_p", [(5, 1.0, 0.0), (20, 1.0, 0.0), (0, 0.9, 0.0), (0, 0.8, 0.0),
                                                  (20, 0.9, 0.0), (0, 1.0, 0.05), (50, 0.95, 0.02), (1, 1.0, 0.0)])
@pytest.mark.parametrize("scale", [0.5, 3.0])  # flat and peaked distributions
def test_matches_vllm(top_k, top_p, min_p, scale):
    pytest.importorskip("vllm")
    generator = torch.Generator().manual_seed(top_k * 100 + int(top_p * 1000) + int(scale * 10))
    logits = scale * torch.randn(64, 1000, generator=generator)
    ours = kept_log_mass(logits, top_k=top_k, top_p=top_p, min_p=min_p)
    theirs = vllm_kept_log_mass(logits, top_k, top_p, min_p)
    assert ours.shape == (64,)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert bool((ours <= 0).all()) and bool((ours < 0).any())  # a mass, and something is cut


def test_nothing_cut_is_zero_and_shapes_follow():
    logits = torch.randn(2, 3, 7)
    assert torch.equal(kept_log_mass(logits), torch.zeros(2, 3))
    assert torch.equal(kept_log_mass(logits, top_k=7), torch.zeros(2, 3))  # k = V keeps everything
    assert kept_log_mass(logits, top_k=2).shape == (2, 3)


def test_borderline_top_p_keeps_the_crossing_token():
    """Probabilities 0.5, 0.3, 0.2: top_p = 0.5 keeps 0.5 alone (its mass reaches p); a hair above needs 0.3 too."""
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    assert float(kept_log_mass(logits, top_p=0.5).exp()) == pytest.approx(0.5, abs=1e-6)
    assert float(kept_log_mass(logits, top_p=0.5001).exp()) == pytest.approx(0.8, abs=1e-6)
    assert float(kept_log_mass(logits, top_p=0.8001).exp()) == pytest.approx(1.0, abs=1e-6)


def test_ties_at_the_kth_logit_are_kept():
    logits = torch.tensor([2.0, 1.0, 1.0, 0.0])
    expected = torch.logsumexp(logits[:3], 0) - torch.logsumexp(logits, 0)
    torch.testing.assert_close(kept_log_mass(logits, top_k=2), expected)


@pytest.mark.parametrize("top_k", [5, 20, 50])
def test_bf16_logits_with_ties_at_the_kth_match_vllm(top_k):
    """bf16 logits (what a bf16 LM head gives) tie often; vLLM keeps every token tied with the k-th logit."""
    pytest.importorskip("vllm")
    logits = (2.0 * torch.randn(256, 2000, generator=torch.Generator().manual_seed(top_k))).bfloat16().float()
    kth = logits.topk(top_k, dim=-1).values[:, -1:]
    assert int(((logits == kth).sum(dim=-1) > 1).sum()) > 10, "the case must have ties at the k-th logit"
    torch.testing.assert_close(kept_log_mass(logits, top_k=top_k), vllm_kept_log_mass(logits, top_k, 1.0, 0.0),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("top_k, top_p, min_p", [(5, 1.0, 0.0), (20, 0.9, 0.0), (5, 0.9, 0.05), (3, 1.0, 0.2)])
def test_the_top_values_of_the_head_output_give_the_full_logits_mass(top_k, top_p, min_p):
    """What the TRL hook passes: a ``topk`` of the head's raw output (bf16 ties included), scaled afterwards, with
    the full logsumexp given, equals kept_log_mass of the full scaled logits (the map is monotone)."""
    from rollout_guard.support import TIES, head_logsumexp, scaled_logits

    generator = torch.Generator().manual_seed(top_k)
    raw = (torch.randn(64, 300, generator=generator) * 3).bfloat16()
    raw[:8, :12] = raw[:8, :1]  # ties at the top, crossing the k-th place
    full = scaled_logits(raw, 0.37, softcap=5.0, temperature=0.7)
    expected = kept_log_mass(full, top_k=top_k, top_p=top_p, min_p=min_p)
    total, _ = head_logsumexp(raw, torch.zeros(64, dtype=torch.long), 0.37, softcap=5.0, temperature=0.7, kernel=False)
    top = scaled_logits(raw.topk(top_k + TIES, dim=-1).values, 0.37, softcap=5.0, temperature=0.7)
    torch.testing.assert_close(kept_log_mass(top, top_k=top_k, top_p=top_p, min_p=min_p, total=total), expected,
                               atol=1e-5, rtol=0)
    assert float(expected.max()) < -0.01  # a real cut


KERNEL_CASES = {  # name: (rows, vocabulary, dtype, scale, softcap, temperature, shift)
    # two blocks, the second partly outside the vocabulary; logits far below 0, where a lane outside that counted
    # as a logit of 0 would dominate the sum
    "plain": (4, 5000, torch.float32, 1.0, None, 1.0, -40.0),
    "scaled": (3, 4096, torch.float16, 0.37, None, 0.7, 0.0),
    "softcap": (5, 9000, torch.float32, 2.0, 30.0, 1.3, -10.0),  # logits past the cap saturate
}


def _kernel_case(name: str) -> None:
    from rollout_guard.support import head_logsumexp

    rows, vocabulary, dtype, scale, softcap, temperature, shift = KERNEL_CASES[name]
    generator = torch.Generator().manual_seed(rows)
    raw = (torch.randn(rows, vocabulary, generator=generator) * 8 + shift).to(dtype)
    ids = torch.randint(0, vocabulary, (rows,), generator=generator)
    ids[0] = vocabulary - 1  # the last entry, in the partial block
    expected = head_logsumexp(raw, ids, scale, softcap, temperature, kernel=False)
    got = head_logsumexp(raw, ids, scale, softcap, temperature, kernel=True)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-6)


def test_the_head_kernel_matches_torch_in_the_interpreter():
    """The Triton pass (online max and sum over the vocabulary) against scaled_logits + torch.logsumexp, in
    Triton's interpreter on the CPU (the device run compares it on a GPU, bf16 included)."""
    from tests.triton_interpreter import check_in_interpreter

    pytest.importorskip("triton")
    check_in_interpreter(__file__, list(KERNEL_CASES), timeout=600)


if __name__ == "__main__":
    import functools
    import sys

    from tests.triton_interpreter import run_cases

    cases = {name: functools.partial(_kernel_case, name) for name in KERNEL_CASES}
    sys.exit(1 if run_cases(cases, sys.argv[1:]) else 0)
