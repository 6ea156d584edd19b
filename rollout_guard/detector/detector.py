"""The detector: per step, judge every row with one score against one threshold, then learn from the kept rows.

Stateful like a torchmetrics metric: its state is declared once (:attr:`Detector.STATE`), and reset, checkpoint and
cross-process sync follow from the declaration (every state is a sum: processes combine by adding their
contributions). A step is ``judge`` (on this process's rows, no host sync) → the caller sums the judgements'
``kept_counts`` over processes → ``update``. Design and evidence: ``docs/detector.md``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from rollout_guard.detector import fused
from rollout_guard.detector.noise import NUM_BINS, Noise, engine_favouring_cap, healthy_noise, histogram, tail_rarity
from rollout_guard.detector.score import NUM_REGIONS, region_of, row_scores

RULES = ("nonfinite_engine", "nonfinite_trainer", "ceiling", "score", "tolerance")
"""Why a row is suspect, one bit each (:data:`RULE_BIT`): a NaN/±inf logprob on either side; one token whose
|engine − trainer| exceeds the absolute ceiling; the row's score over the threshold; one token whose
|engine − trainer| exceeds the zero-tolerance bound (a stack whose engine and trainer are bitwise identical)."""
RULE_BIT = {name: 1 << index for index, name in enumerate(RULES)}
EARLY_TOKENS = 10_000.0
"""tokens: a region's own noise is recorded as its early level once it has read this many kept tokens."""
GROWTH_ALERT = 2.0
"""The multiple of a region's early noise scale past which :meth:`Detector.grown` reports it (a fault that grows
over the run, two-sided, would otherwise be learned as healthy noise)."""


class Judgement(NamedTuple):
    score: torch.Tensor  # (B,) float32 ln Λ (rollout_guard.detector.score); −inf without a read token
    onset: torch.Tensor  # (B,) int64: the token where the disagreement most likely starts; −1 without one
    excess: torch.Tensor  # (B,) float32 (float64 on CUDA): the most engine-favouring token's distance from the
    # centre, in scales
    reasons: torch.Tensor  # (B,) int32 bitmask over RULES; nonzero: suspect
    kept_counts: torch.Tensor  # (NUM_REGIONS, NUM_BINS) float64: the kept rows' d histogram, to sum over processes
    noise: Noise  # the healthy noise the rows were judged against (the run's, this batch's tokens included)
    growth: torch.Tensor  # (NUM_REGIONS,) the run's noise scale over its early level (Detector.grown)
    samples: torch.Tensor | None = None  # (B, len(fused.ROW_COLUMNS)) float64 per-row statistics, on CUDA
    delta_histogram: torch.Tensor | None = None  # (NUM_DELTA_BINS,) int64 |Δ| histogram of the read tokens, on CUDA
    record: torch.Tensor | None = None  # (fused.record_size(B),) float64, on CUDA: the packet after its head

    @property
    def suspect(self) -> torch.Tensor:
        return self.reasons != 0


class Detector:
    """Judges rows of (engine, trainer) logprobs against the run's own healthy noise.

    Args:
        false_alarm_budget: the share of healthy rows the score may flag, α; the threshold is ``ln(1/α)``.
        ceiling: nats: a token with |engine − trainer| above it flags its row whatever the noise (``None``: off).
        tolerance: nats: a token with |engine − trainer| above it flags its row under rule ``tolerance``, for an
            engine and trainer that compute bitwise-identical logprobs (``None``: off; 0.0: any difference).
        device: where the state lives (the logprobs' device).
        batch_noise: whether a batch's own tokens join the noise it is judged against (a run broken from its first
            step is judged against its own noise); ``False`` judges against the run's state alone (the prior for a
            fresh detector), for a batch too small to show any noise, such as one record replayed.

    >>> detector = Detector()
    >>> engine = torch.full((3, 20), -0.1); trainer = engine - 0.02
    >>> trainer[1, 7] = -9.3  # one token the engine favours by 9.2 nats
    >>> judgement = detector.judge(engine, trainer, torch.ones(3, 20, dtype=torch.bool))
    >>> judgement.suspect.tolist(), judgement.onset[1].item()
    ([False, True, False], 7)
    >>> detector.update(judgement.kept_counts)  # summed over processes first, with several
    >>> detector.counts.sum().item()  # the kept rows' tokens
    40.0
    """

    STATE = {"counts": (NUM_REGIONS, NUM_BINS), "early_scale": (NUM_REGIONS,)}
    """name → shape of each state tensor (float64, zeros after :meth:`reset`)."""

    def __init__(self, false_alarm_budget: float = 1e-3, ceiling: float | None = 25.0,
                 device: torch.device | str = "cpu", batch_noise: bool = True,
                 tolerance: float | None = None) -> None:
        if not 0 < false_alarm_budget < 1:
            raise ValueError(f"false_alarm_budget={false_alarm_budget}: pass a share in (0, 1), e.g. 1e-3")
        self.false_alarm_budget = false_alarm_budget
        self.threshold = math.log(1.0 / false_alarm_budget)
        self.ceiling = ceiling
        self.tolerance = tolerance
        self.batch_noise = batch_noise
        self.device = torch.device(device)
        self.reset()

    def reset(self) -> None:
        """Forget the run's noise (back to the prior): when the sampling settings or the engine change."""
        for name, shape in self.STATE.items():
            setattr(self, name, torch.zeros(shape, dtype=torch.float64, device=self.device))

    def to(self, device: torch.device | str) -> Detector:
        """Move the state to ``device`` (in place; returns self)."""
        self.device = torch.device(device)
        for name in self.STATE:
            setattr(self, name, getattr(self, name).to(self.device))
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name).detach().cpu().clone() for name in self.STATE}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, shape in self.STATE.items():
            value = torch.as_tensor(state[name], dtype=torch.float64)
            if tuple(value.shape) != shape:
                raise ValueError(f"detector state {name!r}: shape {tuple(value.shape)}, expected {shape}")
            setattr(self, name, value.to(self.device))

    def noise(self) -> Noise:
        """The run's healthy noise so far (kept rows only), shrunk towards the prior."""
        return healthy_noise(self.counts)

    def judge(self, engine: torch.Tensor | None, trainer: torch.Tensor | None, mask: torch.Tensor,
              injected: torch.Tensor | None = None) -> Judgement:
        """Judge (B, T) engine and trainer logprobs (nats) over the (B, T) loss mask; no host sync. With one side
        missing (``None``) only the other's non-finite values are judged: nothing is compared.

        The noise is the run's with this batch's tokens added (the scale reads their trainer-favouring side, which
        corruption mostly does not reach), so that a run broken from its first step is judged against its own
        noise. On a CUDA device with Triton, both sides present, the step runs fused (:mod:`.fused`) and the
        judgement also carries the rows' statistics (``injected``: (B,) labels for their column)."""
        if (engine is not None and trainer is not None and engine.dim() == 2 and engine.shape[0] > 0
                and engine.shape[0] <= fused.MAX_ROWS and engine.shape[-1] > 0 and engine.shape == trainer.shape
                and fused.available(engine.device)):
            return self._judge_fused(engine, trainer, mask, injected)
        mask = mask.bool()
        both = engine is not None and trainer is not None
        present = engine if engine is not None else trainer
        engine = engine if engine is not None else torch.zeros_like(present)
        trainer = trainer if trainer is not None else torch.zeros_like(present)
        finite_engine, finite_trainer = torch.isfinite(engine), torch.isfinite(trainer)
        read = mask & finite_engine & finite_trainer & both
        engine_read = torch.where(read, engine, torch.zeros_like(engine))
        delta = engine_read - torch.where(read, trainer, torch.zeros_like(trainer))
        region = region_of(engine_read)
        batch = histogram(delta, region, read) if self.batch_noise else torch.zeros_like(self.counts)
        counts = self.counts + batch
        noise = healthy_noise(counts)
        x = delta - noise.centre.to(delta.dtype)[region]
        scale = noise.scale.to(delta.dtype)[region]
        # a token's evidence is capped by how rare the other side shows its distance to be: an engine-favouring
        # token by the trainer-favouring side of the run and this batch (corruption does not reach it), a
        # trainer-favouring one by the engine-favouring side of the kept rows (a batch's corrupted rows, whose
        # garbage can fall on both sides, would cap one another), of this batch before the run has kept any
        mirrored = noise._replace(centre=-noise.centre)
        cap = torch.where(x > 0, engine_favouring_cap(counts, noise, region, x),
                          tail_rarity(self.down_reference(batch).flip(1), mirrored, region, x))
        scored = row_scores(x, scale, read, cap)
        reasons = (((mask & ~finite_engine).any(-1)).int() * RULE_BIT["nonfinite_engine"]
                   | ((mask & ~finite_trainer).any(-1)).int() * RULE_BIT["nonfinite_trainer"]
                   | (scored.score > self.threshold).int() * RULE_BIT["score"])
        if self.ceiling is not None:
            reasons |= ((delta.abs() > self.ceiling) & read).any(-1).int() * RULE_BIT["ceiling"]
        reasons |= self._beyond_tolerance(delta, read)
        kept = histogram(delta, region, read & (reasons == 0).unsqueeze(-1))
        return Judgement(scored.score, scored.onset, scored.excess, reasons, kept, noise, self.grown())

    def down_reference(self, batch: torch.Tensor) -> torch.Tensor:
        """(NUM_REGIONS, NUM_BINS) the histogram whose engine-favouring side caps trainer-favouring tokens: per
        region the kept state, or ``batch`` while the state holds no token there (a run's first step, or the first
        after a reset)."""
        return torch.where(self.counts.sum(1, keepdim=True) > 0, self.counts, batch)

    def _beyond_tolerance(self, delta: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
        """(B,) int32: the ``tolerance`` bit where a read token's |engine − trainer| (nats) exceeds the tolerance;
        0 everywhere when it is off."""
        if self.tolerance is None:
            return torch.zeros(delta.shape[0], dtype=torch.int32, device=delta.device)
        return ((delta.abs() > self.tolerance) & read).any(-1).int() * RULE_BIT["tolerance"]

    def _judge_fused(self, engine: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor,
                     injected: torch.Tensor | None) -> Judgement:
        step = fused.judge(engine.contiguous(), trainer.contiguous(), mask.contiguous(), injected, self.counts,
                           self.early_scale, self.threshold, self.ceiling, self.tolerance, self.batch_noise,
                           EARLY_TOKENS)
        noise = Noise(step.summary[0], step.summary[1], step.tokens)
        excess = step.samples[:, fused.ROW_COLUMNS.index("excess")]
        return Judgement(step.score, step.onset, excess, step.reasons, step.kept, noise, step.summary[2],
                         step.samples, step.delta_histogram, step.record)

    def update(self, kept_counts: torch.Tensor) -> None:
        """Learn from a step's kept tokens: ``kept_counts`` (NUM_REGIONS, NUM_BINS) summed over every process (the
        same on each), or (P, NUM_REGIONS, NUM_BINS), one per process, summed here; so that every process holds the
        same state. The state tensors are replaced, never written into: a reference taken before stays the state
        a step was judged against."""
        if fused.available(self.counts.device):  # one launch
            self.counts, self.early_scale = fused.learn_on_device(self.counts, self.early_scale, kept_counts,
                                                                  EARLY_TOKENS)
            return
        kept = kept_counts.to(self.counts)
        self.counts, self.early_scale = _learn(self.counts, self.early_scale, kept.sum(0) if kept.dim() == 3 else kept)

    def grown(self) -> torch.Tensor:
        """(NUM_REGIONS,) the run's noise scale over its early level per region (NaN before the early level is
        recorded); above :data:`GROWTH_ALERT`, the healthy noise has grown in a way a fixed stack does not."""
        return fused.growth_of(self.counts, self.early_scale)


def _learn(counts: torch.Tensor, early_scale: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return fused.learn(counts, early_scale, kept, EARLY_TOKENS)
