"""The detector: one score per row against the run's own healthy noise (``docs/detector.md``).

evidence → :func:`~rollout_guard.detector.noise.token_histogram` / :class:`~rollout_guard.detector.noise.Noise` →
:func:`~rollout_guard.detector.score.row_scores` → :class:`~rollout_guard.detector.detector.Judgement`.
"""

from rollout_guard.detector.detector import GROWTH_ALERT, RULE_BIT, RULES, Detector, Judgement
from rollout_guard.detector.noise import Noise, healthy_noise, noise_of
from rollout_guard.detector.score import LAGS, REGION_EDGES, RowScores, row_scores

__all__ = ["GROWTH_ALERT", "LAGS", "REGION_EDGES", "RULES", "RULE_BIT", "Detector", "Judgement", "Noise", "RowScores",
           "healthy_noise", "noise_of", "row_scores"]
