"""The one configuration object of the guard.

Settings are in nats (natural-log units of token probability), tokens, steps or shares (0–1), as each says. The
detector's internal constants are derived in ``docs/detector.md``; what is here is what a user decides: what to do
with a suspect rollout, how many healthy rollouts a false alarm may cost, where the guard reports and when it stops
a run.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

from rollout_guard.errors import GuardConfigError

MODES = ("monitor", "quarantine")
ON_CEILING = ("stop", "raise", "alert")


def _is_number(value: object) -> bool:
    """A real number, not a bool (``True`` is an ``int`` to Python, never a threshold here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class GuardConfig:
    """Settings of the rollout guard: what it does with a suspect rollout, how it decides, where it reports."""

    mode: str = "quarantine"
    """``"monitor"``: measure, judge and report only. ``"quarantine"``: also remove suspect samples from the loss
    (zero loss mask, excluded from their group's advantage baseline, loss normaliser corrected). Default
    ``"quarantine"``."""

    false_alarm_budget: float = 1e-3
    """share of healthy rollouts (0–1). The detector flags a rollout whose score (how much likelier its per-token
    disagreements are if the engine is off than under this run's healthy noise, ``ln Λ``) exceeds ``ln(1 /
    false_alarm_budget)``; under the healthy noise the score assumes, at most this share of healthy rollouts is
    flagged. 1e-3 matches AI21's corruption rate (about one prompt in a thousand): see ``docs/detector.md``. Default
    1e-3."""

    ceiling_delta: float | None = 25.0
    """nats. A rollout with a token whose |engine − trainer| logprob exceeds this is suspect whatever the run's
    noise (rule ``ceiling``), from the first step; healthy 7B runs reach ≈ 18 nats on tokens neither side finds
    likely (``docs/detector.md``). ``None``: off. Default 25.0."""

    tolerance_delta: float | None = None
    """nats. Zero-tolerance mode, for an engine and a trainer that compute bitwise-identical logprobs (the same
    kernels, dtype and reduction order on both sides): a rollout with a token whose |engine − trainer| logprob
    exceeds this is suspect (rule ``tolerance``), from the first step, whatever the run's noise; there any
    disagreement beyond float rounding is a bug. 0.0 flags any difference at all. Compare on one basis: with a
    top-k or min-p engine, ``compare_on_engine_support`` recomputes the trainer's side (``trainer − log Z``),
    which is then no longer bitwise the engine's. ``None``: off (the stack is not bitwise identical; the score and
    the ceiling judge it). Default None."""

    compare_on_engine_support: bool = True
    """TRL adapter, when the engine samples with top-k (with or without top-p and min-p) or with min-p alone, and no
    penalty, logit bias or guided decoding: judge the trainer's logprob renormalised over the engine's kept support,
    ``trainer − log Z`` (:mod:`rollout_guard.support`), as vLLM's processed logprobs are, instead of leaving the
    offset ``−log Z`` to the detector's per-region centre. ``Z`` comes from the trainer's own hidden states in the
    pass that computes its logprobs (a hook on the backbone, one more LM-head projection and a ``topk`` of the
    vocabulary per completion token; no extra forward pass, no host sync; ``benchmarks/support_overhead.py``). A
    token whose recomputed logprob differs from TRL's by more than 0.1 nat keeps ``log Z = 0``; a failure in the hook
    on any process turns the option off for the run on every process (that step is not judged, one
    ``guard_failures``, and the detector's noise starts over). Top-p alone stays with the centre: its offset is at
    most ``−log top_p``. Under top-k the offset varies token by token, far more than the engine-vs-trainer noise on
    one support (``docs/detector.md``). Default True."""

    compute_trainer_logprobs: bool = True
    """When there are engine logprobs but the trainer did not compute its own logprobs of the sampled tokens (TRL
    with ``vllm_importance_sampling_correction=False``), run one extra no-grad forward pass to get them (one forward
    pass over the generation batch per generation step); with ``mask_truncated_completions``, also the pass over
    the truncated rows whose trainer logprobs TRL computed under a zero mask (those rows only). ``False``: no extra
    pass; without trainer logprobs the guard then checks non-finite engine logprobs only. Never used without an
    engine (``use_vllm=False``, no ``rollout_func``): rollouts from the trainer's own model have nothing to
    disagree with, so no pass is run there. Default True (the detector compares both sides)."""

    output_dir: str | None = None
    """Folder for the guard's local files (metrics, quarantine store, charts). ``None``: the trainer's
    ``output_dir`` + ``/rollout_guard``. Default None."""

    evidence_samples_per_step: int = 16
    """samples per step. Full evidence (token ids, decoded prompt, completion and tokens, engine and trainer
    logprobs per token) is recorded for at most this many suspect samples per step, the worst first: by the most
    severe rule that fired, in the verdict's rule order (non-finite values, then the absolute ceiling, then the
    score), then by score (highest first), then by rollout index. Every other suspect sample still gets
    a record with its statistics, rules and rewards but no tokens (``full_evidence`` false), so counts cover all.
    0 records no tokens at all. Bounds the per-step cost of decoding and writing: a full record of a 16,384-token
    completion is ~1 MB of JSON, so a step writes at most ~16 MB however many samples are suspect (half the batch
    can be, under the circuit breaker's default); 16 also covers the HTML report's 10 worst samples and W&B's
    worst-sample chart. Default 16."""

    chart_every_steps: int = 25
    """steps. Redraw the local spike chart every this many guarded steps (and at the end of training).
    Default 25."""

    image_every_steps: int = 50
    """steps. Charts sent to W&B as images (spike chart, worst sample token by token) at least every this many
    steps. Default 50."""

    spike_image_min_gap_steps: int = 10
    """steps. On a step with suspect samples, images are sent again only if the last ones are at least this old,
    so a run full of spikes does not send an image per step. Default 10."""

    alert_jump: float = 3.0
    """× baseline. An alert fires when the quarantined share or the max |Δ| exceeds this multiple of its running
    baseline (an exponential moving average over past steps). Default 3.0."""

    alert_min_share: float = 0.02
    """share of rollouts (0–1). The quarantine-rate alert also needs at least this share in the step, so one
    sample in a large batch does not page anyone (it is still quarantined and tabled). Default 0.02."""

    alert_baseline_steps: int = 50
    """steps. Horizon of the running baselines (EMA weight 2 / (n + 1)). Default 50."""

    alert_cooldown_steps: int = 100
    """steps. At most one alert of each kind per this many steps. Default 100."""

    max_quarantine_share: float | None = 0.5
    """share of a step's rollouts (0–1). Circuit breaker: when more than this share of a step's rollouts is
    suspect for ``ceiling_steps`` steps in a row, the engine is broken rather than one sample, and the guard
    acts as ``on_ceiling`` says (in monitor mode it only alerts). Default 0.5."""

    ceiling_steps: int = 1
    """steps. Consecutive steps above ``max_quarantine_share`` before the circuit breaker trips. Default 1."""

    on_ceiling: str = "stop"
    """``"stop"``: end training cleanly after the current step (its update done), then raise
    ``CircuitBreakerTripped`` (a ``GuardError``) from ``trainer.train()``, saying why, once the guard's records and
    summary are written, so that a script or pipeline cannot mistake the stop for success. ``"raise"``: raise
    ``CircuitBreakerTripped`` at once, inside the step that tripped (its batch is not trained on), once the guard's
    records and summary are written. ``"alert"``: send an error-level alert (at most once per
    ``alert_cooldown_steps``) and go on. In monitor mode the breaker always only alerts. Default ``"stop"``."""

    strict: bool = False
    """``True``: any failure inside the guard raises and stops training. ``False``: a failure is logged,
    counted (``guard_failures``) and sent as an error-level ``guard_failure`` alert, the step's batch passes through
    unguarded (metric ``guarded`` 0), and training goes on up to ``max_consecutive_failures``. Structural
    input errors on the first guarded step raise in both cases: they mean the guard is wired wrong. A failure
    beside the verdict (writing records, decoding, a sink) with several processes is raised on every process at
    the next step's judgement, carried in its gather (raised on one process only, it left the others waiting in
    the loss's collectives); after the last step, at the end of training on the failing process. Default
    False."""

    max_consecutive_failures: int | None = 10
    """steps. With ``strict=False``, this many steps in a row that the guard could not judge (each passed through
    unguarded, each sent as an error-level ``guard_failure`` alert, throttled like the others, and marked
    ``guarded`` 0 in the step's metrics) raise ``GuardError`` on every process: a guard that fails every step has
    stopped guarding. ``None``: never raise for failures (each is still counted and charted). Default 10."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise GuardConfigError("mode", self.mode, f"use one of {MODES}")
        if not (_is_number(self.false_alarm_budget) and 0 < self.false_alarm_budget < 1):
            raise GuardConfigError("false_alarm_budget", self.false_alarm_budget,
                                   "use a share of healthy rollouts in (0, 1), e.g. 1e-3")
        if self.ceiling_delta is not None and not (_is_number(self.ceiling_delta) and self.ceiling_delta > 0
                                                   and math.isfinite(self.ceiling_delta)):
            raise GuardConfigError("ceiling_delta", self.ceiling_delta,
                                   "use a positive finite number of nats, or None to turn the ceiling off")
        if self.tolerance_delta is not None and not (_is_number(self.tolerance_delta) and self.tolerance_delta >= 0
                                                     and math.isfinite(self.tolerance_delta)):
            raise GuardConfigError("tolerance_delta", self.tolerance_delta,
                                   "use a finite number of nats ≥ 0 (0.0: any difference), or None for no zero "
                                   "tolerance")
        if not isinstance(self.compare_on_engine_support, bool):
            raise GuardConfigError("compare_on_engine_support", self.compare_on_engine_support, "use True or False")
        if not isinstance(self.compute_trainer_logprobs, bool):
            raise GuardConfigError("compute_trainer_logprobs", self.compute_trainer_logprobs, "use True or False")
        if self.output_dir is not None and not isinstance(self.output_dir, (str, os.PathLike)):
            raise GuardConfigError("output_dir", self.output_dir, "use a folder path (str or pathlib.Path), or None")
        if not (isinstance(self.evidence_samples_per_step, int) and not isinstance(self.evidence_samples_per_step, bool)
                and self.evidence_samples_per_step >= 0):
            raise GuardConfigError("evidence_samples_per_step", self.evidence_samples_per_step,
                                   "use a whole number of samples ≥ 0 (0: statistics only, no tokens)")
        for name in ("chart_every_steps", "image_every_steps", "spike_image_min_gap_steps", "alert_baseline_steps",
                     "alert_cooldown_steps"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise GuardConfigError(name, value, "use a whole number of steps ≥ 1")
        if self.max_quarantine_share is not None and not (
            _is_number(self.max_quarantine_share) and 0.0 < self.max_quarantine_share <= 1.0
        ):
            raise GuardConfigError("max_quarantine_share", self.max_quarantine_share,
                                   "use a share in (0, 1], or None to turn the breaker off")
        if not (isinstance(self.ceiling_steps, int) and not isinstance(self.ceiling_steps, bool)
                and self.ceiling_steps >= 1):
            raise GuardConfigError("ceiling_steps", self.ceiling_steps, "use a whole number of steps ≥ 1")
        if self.on_ceiling not in ON_CEILING:
            raise GuardConfigError("on_ceiling", self.on_ceiling, f"use one of {ON_CEILING}")
        if not isinstance(self.strict, bool):
            raise GuardConfigError("strict", self.strict, "use True or False")
        if self.max_consecutive_failures is not None and not (
            isinstance(self.max_consecutive_failures, int) and not isinstance(self.max_consecutive_failures, bool)
            and self.max_consecutive_failures >= 1
        ):
            raise GuardConfigError("max_consecutive_failures", self.max_consecutive_failures,
                                   "use a whole number of steps ≥ 1, or None to never stop for guard failures")
        if not (_is_number(self.alert_jump) and math.isfinite(self.alert_jump) and self.alert_jump >= 1.0):
            raise GuardConfigError("alert_jump", self.alert_jump,
                                   "use a factor ≥ 1 (3.0 alerts at three times the baseline)")
        if not (_is_number(self.alert_min_share) and 0.0 <= self.alert_min_share <= 1.0):
            raise GuardConfigError("alert_min_share", self.alert_min_share, "use a share between 0 and 1")

    @property
    def quarantines(self) -> bool:
        return self.mode == "quarantine"

    def to_dict(self) -> dict:
        return {field.name: getattr(self, field.name) for field in fields(self)}
