"""Does the change-point test catch more late onset at the same share of held-out clean rows flagged when its
threshold is read per class of row length (K quantile classes of the fit half's completion lengths, each at the
budget q) instead of over all rows (K = 1)? The misses are short rows (median 19.5 tokens, thirty-third session).
Cross-fitted as ``../results-2026-12-04-thirtieth/changepoint_trade_off.py``, the noise over the guard's four
engine buckets, the hybrid-7B-tail conditions, 4,000 late-onset rows each; per K the most caught among the 21
budgets of ``../results-2026-12-04-thirtyfifth/trade_off_fine_grid.py`` whose held-out clean rows flagged stay within
each share ("–": no budget does). In the hybrid-seed1 and llama conditions more than half the rows stop at the
256-token limit, so there K = 2 is K = 1 (one class) and K = 4 gives two: up to ~82–85 tokens, and the rest.

    python benchmarks/results-2026-12-05-thirtysixth/length_classes.py SEED
"""

import glob
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "results-2026-12-03-twentyeighth"))

import benchmarks.likelihood_bound as likelihood_bound  # noqa: E402
import changepoint_every_condition as cp  # noqa: E402
from benchmarks.fidelity import DEFAULT_DATA, conditions  # noqa: E402
from benchmarks.fidelity_kit import zoo  # noqa: E402
from benchmarks.fidelity_kit.rollouts import read_tables  # noqa: E402
from rollout_guard.statistics import ENGINE_BUCKET_EDGES  # noqa: E402

EDGES = torch.tensor(ENGINE_BUCKET_EDGES, dtype=torch.float64)  # the noise over the guard's four engine buckets
likelihood_bound.LEARNED_EDGES = EDGES
cp.LEARNED_EDGES = EDGES

seed = int(sys.argv[1])
faults = 4000  # late-onset rows per condition
GRID = [float(q) for q in torch.logspace(-4.3, -2.3, 21, dtype=torch.float64)]  # 0.005 % … 0.5 %
CLASSES = (1, 2, 4)


def class_edges(length, k):
    """The K-quantile class edges of the rows' lengths (none for K = 1)."""
    if k == 1:
        return torch.empty(0)
    return torch.quantile(length.double(), torch.linspace(0, 1, k + 1, dtype=torch.float64)[1:-1])


def per_class_thresholds(scores, length, k, q):
    """The class edges (repeated quantiles merged) and each class's threshold at budget q (+inf: an empty class)."""
    e = torch.unique(class_edges(length, k))
    cls = torch.bucketize(length.double(), e)
    out = torch.full((len(e) + 1,), float("inf"), dtype=torch.float64)
    for c in range(len(e) + 1):
        s = scores[cls == c].sort(descending=True).values
        if len(s):
            out[c] = s[min(int(q * len(s)), len(s) - 1)]
    return e, out


def flags(scores, length, e, t):
    """Which rows score above their length class's threshold."""
    return scores > t[torch.bucketize(length.double(), e)]


generator = torch.Generator().manual_seed(seed + 2027)
paths = sorted(glob.glob(DEFAULT_DATA))
for name, clean, real, apply, _ in conditions(read_tables(paths), seed, 256, True):
    if "tail_hybrid7b" not in name:
        continue
    order = torch.randperm(len(clean), generator=generator)
    halves = (order[: len(clean) // 2], order[len(clean) // 2:])
    res = {k: torch.zeros(len(GRID), 2, dtype=torch.long) for k in CLASSES}
    n = [0, 0]
    for fit_index, held_index in (halves, halves[::-1]):
        fit = apply(clean.rows(fit_index))
        noise = cp.learned_by_setting(fit, True)
        fit_scores = cp.scored(fit, noise, 0.0)
        fit_len = fit.mask.sum(-1)
        held = clean.rows(held_index)
        held_scores = cp.scored(apply(held), noise, 0.0)
        held_len = held.mask.sum(-1)
        index = torch.randint(0, len(held), (faults // 2,), generator=generator)
        late_rows = apply(zoo.late_onset(held.rows(index), generator))
        late = cp.scored(late_rows, noise, 0.0)
        late_len = late_rows.mask.sum(-1)
        n[0] += len(held_scores)
        n[1] += len(late)
        for k in CLASSES:
            for i, q in enumerate(GRID):
                e, t = per_class_thresholds(fit_scores, fit_len, k, q)
                res[k][i, 0] += int(flags(held_scores, held_len, e, t).sum())
                res[k][i, 1] += int(flags(late, late_len, e, t).sum())
    print(f"## {name} seed {seed}: {n[0]} held clean, {n[1]} late onset")
    for share in (0.0005, 0.001):
        line = []
        for k in CLASSES:
            ok = [(int(r[1]), int(r[0])) for r in res[k] if r[0] <= share * n[0]]
            best = max(ok) if ok else None
            found = f"{best[0]} caught ({100 * best[0] / n[1]:.2f} %) at {best[1]} flagged" if best else "–"
            line.append(f"K={k}: {found}")
        print(f"  ≤ {100*share:g} %: " + "; ".join(line), flush=True)
