"""Noise models applied on top of real clean rollouts, for the tails small models do not reach.

A small model trained for minutes agrees with itself far better than a 7B run in bf16 does; the guard must not
drop healthy samples of such runs. These models add mismatch to the *trainer* side of real clean rollouts so that
the result matches published figures of healthy runs. Sources:

* allenai/open-instruct ``docs/hybrid-rl-logprobs.md``: healthy dense 7B GRPO, per step mean |Δ| 0.06–0.11 nats
  and max 10.6–13.2 nats; healthy hybrid (recurrent + attention) 7B, mean 0.24–0.58, max ≈ 18.
* TRL #6789: bf16, top_p = 1: 7.5 % of tokens have a probability ratio outside [0.9, 1.1] (|Δ| > 0.105).
* TRL #7269: top_p = 0.8: 51.8 % of tokens outside [0.9, 1.1] (engine logprobs are renormalised over the
  top-p support, the trainer's are not).
* Measured in this project: ``top_k = 5`` on a barely trained, high-entropy policy put |Δ| ≈ 1.5 nats on every
  token (the log of the probability mass outside the top 5).

Model (``d = engine − trainer``, nats): a broad part, Gaussian with a scale that grows with the token's surprise,
``σ0 · (1 + surprise)``, ``surprise = −engine logprob`` (other shapes, :data:`SHAPES`, fitted to the same figures:
``flat``, ``σ0`` on every token; ``softmax``, ``σ0 · (1 − p)`` with ``p`` the engine's probability of the token: a
log-softmax under independent logit errors of sd σ0 moves by sd σ0 · √((1 − p)² + Σ_{j≠i} p_j²), about σ0 · (1 − p)
where the rest of the mass is spread thin; quiet on confident tokens, flat on unlikely ones), with σ0 fitted to the
fraction (dense) or the mean (hybrid) above; and a rare tail on tokens both sides find unlikely (engine logprob < −3),
±LogUniform(1, max) nats (kept below −3 nats for the trainer too: both sides find such a token unlikely), with its
rate fitted so that a step of the benchmark's size reaches the published per-step max about once; an
engine-favouring tail token lowers the trainer's logprob, a trainer-favouring one the engine's, so that the tail is
two-sided like the broad part. Non-finite logprobs stay as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from benchmarks.fidelity_kit.rollouts import Rollouts

UNLIKELY = -3.0  # nats: tokens below this engine logprob carry the rare large tail


@dataclass(frozen=True)
class TailProfile:
    name: str
    target_fraction_above_0105: float | None  # share of tokens with |Δ| > 0.105 (ratio outside [0.9, 1.1])
    target_mean: float | None  # mean |Δ| per token, nats
    tail_max: float  # nats, the largest healthy |Δ|
    tail_reach: float  # nats, the per-step max the tail should reach about once per step
    source: str
    shape: str = "surprise"  # how the broad part's scale follows the token's surprise: a key of SHAPES


DENSE_7B = TailProfile("tail_dense7b", 0.075, None, 13.2, 10.6,
                       "open-instruct hybrid-rl-logprobs.md (dense 7B), TRL #6789")
HYBRID_7B = TailProfile("tail_hybrid7b", None, 0.40, 18.0, 15.0, "open-instruct hybrid-rl-logprobs.md (hybrid 7B)")


SHAPES = {
    "surprise": lambda surprise: 1 + surprise,  # grows with the surprise: the large |Δ| on the unlikely tokens
    "flat": torch.ones_like,  # the same on every token: a flat, high-entropy policy (benchmarks/flat_noise.py)
    "softmax": lambda surprise: -torch.expm1(-surprise),  # 1 − p: quiet where the engine is sure, flat where not
}
"""The broad part's scale per token, a multiple of σ0, from the token's surprise (−engine logprob, ≥ 0)."""


def shaped(profile: TailProfile, shape: str) -> TailProfile:
    """The profile with its broad part's scale in another shape of :data:`SHAPES` (fitted to the same published
    figure), named ``<shape>_…`` instead of ``tail_…`` (the benchmark's ``--noise-shape``; ``surprise``: as it
    is)."""
    if shape not in SHAPES:
        raise ValueError(f"noise shape {shape!r}: use one of {', '.join(SHAPES)}")
    return profile if shape == "surprise" else replace(profile, name=profile.name.replace("tail_", f"{shape}_"),
                                                        shape=shape)


def _bisect(function, low: float, high: float, target: float, iterations: int = 30) -> float:
    for _ in range(iterations):
        middle = math.sqrt(low * high)
        if function(middle) < target:
            low = middle
        else:
            high = middle
    return math.sqrt(low * high)


def fit_heavy_tail(clean: Rollouts, generator: torch.Generator, profile: TailProfile, step_rows: int) -> dict:
    """Fit the profile's two parameters on clean rollouts: σ0 of the broad part (to the published share above
    0.105 nats or to the published mean) and the rate of the tail (reach ``tail_reach`` about once per step of
    ``step_rows`` rollouts)."""
    mask = clean.mask
    if len(clean) > 4096:  # the fit needs a sample of tokens, not all of them
        sample = clean.rows(torch.randperm(len(clean), generator=generator)[:4096])
        mask, surprise, base = sample.mask, (-sample.engine).clamp(min=0.0), sample.engine - sample.trainer
    else:
        surprise, base = (-clean.engine).clamp(min=0.0), clean.engine - clean.trainer
    normal = torch.randn(mask.shape, generator=generator)
    scale = SHAPES[profile.shape](surprise)

    def with_sigma(sigma: float) -> torch.Tensor:
        return base + sigma * scale * normal

    if profile.target_fraction_above_0105 is not None:
        sigma = _bisect(lambda s: float((with_sigma(s).abs() > 0.105)[mask].float().mean()), 1e-5, 5.0,
                        profile.target_fraction_above_0105)
    else:
        sigma = _bisect(lambda s: float(with_sigma(s).abs()[mask].mean()), 1e-5, 5.0, profile.target_mean)
    unlikely = clean.mask & (clean.engine < UNLIKELY)
    mask = clean.mask
    tokens_per_step = float(mask.sum()) / max(len(clean), 1) * step_rows
    unlikely_share = float(unlikely.sum()) / max(float(mask.sum()), 1.0)
    p_above_reach = math.log(profile.tail_max / profile.tail_reach) / math.log(profile.tail_max)
    rate = min(1.0, 1.0 / max(tokens_per_step * unlikely_share * p_above_reach, 1e-9))
    return {"sigma0": sigma, "tail_rate": rate, "tail_max": profile.tail_max, "shape": profile.shape}


def heavy_tail(rollouts: Rollouts, generator: torch.Generator, fitted: dict) -> Rollouts:
    """Rollouts plus healthy mismatch with the fitted parameters: the trainer's logprob moves by the broad part
    on every token (σ0 times the fit's :data:`SHAPES` scale, ``1 + surprise`` unless said) and by
    ±LogUniform(1, tail_max) nats on a rare token both sides find unlikely."""
    mask = rollouts.mask
    surprise = (-rollouts.engine).clamp(min=0.0)
    normal = torch.randn(mask.shape, generator=generator)
    shift = fitted["sigma0"] * SHAPES[fitted.get("shape", "surprise")](surprise) * normal
    hit = mask & (rollouts.engine < UNLIKELY) & (torch.rand(mask.shape, generator=generator) < fitted["tail_rate"])
    size = torch.exp(torch.rand(mask.shape, generator=generator) * math.log(fitted["tail_max"]))
    sign = torch.where(torch.rand(mask.shape, generator=generator) < 0.5, -1.0, 1.0)
    shift = torch.where(hit, sign * size, shift)
    trainer = (rollouts.trainer - shift).clamp(max=-1e-6)
    # a healthy tail token stays unlikely for both sides (the published large |Δ| sit on such tokens): an
    # engine-favouring one lowers the trainer's logprob, a trainer-favouring one the engine's, so that the tail is
    # two-sided, as the real engines' healthy mismatch is (docs/detector.md)
    down = hit & (sign < 0)
    trainer = torch.where(hit & ~down, trainer.clamp(max=UNLIKELY), torch.where(down, rollouts.trainer, trainer))
    engine = torch.where(down, rollouts.engine - size, rollouts.engine)
    keep = mask & torch.isfinite(rollouts.trainer) & torch.isfinite(rollouts.engine)
    return replace(rollouts, trainer=torch.where(keep, trainer, rollouts.trainer),
                   engine=torch.where(keep, engine, rollouts.engine))


def describe(rollouts: Rollouts) -> dict:
    """Achieved mismatch of clean rollouts: mean |Δ|, share above 0.105 nats, max (nats)."""
    finite = rollouts.mask & torch.isfinite(rollouts.engine) & torch.isfinite(rollouts.trainer)
    achieved = (rollouts.engine - rollouts.trainer).abs()[finite]
    return {"mean_abs_delta": float(achieved.mean()), "share_above_0.105": float((achieved > 0.105).float().mean()),
            "max_abs_delta": float(achieved.max())}


SUPPORT_MASS_ERROR = 0.025  # nats: sd of the trainer's log-mass error in the top_k = 5 model on the engine's support
SUPPORT_ERROR_SCALE = 1.0  # multiplies both stand-in errors (a sensitivity knob)


def topk_high_entropy(rollouts: Rollouts, generator: torch.Generator, same_support: bool = False) -> Rollouts:
    """An early, high-entropy policy sampled with ``top_k = 5``: both sides' logprobs are 1–3 nats lower (a flatter
    policy), and the engine's are renormalised over the kept top-5 mass m ~ U(0.15, 0.4), i.e. raised by
    −log m ≈ 0.9–1.9 nats (never above 0). No corruption: every row is clean. ``same_support``: the trainer's are
    renormalised too, over its own reading of that mass, m · exp(ε) with ε ~ N(0, 0.025 nats) (the H200 rollouts'
    engine-vs-trainer spread on one support is 0.014–0.025 nats per token), as the TRL adapter's
    ``compare_on_engine_support`` does."""
    mask = rollouts.mask
    flatten = 1.0 + 2.0 * torch.rand(mask.shape, generator=generator)
    kept_mass = 0.15 + 0.25 * torch.rand(mask.shape, generator=generator)
    engine = (rollouts.engine - flatten - torch.log(kept_mass)).clamp(max=-0.01)
    trainer = rollouts.trainer - flatten
    if same_support:
        error = SUPPORT_ERROR_SCALE * SUPPORT_MASS_ERROR * torch.randn(mask.shape, generator=generator)
        trainer = (trainer - torch.log(kept_mass) + error).clamp(max=-0.01)  # a renormalised logprob is ≤ 0 too
    keep = mask & torch.isfinite(rollouts.trainer) & torch.isfinite(rollouts.engine)
    engine = torch.where(keep, engine, rollouts.engine)
    trainer = torch.where(keep, trainer, rollouts.trainer)
    return replace(rollouts, engine=engine, trainer=trainer)


def on_engine_support(rollouts: Rollouts, engine_raw: torch.Tensor, generator: torch.Generator) -> Rollouts:
    """The trainer's logprobs renormalised over the engine's kept support, ``trainer − log Z`` (what the TRL
    adapter judges with ``compare_on_engine_support``). The rollouts record the *engine's* ``log Z`` (processed
    minus raw logprob of the same decode step), not the trainer's: it stands in for it, plus a Gaussian error with
    the sd of the condition's own engine-vs-trainer logprobs on one support (raw − trainer; 0.014–0.025 nats on the
    H200 rollouts) on every token the support cut. The benchmark applies it to its top-k conditions only (as the
    adapter), where every row is clean; a model-generated faulty row would get its faulty engine's ``log Z``."""
    ok = rollouts.mask & torch.isfinite(rollouts.engine) & torch.isfinite(rollouts.trainer) & torch.isfinite(engine_raw)
    spread = (engine_raw - rollouts.trainer)[ok]
    sd = float(spread.std()) if spread.numel() > 1 else 0.0
    offset = (rollouts.engine - engine_raw).clamp(min=0.0)
    error = SUPPORT_ERROR_SCALE * sd * torch.randn(rollouts.mask.shape, generator=generator) * (offset > 0)
    return replace(rollouts, trainer=torch.where(ok, rollouts.trainer + offset + error, rollouts.trainer))
