"""The probability mass an engine's sampling support keeps: what puts the trainer on the engine's footing.

vLLM reports *processed* logprobs (``logprobs_mode="processed_logprobs"``, what TRL asks for): the logprob of the
sampled token under the distribution it sampled from, renormalised over the tokens that min-p, top-k and top-p
kept. The trainer scores the whole vocabulary. On a clean token the two then differ by ``−log Z``, ``Z`` the
probability mass of the kept support, which varies token by token (a flat distribution keeps little under
top-k) and is noise the detector would otherwise have to learn as its centre. Subtracting the trainer's own
``log Z`` from its logprob compares both sides on the same support: ``d = engine − (trainer − log Z)``.

Pure math only; computing ``Z`` from a trainer's hidden states without an extra forward pass is the TRL adapter's
(``rollout_guard.integrations.trl.support``).
"""

from __future__ import annotations

import functools
import math

import torch

TIES = 8  # tokens tied with the k-th logit that top-k alone counts beyond the k (a topk of k + TIES)


def kept_log_mass(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                  total: torch.Tensor | None = None) -> torch.Tensor:
    """``log Z``: the log of the probability mass of the tokens vLLM's sampler keeps, per position.

    With ``p = softmax(logits)`` over the last dimension (the logits already divided by the temperature), in
    vLLM's order (``vllm/v1/sample/sampler.py``): min-p keeps ``p_i ≥ min_p · max_j p_j``; top-k keeps the logits
    at least the k-th largest (ties kept); top-p, on the distribution renormalised over what is left, drops the
    least likely tokens whose cumulative mass is at most ``1 − top_p`` (the most likely token is always kept).
    ``log Z = logsumexp(logits[kept]) − logsumexp(logits) ≤ 0``; 0 when nothing is cut (``top_k = 0`` or at least
    the vocabulary, ``top_p = 1``, ``min_p = 0``). The engine's processed logprob of a kept token is
    ``log p_i − log Z``. Cost per position: with ``top_k`` a ``topk`` of the vocabulary (top-p then acts on the
    k values); top-p without top-k sorts the vocabulary. vLLM keeps every token tied with the k-th logit: top-k
    alone counts up to :data:`TIES` of them beyond the k (from a ``topk`` of k + TIES), top-k with top-p none
    (a tied token's mass is the k-th one's, ≲ 1/k of the kept mass).

    Args:
        logits: ``(..., V)`` logits at the sampling temperature (any float dtype; computed in float32). With
            ``top_k > 0`` and ``total`` given, the largest ``min(top_k + TIES, V)`` of them suffice (in any order):
            every rule then acts on those alone (what :func:`rollout_guard.integrations.trl.support.token_log_mass`
            passes, from a ``topk`` of the LM head's own output).
        top_k: keep the k most likely tokens; 0 (or ≥ V) keeps all.
        top_p: keep the smallest most-likely set holding at least this mass; 1.0 keeps all.
        min_p: keep tokens at least this fraction of the most likely one's probability; 0.0 keeps all.
        total: ``logsumexp(logits)`` over the last dimension where the caller has it already (one pass saved).

    Returns:
        ``(...)`` float32, nats, ≤ 0.

    Example: probabilities 0.5, 0.3, 0.2; top-2 keeps 0.8, top-p 0.6 keeps 0.5 + 0.3 (0.5 alone is < 0.6):

    >>> logits = torch.tensor([0.5, 0.3, 0.2]).log()
    >>> round(float(kept_log_mass(logits, top_k=2).exp()), 4), round(float(kept_log_mass(logits, top_p=0.6).exp()), 4)
    (0.8, 0.8)
    >>> round(float(kept_log_mass(logits, top_p=0.5).exp()), 4), float(kept_log_mass(logits))
    (0.5, 0.0)
    >>> round(float(kept_log_mass(logits, min_p=0.5).exp()), 4)  # 0.2 < 0.5 · 0.5: cut
    0.8
    """
    logits = logits.float()
    vocabulary = logits.shape[-1]
    total = torch.logsumexp(logits, dim=-1) if total is None else total
    if top_k >= vocabulary:
        top_k = 0
    if top_k <= 0 and top_p >= 1.0 and min_p <= 0.0:
        return torch.zeros_like(total)
    floor = logits.amax(dim=-1, keepdim=True) + math.log(min_p) if min_p > 0.0 else None  # min-p: logit ≥ this
    ties = None
    if top_k > 0:  # top-k, then top-p among the k: no sort of the vocabulary
        if top_p >= 1.0:  # vLLM keeps the tokens tied with the k-th logit: count up to TIES beyond the k
            values = logits.topk(min(top_k + TIES, vocabulary), dim=-1).values
            kth = values[..., top_k - 1 : top_k]
            ties = (values[..., top_k:] == kth).sum(dim=-1, keepdim=True).float().log() + kth  # −inf: none
            if floor is not None:
                ties = ties.masked_fill(kth < floor, -math.inf)
            ordered = values[..., :top_k]
        else:
            ordered = logits.topk(top_k, dim=-1).values.flip(-1)  # ascending, as vLLM's apply_top_k_top_p
    else:
        ordered = logits.sort(dim=-1).values if top_p < 1.0 else logits
    if floor is not None:
        ordered = ordered.masked_fill(ordered < floor, -math.inf)
    if top_p < 1.0:
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        cut = cumulative <= 1.0 - top_p
        cut[..., -1] = False
        ordered = ordered.masked_fill(cut, -math.inf)
    kept = torch.logsumexp(ordered, dim=-1)
    if ties is not None:
        kept = torch.logaddexp(kept, ties.squeeze(-1))
    return kept - total


def scaled_logits(raw: torch.Tensor, scale: float = 1.0, softcap: float | None = None,
                  temperature: float = 1.0) -> torch.Tensor:
    """The logits at the sampling temperature from an LM head's output ``z``, in float32:

    .. math:: \\ell = \\frac{c \\tanh(s z / c)}{T}\\quad(\\text{without soft-cap: } s z / T)

    with ``s`` = ``scale`` (``logit_scale``, ``lm_head_multiplier``, ...), ``c`` = ``softcap``
    (``final_logit_softcapping``) and ``T`` = ``temperature``: a monotone map, so the largest ``z`` are the largest
    logits and a ``topk`` of ``z`` (bf16, half the bytes) selects what a ``topk`` of the logits would.

    Args:
        raw: ``(..., V)`` the head's output, any float dtype.

    Returns:
        ``(..., V)`` float32 (a new tensor).

    >>> logits = scaled_logits(torch.tensor([0.0, 2.0, 60.0]), 0.5, softcap=30.0, temperature=0.5)
    >>> [round(v, 4) for v in logits.tolist()]
    [0.0, 1.9993, 45.6957]
    """
    logits = raw.float()  # a copy when raw is not float32; otherwise cloned below before the in-place ops
    if logits.data_ptr() == raw.data_ptr():
        logits = logits.clone()
    if scale != 1.0:
        logits.mul_(scale)
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


HEAD_BLOCK = 4096  # vocabulary entries per step of the kernel's loop
HEAD_WARPS = 8


def _kernel_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _head_kernel():
    """Imported on first use (so that ``TRITON_INTERPRET=1`` set before the first call is honoured)."""
    from rollout_guard._support_kernel import head_logsumexp_rows

    return head_logsumexp_rows


def logits_logsumexp(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log S, log p(id))`` of :func:`head_logsumexp` from logits already scaled: ``(R, V)`` float32 and ``(R,)``
    int64 ids in, two ``(R,)`` float32 out.

    >>> total, own = logits_logsumexp(torch.tensor([[0.0, 1.0, 2.0]]), torch.tensor([2]))
    >>> round(float(total), 4), round(float(own.exp()), 4)
    (2.4076, 0.6652)
    """
    total = torch.logsumexp(logits, dim=-1)
    return total, logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - total


def head_logsumexp(raw: torch.Tensor, ids: torch.Tensor, scale: float = 1.0, softcap: float | None = None,
                   temperature: float = 1.0, kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of an LM head's output: ``logsumexp`` of its :func:`scaled_logits` and the log-probability of
    ``ids`` under them,

    .. math:: \\log S = \\log \\sum_v e^{\\ell_v}, \\qquad \\log p(\\textit{id}) = \\ell_{\\textit{id}} - \\log S

    On CUDA with Triton: one pass over ``raw`` per row (a running max and sum, Milakov & Gimelshein's online
    softmax), with no float32 copy of the logits (the torch path makes one, then reads it twice); elsewhere, or
    with ``kernel=False``, :func:`scaled_logits` and ``torch.logsumexp``. ``kernel=True`` forces the kernel (on the
    CPU only under ``TRITON_INTERPRET=1``, as the tests run it).

    Args:
        raw: ``(R, V)`` the head's output, any float dtype; rows contiguous.
        ids: ``(R,)`` int64 token ids in ``[0, V)``.

    Returns:
        ``(log S, log p(id))``, both ``(R,)`` float32.

    >>> raw = torch.tensor([[0.0, 1.0, 2.0], [3.0, 3.0, 3.0]])
    >>> total, own = head_logsumexp(raw, torch.tensor([2, 0]), kernel=False)
    >>> [round(v, 4) for v in total.tolist()], [round(v, 4) for v in own.exp().tolist()]
    ([2.4076, 4.0986], [0.6652, 0.3333])
    """
    if kernel is None:
        kernel = raw.is_cuda and _kernel_available()
    if not kernel:
        return logits_logsumexp(scaled_logits(raw, scale, softcap, temperature), ids)
    rows, vocabulary = raw.shape
    if raw.stride(-1) != 1:
        raw = raw.contiguous()
    total = torch.empty(rows, dtype=torch.float32, device=raw.device)
    own = torch.empty(rows, dtype=torch.float32, device=raw.device)
    if rows:
        _head_kernel()[(rows,)](raw, ids.contiguous(), total, own, vocabulary, raw.stride(0), float(scale),
                                float(softcap) if softcap is not None else 1.0, 1.0 / float(temperature),
                                SOFTCAP=softcap is not None, BLOCK=HEAD_BLOCK, num_warps=HEAD_WARPS)
    return total, own
