"""Self-calibration: the run's own healthy engine-vs-trainer mismatch, per engine-logprob bucket.

Like a torchmetrics metric, this object owns its state and its sync: every step the guard adds the
contributions of the samples it kept (never the suspect ones), summed over all processes inside the guard's one
gather, so every rank holds the same state; it is saved and restored with checkpoints. From the state come, per
bucket of the engine's logprob (:data:`rollout_guard.statistics.ENGINE_BUCKET_EDGES`):

* the centre of ``d = engine − trainer``: the mean of ``clip(d − centre_then, −1, 4)`` over kept tokens, added to
  the centre in use when they were judged. It absorbs the systematic offset of processed logprobs (top-k/top-p
  renormalisation makes ``d ≈ −log(kept mass) ≥ 0`` on every token) and of a run's dtype;
* the drift allowance: the larger of ``drift_allowance`` and ``σ² · ln(1000 · L / false_alarm_budget) / (2 h)``,
  with σ² the variance of healthy ``clip(x)`` in the bucket, L the mean tokens per sample and h the drift
  threshold. A one-sided CUSUM with allowance a over increments of spread σ crosses h in one excursion with
  probability ≈ exp(−2ah/σ²) (Siegmund's approximation), and a sample has at most ~L excursions, so a noisy bucket
  (healthy hybrid runs, low-probability tokens) gets a larger allowance and a quiet one keeps the configured one;
* the spike threshold: the ``1 − α`` quantile of healthy ``|x|``, ``x = d − centre``, over the bucket's spike
  candidates (tokens at least one side found likely), with ``α = false_alarm_budget / 1000 / (candidates per
  sample)`` so that the expected number of false ``directional_spike`` firings stays within the budget; never
  below ``GuardConfig.spike_excess``.

Until a bucket has ``calibration_warmup_tokens`` kept tokens, the fixed thresholds apply (centre 0, the warm-up
allowance, the spike floor): a run broken from step 1 is judged by those, and never feeds its corrupted tokens
into the calibration as long as the fixed thresholds catch them.
"""

from __future__ import annotations

import math

import torch

from rollout_guard.config import GuardConfig
from rollout_guard.statistics import CALIBRATION_WIDTH, EXCESS_EDGES, NUM_ENGINE_BUCKETS, Thresholds


def spike_quantile(histogram: torch.Tensor, tokens: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Per bucket, the smallest upper bin edge above which at most ``alpha · tokens`` tokens lie (nats; +inf when
    even the overflow bin holds more).

    Args:
        histogram: (K, NUM_EXCESS_BINS) counts over :data:`EXCESS_EDGES` (the last bin is [64, inf)).
        tokens: (K,) all tokens of the bucket (those below the first edge included).
        alpha: (K,) tail probability per token.

    >>> h = torch.zeros(1, len(EXCESS_EDGES)); h[0, 4] = 10.0  # 10 tokens in [0.5, 0.59)
    >>> spike_quantile(h, torch.tensor([1000.0]), torch.tensor([0.001])).tolist()  # 1 token allowed above
    [0.5946035575013605]
    """
    edges = torch.tensor(EXCESS_EDGES + (math.inf,), dtype=torch.float64)
    above = histogram.double().flip(-1).cumsum(-1).flip(-1)  # above[:, j] = tokens in bins j, j+1, …
    above = torch.cat([above[:, 1:], torch.zeros_like(above[:, :1])], dim=-1)  # tokens above bin j's upper edge
    allowed = (alpha.double() * tokens.double()).unsqueeze(-1)
    ok = above <= allowed
    first = ok.int().argmax(-1)  # the last bin always qualifies (nothing lies above +inf)
    return edges[first + 1]


class Calibration:
    """Decayed per-bucket sums of kept tokens: count, Σ clip(x), histogram of x; and the centres in use."""

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self.sums = torch.zeros(NUM_ENGINE_BUCKETS, CALIBRATION_WIDTH, dtype=torch.float64)
        self.centre = torch.zeros(NUM_ENGINE_BUCKETS, dtype=torch.float64)
        self.variance = torch.zeros(NUM_ENGINE_BUCKETS, dtype=torch.float64)  # of clip(x) around the centre
        self.rows = 0.0  # decayed count of kept samples

    def warm(self) -> torch.Tensor:
        """(K,) bool: buckets with enough kept tokens to be trusted."""
        return self.sums[:, 0] >= self.config.calibration_warmup_tokens

    def thresholds(self, device: torch.device | str = "cpu") -> Thresholds:
        config = self.config
        fixed = Thresholds.fixed(config, "cpu")
        warm = self.warm()
        if not bool(warm.any()):
            return Thresholds(*(t.to(device) for t in fixed))
        candidates = self.sums[:, 3]
        per_sample = candidates.sum() / max(self.rows, 1.0)  # spike candidates per sample, all buckets
        alpha = torch.full_like(candidates, (config.false_alarm_budget / 1000.0) / max(float(per_sample), 1.0))
        quantile = spike_quantile(self.sums[:, 4:], candidates, alpha).float()
        spike = torch.where(warm, torch.maximum(quantile, fixed.spike), fixed.spike)
        centre = torch.where(warm, self.centre.float(), fixed.centre)
        drift_threshold = config.drift_threshold if config.drift_threshold is not None else math.inf
        tokens_per_sample = float(self.sums[:, 0].sum()) / max(self.rows, 1.0)
        log_odds = math.log(1000.0 * max(tokens_per_sample, 1.0) / config.false_alarm_budget)
        noisy = (self.variance * log_odds / (2 * drift_threshold)).float()
        allowance = torch.where(warm, noisy.clamp(min=config.drift_allowance), fixed.allowance)
        return Thresholds(centre.to(device), allowance.to(device), spike.to(device))

    def update(self, contribution: torch.Tensor, kept_rows: float) -> None:
        """Add one step's kept contributions, (K, CALIBRATION_WIDTH) summed over processes (host tensor)."""
        contribution = contribution.double().cpu()
        decay = self.config.calibration_decay
        # the step's tokens were centred with the centre then in use (0 before warm-up): move them to absolute d
        in_use = torch.where(self.warm(), self.centre, torch.zeros_like(self.centre))
        mean_then = contribution[:, 1] / contribution[:, 0].clamp(min=1.0)
        variance_then = (contribution[:, 2] / contribution[:, 0].clamp(min=1.0) - mean_then**2).clamp(min=0.0)
        self.sums *= decay
        self.rows = self.rows * decay + kept_rows
        old_tokens = self.sums[:, 0].clone()
        self.sums += contribution
        new_mean = in_use + mean_then
        weight = contribution[:, 0] / self.sums[:, 0].clamp(min=1e-12)
        seen = old_tokens + contribution[:, 0] > 0
        self.centre = torch.where(seen, self.centre * (1 - weight) + new_mean * weight, self.centre)
        self.variance = torch.where(seen, self.variance * (1 - weight) + variance_then * weight, self.variance)

    def state_dict(self) -> dict:
        return {"sums": self.sums.tolist(), "centre": self.centre.tolist(), "variance": self.variance.tolist(), "rows": self.rows}

    def load_state_dict(self, state: dict) -> None:
        self.sums = torch.tensor(state["sums"], dtype=torch.float64)
        self.centre = torch.tensor(state["centre"], dtype=torch.float64)
        self.variance = torch.tensor(state["variance"], dtype=torch.float64)
        self.rows = float(state["rows"])
