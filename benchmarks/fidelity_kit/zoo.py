"""The fault zoo: corruption applied to real clean rollouts, each kind modelled on a real failure.

Every function takes clean rollouts (real engine/trainer logprobs with their real numeric mismatch) and a seeded
generator and returns the same rows corrupted, all rows at once (vectorised). The clean tokens a fault does not
touch keep their real noise. Sign convention: ``d = engine − trainer`` (nats); the stale-state signature is
``d > 0`` (the engine likes what the trainer, reading the true prompt, does not).

Model-generated faults (the engine really generated from a foreign context, an earlier checkpoint, ...) come
from the data files (``fault`` column) and need no function here: ``context_swap``, ``late_onset_real``,
``stale_weights``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from benchmarks.fidelity_kit.rollouts import Rollouts


def _uniform(generator: torch.Generator, shape, low: float, high: float) -> torch.Tensor:
    return low + (high - low) * torch.rand(shape, generator=generator)


def _corrupt_span(rollouts: Rollouts, span: torch.Tensor, generator: torch.Generator, engine_low: float,
                  engine_high: float, worst_low: float, worst_high: float) -> Rollouts:
    """On the tokens in ``span``: the engine is moderately confident (logprob U(engine_low, engine_high)) and the
    trainer is d nats lower, d = 0.1 + (D − 0.1)·U² per token (most tokens a little, a few a lot; mean ≈ D/3),
    with the row's worst D ~ U(worst_low, worst_high) reached on its first corrupted token."""
    batch, width = rollouts.mask.shape
    engine_lp = _uniform(generator, (batch, width), engine_low, engine_high)
    worst = _uniform(generator, (batch, 1), worst_low, worst_high)
    gap = 0.1 + (worst - 0.1) * torch.rand((batch, width), generator=generator) ** 2
    # make sure the worst gap is reached on some token of the span (the row's stated worst |Δ|)
    first = torch.where(span.any(-1), span.int().argmax(-1), torch.zeros(batch, dtype=torch.long))
    gap.scatter_(1, first.unsqueeze(1), worst)
    engine = torch.where(span, engine_lp, rollouts.engine)
    trainer = torch.where(span, engine_lp - gap, rollouts.trainer)
    return replace(rollouts, engine=engine, trainer=trainer)


def moderate_confidence(rollouts: Rollouts, generator: torch.Generator) -> Rollouts:
    """Stale SSM state, moderately confident (what a real stale-state vLLM engine produced when tried): from the
    first token, engine logprob −2.5…−0.5 on every token, trainer 0.1…D nats lower, worst |Δ| D ~ U(2, 8)."""
    return _corrupt_span(rollouts, rollouts.mask, generator, -2.5, -0.5, 2.0, 8.0)


def confident_gibberish(rollouts: Rollouts, generator: torch.Generator) -> Rollouts:
    """Stale SSM state as AI21 saw it (vLLM PR #32118): confident gibberish from the first token. Engine logprob
    −0.7…−0.01, trainer 0.1…D nats lower, worst |Δ| D ~ U(6, 15)."""
    return _corrupt_span(rollouts, rollouts.mask, generator, -0.7, -0.01, 6.0, 15.0)


def late_onset(rollouts: Rollouts, generator: torch.Generator) -> Rollouts:
    """Corruption that starts late (cache growth, a slot recycled mid-generation): only the last 10–20 % of the
    completion's tokens are moderately-confident corruption (as :func:`moderate_confidence`)."""
    lengths = rollouts.lengths
    share = _uniform(generator, lengths.shape, 0.10, 0.20)
    onset = (lengths.float() * (1 - share)).floor().long().clamp(max=(lengths - 1).clamp(min=0))
    positions = torch.arange(rollouts.mask.shape[1]).unsqueeze(0)
    span = rollouts.mask & (positions >= onset.unsqueeze(1))
    return _corrupt_span(rollouts, span, generator, -2.5, -0.5, 2.0, 8.0)


def isolated_spikes(rollouts: Rollouts, generator: torch.Generator) -> Rollouts:
    """An integer overflow in the selective-scan kernel (vLLM PR #35275): 1–3 isolated tokens whose engine
    computation is garbage. On those tokens |Δ| ~ U(3, 15) nats; in 3 of 4 spikes the engine is confident
    (logprob −1.5…0) about a token the trainer finds unlikely, in 1 of 4 the engine reports a garbage low logprob
    for a token the trainer finds likely. Other tokens keep their real noise."""
    batch, width = rollouts.mask.shape
    count = torch.randint(1, 4, (batch,), generator=generator)
    scores = torch.rand((batch, width), generator=generator).masked_fill(~rollouts.mask, -1.0)
    rank = scores.argsort(dim=-1, descending=True).argsort(dim=-1)
    spikes = rollouts.mask & (rank < count.unsqueeze(1))
    size = _uniform(generator, (batch, width), 3.0, 15.0)
    engine_up = torch.rand((batch, width), generator=generator) < 0.75
    confident = _uniform(generator, (batch, width), -1.5, 0.0)
    engine = torch.where(spikes & engine_up, confident, rollouts.engine)
    trainer = torch.where(spikes & engine_up, confident - size, rollouts.trainer)
    engine = torch.where(spikes & ~engine_up, (rollouts.trainer - size), engine)
    return replace(rollouts, engine=engine, trainer=trainer)


def single_spike(rollouts: Rollouts, generator: torch.Generator) -> Rollouts:
    """The hardest case of :func:`isolated_spikes`: exactly one spike of 3–15 nats, engine-confident direction."""
    batch, width = rollouts.mask.shape
    scores = torch.rand((batch, width), generator=generator).masked_fill(~rollouts.mask, -1.0)
    spike = torch.nn.functional.one_hot(scores.argmax(-1), width).bool() & rollouts.mask
    size = _uniform(generator, (batch, width), 3.0, 15.0)
    confident = _uniform(generator, (batch, width), -1.5, 0.0)
    return replace(rollouts, engine=torch.where(spike, confident, rollouts.engine),
                   trainer=torch.where(spike, confident - size, rollouts.trainer))


def nonfinite(rollouts: Rollouts, generator: torch.Generator) -> Rollouts:
    """A kernel that returns NaN or ±inf for one token's engine logprob (overflow, a bad softmax)."""
    batch, width = rollouts.mask.shape
    scores = torch.rand((batch, width), generator=generator).masked_fill(~rollouts.mask, -1.0)
    where = torch.nn.functional.one_hot(scores.argmax(-1), width).bool() & rollouts.mask
    kind = torch.randint(0, 3, (batch, 1), generator=generator)
    bad = torch.tensor([float("nan"), float("inf"), float("-inf")])[kind].expand(batch, width)
    return replace(rollouts, engine=torch.where(where, bad, rollouts.engine))


def truncated_gibberish(rollouts: Rollouts, generator: torch.Generator, max_tokens: int | None = None) -> Rollouts:
    """Stale-state gibberish that never emits EOS: the row runs to the length limit (``max_tokens``, default the
    batch's widest row) and every token is moderately-confident corruption. Marked truncated, so a trainer with
    ``mask_truncated_completions=True`` drops it from the loss but its reward still sets its group's baseline."""
    width = max_tokens or rollouts.mask.shape[1]
    widened = rollouts.widened(width)
    batch = widened.mask.shape[0]
    # the clean row's own noise, tiled to the full length, under the corruption
    lengths = widened.lengths.clamp(min=1)
    source = torch.arange(width).unsqueeze(0) % lengths.unsqueeze(1)
    base = replace(widened, mask=torch.ones(batch, width, dtype=torch.bool),
                   engine=widened.engine.gather(1, source), trainer=widened.trainer.gather(1, source),
                   truncated=torch.ones(batch, dtype=torch.bool))
    return _corrupt_span(base, base.mask, generator, -2.5, -0.3, 2.0, 8.0)


SYNTHETIC_FAULTS = {
    "confident_gibberish": confident_gibberish,
    "moderate_confidence": moderate_confidence,
    "late_onset": late_onset,
    "isolated_spikes": isolated_spikes,
    "single_spike": single_spike,
    "nonfinite": nonfinite,
    "truncated_gibberish": truncated_gibberish,
}
"""Fault name → function. ``single_spike`` is the deliberately hard corner of ``isolated_spikes``."""
