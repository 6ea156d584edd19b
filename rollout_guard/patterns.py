"""Patterns: name what kind of disagreement a quarantined sample shows, from its per-token |Δ| and a re-scoring.

Pure functions over 1-D tensors (one sample). ``rollout-guard replay`` feeds them the stored evidence (the
recorded engine and trainer logprobs) and the re-scoring (transformers given the true prompt, and optionally a
fresh engine), and prints the result in one line. Each pattern points at a family of causes:

========================  ==========================================================================  ===============
pattern                   shape of the per-token |Δ| (recorded engine vs re-scored trainer)           causes
========================  ==========================================================================  ===============
``divergent_from_start``  high from the first tokens on, and for most of the rest; a fresh engine     state, context
                          given the prompt does not reproduce it
``isolated_spikes``       high on a few tokens (≤ ``spike_max_tokens``), low elsewhere                kernel, numeric
``late_onset``            low for the first part, then high for most of the rest                      drift, cache
                                                                                                      growth
``every_token``           high from the first tokens on, and a fresh engine given the prompt          weights, dtype
                          reproduces it
``not_reproducible``      the re-scored trainer agrees with the recorded engine on every token         trainer side at
                          (what disagreed at the step was the recorded trainer logprobs)              that step
========================  ==========================================================================  ===============

"High" means |Δ| > ``token_threshold`` nats; a NaN or ±inf engine logprob counts as high. The function reads
the tokens in order: ``onset`` is the first high token, ``persistence`` the share of high tokens from the onset
to the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PATTERNS = ("divergent_from_start", "isolated_spikes", "late_onset", "every_token", "not_reproducible")

CAUSES = {
    "divergent_from_start": "state or context (stale cache slot, wrong prompt)",
    "isolated_spikes": "kernel or numeric (overflow, precision)",
    "late_onset": "drift or cache growth",
    "every_token": "weights or dtype",
    "not_reproducible": "the trainer side at that step (other weights? pass the step's checkpoint)",
}


@dataclass(frozen=True)
class Pattern:
    name: str  # one of PATTERNS
    onset: int  # index of the first high token, −1 when none
    high_tokens: int  # tokens with |Δ| > token_threshold
    tokens: int  # tokens compared
    max_abs_delta: float  # nats
    fresh_engine_reproduces: bool | None  # None: no fresh-engine score given

    def line(self) -> str:
        """One line for a terminal, e.g.
        ``pattern: late onset (token 12 of 16, 4 high tokens, max |Δ| 6.1 nats): drift or cache growth``."""
        where = f"token {self.onset} of {self.tokens}, " if self.onset >= 0 else ""
        return (f"pattern: {self.name.replace('_', ' ')} ({where}{self.high_tokens} high tokens, "
                f"max |Δ| {self.max_abs_delta:.3g} "
                f"nats): {CAUSES[self.name]}")


def abs_delta(engine: torch.Tensor, trainer: torch.Tensor) -> torch.Tensor:
    """|engine − trainer| per token, with +inf where either logprob is NaN or ±inf.

    >>> abs_delta(torch.tensor([-0.5, float("nan")]), torch.tensor([-2.5, -0.5])).tolist()
    [2.0, inf]
    """
    delta = (engine.double() - trainer.double()).abs()
    return torch.where(torch.isfinite(delta), delta, torch.full_like(delta, math.inf))


def longest_run(flags: torch.Tensor) -> int:
    """Length of the longest run of consecutive True values in a 1-D bool tensor.

    >>> longest_run(torch.tensor([True, False, True, True, False]))
    2
    """
    edges = torch.nonzero(torch.diff(torch.nn.functional.pad(flags.int(), (1, 1)))).flatten()
    return int((edges[1::2] - edges[0::2]).max()) if edges.numel() else 0


def _nan_as_inf(values: torch.Tensor) -> torch.Tensor:
    values = values.double()
    return torch.where(torch.isnan(values), torch.full_like(values, math.inf), values)


def classify_pattern(replayed: torch.Tensor, fresh: torch.Tensor | None = None, *, token_threshold: float = 1.0,
                     spike_max_tokens: int = 3, start_tokens: int = 2, start_share: float = 0.2,
                     persistence: float = 0.5) -> Pattern:
    """Name the pattern of one sample's disagreement.

    Args:
        replayed: (T,) |Δ| per completion token between the recorded engine logprobs (the stored evidence) and
            the trainer's logprobs re-scored now given the true prompt (:func:`abs_delta`).
        fresh: (T,) |Δ| between a fresh engine's logprobs of the same tokens given the true prompt and the
            re-scored trainer's; None when no fresh engine scored them.
        token_threshold: nats; a token is high when its |Δ| exceeds this. Default 1.0 nat (clean bf16 tokens stay
            below ~0.1).
        spike_max_tokens: tokens; up to this many high tokens that are not persistent are ``isolated_spikes``,
            and so are more of them when they cover less than ``persistence`` of the tail. Default 3 (the
            selective-scan overflow of vLLM PR #35275 showed as 1–3 spikes).
        start_tokens: tokens; an onset before ``max(start_tokens, start_share · T)`` is "from the start", later
            is ``late_onset``. Default 2.
        start_share: share (0–1) of the row's T tokens, with ``start_tokens``. Default 0.2 (the fault zoo's late
            onset is the last 10–20 %).
        persistence: share (0–1) of high tokens from the onset to the end for a divergence to count as
            persistent rather than spikes. Default 0.5.

    Persistent means: high on at least ``persistence`` of the tokens from the onset on, and either more than
    ``spike_max_tokens`` high tokens, or at least two consecutive high tokens, or every token high. Otherwise the
    high tokens are isolated spikes. A fresh engine that reproduces the disagreement (high on at least half of the high
    tokens) means the prompt alone explains it (weights, dtype, kernels): a persistent one from the start is then
    ``every_token``. One that a fresh engine does not reproduce came from state at generation time
    (``divergent_from_start``, ``late_onset``); without a fresh engine the two cannot be told apart and a
    persistent disagreement from the start is reported as ``divergent_from_start``.

    >>> classify_pattern(torch.tensor([5.0, 6.0, 4.0, 7.0, 5.0])).name
    'divergent_from_start'
    >>> classify_pattern(torch.tensor([0.0, 0.0, 9.0, 0.0, 0.0, 0.0])).name
    'isolated_spikes'
    >>> classify_pattern(torch.tensor([0.0] * 8 + [4.0] * 4)).name
    'late_onset'
    >>> classify_pattern(torch.tensor([2.0] * 6), fresh=torch.tensor([2.0] * 6)).name
    'every_token'
    >>> classify_pattern(torch.tensor([0.01] * 6)).name
    'not_reproducible'
    """
    if replayed.dim() != 1:
        raise ValueError(f"replayed: expected one sample's (T,) |Δ|, got shape {tuple(replayed.shape)}")
    if fresh is not None and tuple(fresh.shape) != tuple(replayed.shape):
        raise ValueError(f"fresh: shape {tuple(fresh.shape)} does not match replayed {tuple(replayed.shape)}")
    delta = _nan_as_inf(replayed)
    tokens = delta.numel()
    high = delta > token_threshold
    high_tokens = int(high.sum())
    max_delta = float(delta.max()) if tokens else 0.0
    reproduces = None
    if fresh is not None:
        fresh_high = _nan_as_inf(fresh) > token_threshold
        reproduces = high_tokens > 0 and 2 * int((fresh_high & high).sum()) >= high_tokens

    def pattern(name: str, onset: int = -1) -> Pattern:
        return Pattern(name, onset, high_tokens, tokens, max_delta, reproduces)

    if high_tokens == 0:
        return pattern("not_reproducible")
    onset = int(high.int().argmax())
    tail = tokens - onset  # every high token is at or after the onset
    persistent = high_tokens >= persistence * tail and (
        high_tokens > spike_max_tokens or longest_run(high) >= 2 or (onset == 0 and high_tokens == tail))
    if not persistent:
        return pattern("isolated_spikes", onset)
    if onset >= max(start_tokens, start_share * tokens):
        return pattern("late_onset", onset)
    return pattern("every_token" if reproduces else "divergent_from_start", onset)
