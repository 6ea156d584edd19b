"""Which suspect samples get full evidence (tokens, logprobs) in a step: the worst ``k``, in a documented order.

Pure and computed on the step's gathered host report, so every process picks the same rows.
"""

from __future__ import annotations

import torch

from rollout_guard.statistics import COLUMN
from rollout_guard.verdict import RULES


def severity_rank(reasons: torch.Tensor) -> torch.Tensor:
    """Index in :data:`rollout_guard.verdict.RULES` of the most severe rule fired per sample (the lowest set bit
    of the bitmask; RULES lists non-finite values, then the absolute ceiling, then the score, then the zero tolerance), and
    ``len(RULES)`` where none fired.

    ``reasons``: (N,) int32 bitmask over RULES. Returns (N,) int64.

    >>> severity_rank(torch.tensor([0b100, 0b110, 0b1, 0], dtype=torch.int32)).tolist()
    [2, 1, 0, 5]
    """
    reasons = reasons.to(torch.int64)
    lowest = reasons & -reasons  # the lowest set bit, 0 where none
    rank = torch.log2(lowest.clamp(min=1).double()).round().to(torch.int64)
    return torch.where(reasons == 0, torch.full_like(rank, len(RULES)), rank)


def worst_suspects(samples: torch.Tensor, reasons: torch.Tensor, k: int) -> torch.Tensor:
    """Global rows of the ``k`` worst suspect samples, worst first.

    Order: most severe rule fired (:func:`severity_rank`, ascending), then the rollout's score (descending; NaN
    last), then the row index (ascending): a total order, so the choice is identical wherever it is computed.

    ``samples``: (N, len(SAMPLE_COLUMNS)) per-sample statistics; ``reasons``: (N,) int32 bitmask (0 = not
    suspect). Returns (min(k, suspects),) int64 row indices.

    >>> samples = torch.zeros(5, len(COLUMN), dtype=torch.float64)
    >>> samples[:, COLUMN["score"]] = torch.tensor([9.0, 30.0, 4.0, float("nan"), 12.0], dtype=torch.float64)
    >>> reasons = torch.tensor([8, 4, 0, 8, 8], dtype=torch.int32)  # score, ceiling, kept, score, score
    >>> worst_suspects(samples, reasons, 3).tolist()
    [1, 4, 0]
    """
    if k <= 0:
        return torch.zeros(0, dtype=torch.int64)
    rows = torch.nonzero(reasons != 0).flatten()
    if rows.numel() == 0:
        return rows
    delta = samples[rows, COLUMN["score"]].double()
    delta = torch.where(torch.isnan(delta), torch.full_like(delta, -torch.inf), delta)
    # stable sorts from the least to the most significant key (rows are ascending already)
    order = torch.sort(-delta, stable=True).indices
    rows = rows[order]
    order = torch.sort(severity_rank(reasons[rows]), stable=True).indices
    return rows[order][:k]
