"""Scoring: Wilson intervals, and the replay of clean and faulty rollouts through the guard as training steps."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from benchmarks.fidelity_kit.rollouts import Rollouts, cat
from rollout_guard.config import GuardConfig
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.guard import RolloutGuard
from rollout_guard.statistics import COLUMN
from rollout_guard.verdict import RULES

GOAL_RECALL = 0.999  # of corrupted rollouts
GOAL_FALSE_RATE = 0.001  # false quarantines per clean rollout


def wilson(successes: int, total: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score 95 % interval of a binomial proportion.

    .. math:: \\frac{\\hat p + z^2/2n \\pm z\\sqrt{\\hat p(1-\\hat p)/n + z^2/4n^2}}{1 + z^2/n}

    >>> [round(x, 4) for x in wilson(0, 1000)]
    [0.0, 0.0038]
    >>> [round(x, 4) for x in wilson(999, 1000)]
    [0.9944, 0.9998]
    """
    if total == 0:
        return (math.nan, math.nan)
    p = successes / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))


def clustered_rate(flagged: torch.Tensor, cluster: torch.Tensor) -> tuple[float, float, float, float]:
    """The share of flagged judgements and its 95 % interval when judgements come in clusters (the same row judged
    again): :func:`wilson` over the effective number of judgements, the judgements divided by the design effect
    that the clusters' own spread gives (the ratio estimator's cluster-robust variance over the binomial one),

    .. math:: \\hat r = \\frac{\\sum_c f_c}{N}, \\quad
              \\widehat{V}_c = \\frac{C}{C - 1}\\,\\frac{\\sum_c (f_c - \\hat r\\,n_c)^2}{N^2}, \\quad
              N_\\text{eff} = \\frac{N}{\\max(1,\\ \\widehat{V}_c / (\\hat r(1 - \\hat r)/N))}

    with ``f_c`` and ``n_c`` the flagged and all judgements of cluster ``c``, ``C`` clusters and ``N`` judgements.
    A binomial interval over the judgements would treat a row judged 170 times as 170 independent rows; this one
    is as wide as the flagged judgements cluster. With nothing flagged the spread says nothing: then ``N_eff = C``
    (every row's judgements alike, the widest case), the bound of the distinct rows.

    Args:
        flagged: (N,) bool per judgement.
        cluster: (N,) int64 cluster (row) of each judgement.
    Returns:
        the share, the interval's two ends and ``N_eff``.

    >>> flagged = torch.zeros(1000, dtype=torch.bool); flagged[:10] = True
    >>> [round(x, 4) for x in clustered_rate(flagged, torch.arange(1000))]  # 1,000 rows: the binomial interval
    [0.01, 0.0054, 0.0183, 999.0]
    >>> two_rows = (torch.arange(1000) >= 500).long()  # 10 flagged judgements of one row of two: little known
    >>> [round(x, 4) for x in clustered_rate(flagged, two_rows)]
    [0.01, 0.0018, 0.0549, 99.0]
    >>> [round(x, 4) for x in clustered_rate(torch.zeros(1000, dtype=torch.bool), two_rows)]  # nothing flagged
    [0.0, 0.0, 0.6576, 2.0]
    """
    total = len(flagged)
    if total == 0:
        return (math.nan, math.nan, math.nan, 0.0)
    _, cluster = torch.unique(cluster, return_inverse=True)
    size = int(cluster.max()) + 1
    f = torch.bincount(cluster, weights=flagged.double(), minlength=size)
    n = torch.bincount(cluster, minlength=size).double()
    rate = float(f.sum()) / total
    if rate in (0.0, 1.0) or size < 2:
        effective = float(size)
    else:
        robust = size / (size - 1) * float(((f - rate * n) ** 2).sum()) / total ** 2
        effective = total / max(1.0, robust / (rate * (1 - rate) / total))
    low, high = wilson(rate * effective, effective)
    return (rate, low, high, effective)


@dataclass
class Judged:
    """Per-sample statistics and verdicts of every judged row, with its label."""

    samples: list[torch.Tensor] = field(default_factory=list)  # (n, columns) per step
    suspect: list[torch.Tensor] = field(default_factory=list)  # (n,) bool
    label: list[list[str]] = field(default_factory=list)  # "clean" or the fault name, per row
    counted: list[torch.Tensor] = field(default_factory=list)  # (n,) bool: counts towards the figures
    tokens: list[torch.Tensor] = field(default_factory=list)  # (n,) tokens per row
    threshold: list[torch.Tensor] = field(default_factory=list)  # (n,) the score threshold (ln Λ) of the row's step
    origin: list[torch.Tensor] = field(default_factory=list)  # (n,) long: the clean row judged (−1: a fault, unknown)

    def add(self, samples: torch.Tensor, suspect: torch.Tensor, labels: list[str], counted: torch.Tensor,
            tokens: torch.Tensor, threshold: float, origin: torch.Tensor | None = None) -> None:
        self.samples.append(samples)
        self.origin.append(origin.long() if origin is not None else torch.full((len(labels),), -1, dtype=torch.long))
        self.suspect.append(suspect)
        self.label.append(labels)
        self.counted.append(counted)
        self.tokens.append(tokens)
        self.threshold.append(torch.full((len(labels),), threshold, dtype=torch.float64))

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, list[str], torch.Tensor, torch.Tensor]:
        labels = [label for step in self.label for label in step]
        return (torch.cat(self.samples), torch.cat(self.suspect), labels, torch.cat(self.counted),
                torch.cat(self.tokens))

    def origins(self) -> torch.Tensor:
        """(N,) int64: the index of the clean row each judged row is (or was drawn from), −1 for faults."""
        return torch.cat(self.origin)

    def thresholds(self) -> torch.Tensor:
        """(N,) float64 ln Λ: the score threshold each row was judged with (``StepReport.threshold``)."""
        return torch.cat(self.threshold)


def firings(samples: torch.Tensor, threshold: torch.Tensor | float, ceiling_delta: float | None,
            tolerance_delta: float | None = None) -> dict[str, torch.Tensor]:
    """Which rules of :data:`rollout_guard.verdict.RULES` fire on each row, read back from its statistics
    (:data:`rollout_guard.statistics.SAMPLE_COLUMNS`): a non-finite logprob on either side, a compared token's
    |Δ| over ``ceiling_delta`` or over ``tolerance_delta`` (``None``: off), the score over the row's ``threshold``. Compared in float32, as the
    detector compares, so that the rules' union is the guard's verdict.

    Args:
        samples: (N, len(SAMPLE_COLUMNS)) per-row statistics (``StepReport.samples``).
        threshold: (N,) or a scalar: the score threshold (ln Λ) each row was judged with.
        ceiling_delta: nats, ``GuardConfig.ceiling_delta``.
    Returns:
        rule name → (N,) bool, in :data:`~rollout_guard.verdict.RULES` order.

    >>> samples = torch.full((3, len(COLUMN)), float("nan"), dtype=torch.float64)
    >>> samples[:, COLUMN["nonfinite_engine_tokens"]] = torch.tensor([0.0, 2.0, 0.0])
    >>> samples[:, COLUMN["nonfinite_trainer_tokens"]] = 0.0
    >>> samples[:, COLUMN["max_abs_delta"]] = torch.tensor([30.0, 0.1, 0.2])
    >>> samples[:, COLUMN["score"]] = torch.tensor([40.0, float("nan"), 7.0])
    >>> {rule: fired.tolist() for rule, fired in firings(samples, 6.9, 25.0).items()}  # doctest: +NORMALIZE_WHITESPACE
    {'nonfinite_engine': [False, True, False], 'nonfinite_trainer': [False, False, False],
     'ceiling': [True, False, False], 'score': [True, False, True], 'tolerance': [False, False, False]}
    """
    column = {name: samples[:, COLUMN[name]] for name in
              ("nonfinite_engine_tokens", "nonfinite_trainer_tokens", "max_abs_delta", "score")}
    threshold = torch.as_tensor(threshold, dtype=torch.float32)
    out = {"nonfinite_engine": column["nonfinite_engine_tokens"] > 0,
           "nonfinite_trainer": column["nonfinite_trainer_tokens"] > 0,
           "ceiling": (column["max_abs_delta"].float() > ceiling_delta if ceiling_delta is not None
                       else torch.zeros(len(samples), dtype=torch.bool)),
           "score": column["score"].float() > threshold,
           "tolerance": (column["max_abs_delta"].float() > tolerance_delta if tolerance_delta is not None
                         else torch.zeros(len(samples), dtype=torch.bool))}
    return {rule: out[rule] for rule in RULES}


def _evidence(rows: Rollouts, injected: torch.Tensor, judge_truncated: bool, device: str = "cpu") -> RolloutEvidence:
    mask = rows.mask if judge_truncated else rows.mask & ~rows.truncated.unsqueeze(1)
    return RolloutEvidence(mask=mask.to(device), engine_logprobs=rows.engine.to(device), trainer_logprobs=rows.trainer.to(device),
                           injected=injected.to(device))


def faults_in_step(share: float, rows: float, step: int, at_least_one: bool = False) -> int:
    """Faulty rows a stream feeds in its ``step``-th step (from 0) at ``share`` of ``rows``: ``round(share · rows)``
    (with ``at_least_one``, never fewer than one, as phase 1 feeds), or, where ``share · rows`` is under half a
    row, one row every ``n = round(1 / (share · rows))`` steps, the steps ``step ≡ 0 (mod n)``:

    .. math:: f_k = \\begin{cases} \\operatorname{round}(s r) & s r \\ge 1/2 \\\\
              [k \\bmod \\operatorname{round}(1 / (s r)) = 0] & 0 < s r < 1/2 \\\\ 0 & s r = 0 \\end{cases}

    AI21's rate, one prompt in a thousand, is a quarter of a row of a 256-row step: one a step would be 0.39 %,
    four times the rate asked.

    >>> [faults_in_step(0.02, 256, k, at_least_one=True) for k in range(3)]  # 5.12 a step
    [5, 5, 5]
    >>> [faults_in_step(0.001, 256, k) for k in range(9)]  # 0.256 a step: one in four steps, 0.098 %
    [1, 0, 0, 0, 1, 0, 0, 0, 1]
    >>> faults_in_step(0.004, 256, 1, at_least_one=True), faults_in_step(0.0, 256, 0)
    (1, 0)
    """
    expected = share * rows
    if expected >= 0.5:
        return max(1, round(expected)) if at_least_one else round(expected)
    if expected <= 0:
        return 0
    return int(step % round(1 / expected) == 0)


def replay(clean: Rollouts, faulty: dict[str, Rollouts], config: GuardConfig, generator: torch.Generator,
           step_rows: int = 256, fault_share: float = 0.02, mask_truncated: bool = False,
           make_guard=None, device: str = "cpu", announce_sampling: bool = True, warmup_steps: int = 20,
           dense_phase2: bool = False) -> Judged:
    """Feed one noise condition to a fresh guard as a stream of training steps.

    Phase 1 streams every clean row once, in data order, ``step_rows`` per step, with ``fault_share`` of each step
    taken from the faulty pools (round-robin over fault kinds; below half a row a step, one row every few steps:
    :func:`faults_in_step`), so that the detector learns its healthy noise at the fault rate asked; its clean rows
    are the ones whose false quarantines count. A pooled stream (``clean.setting``) changes sampling
    setting between steps: phase 1 cuts its steps where the setting changes, and its faults are those sampled
    under the step's setting. With ``announce_sampling`` the guard is told each step's setting, as the TRL adapter
    does every step (a change starts its healthy noise over: ``RolloutGuard.reset_noise``).

    Phase 2 judges the remaining faulty rows setting by setting (the last one of phase 1 first): for each, while
    the guard has seen fewer than ``warmup_steps`` steps of that setting since it changed to it (a short condition,
    or a setting phase 2 comes back to), steps like phase 1's from resampled clean rows; then steps whose quarter
    are faults, beside resampled clean rows. Resampled clean rows are judged (their false quarantines are reported
    apart, per judgement) but not counted with the unique ones. Every fault is counted, warm-up steps included.

    A quarter of faults per step is ~250 times the rate reported for real stale-state corruption (about one prompt
    in a thousand), and the detector learns its healthy noise from the rows it keeps, so the faults it misses would
    feed that noise at this density. Unless ``dense_phase2``, each such step is therefore judged as it stands (those
    are the verdicts counted), then the guard's state is put back and the step judged again with only
    ``fault_share`` of faults among its clean rows (:func:`faults_in_step` again), which is what moves the guard
    on: it learns from faults at the same rate as in phase 1. ``dense_phase2``: the guard moves on with the whole
    step.
    """
    guard = make_guard(config) if make_guard is not None else RolloutGuard(config, device=device)
    judged = Judged()
    names = list(faulty)
    clean = clean.rows(torch.argsort(clean.step, stable=True))  # data order, so each step is a slice
    setting = _settings(clean)
    pools = {(name, value): faulty[name].rows(_settings(faulty[name]) == value)
             for name in names for value in setting.unique().tolist()}
    cursors = dict.fromkeys(pools, 0)
    # one faulty row every few steps (faults_in_step) in both phases only where phase 1's share is under half a row:
    # where it is not, phase 2's share beside its fill rounds as it falls (e.g. 0.49 of a row: none)
    below_one = fault_share * step_rows < 0.5
    turn = 0
    step = 0

    def left(value: int) -> bool:
        return any(cursors[name, value] < len(pools[name, value]) for name in names)

    def take_faults(count: int, value: int) -> tuple[list[Rollouts], list[str]]:
        """``count`` faulty rows of setting ``value``, round-robin over the fault kinds that have rows left."""
        nonlocal turn
        wanted = dict.fromkeys(names, 0)
        for _ in range(count):
            kinds = [name for name in names if cursors[name, value] + wanted[name] < len(pools[name, value])]
            if not kinds:
                break
            wanted[kinds[turn % len(kinds)]] += 1
            turn += 1
        parts, labels = [], []
        for name, number in wanted.items():
            if number:
                cursor = cursors[name, value]
                parts.append(pools[name, value].rows(slice(cursor, cursor + number)))
                labels += [name] * number
                cursors[name, value] += number
        return parts, labels

    def judge(index: torch.Tensor, unique: bool, faults: int, value: int, feed: int | None = None) -> None:
        """One step: the clean rows at ``index`` (counted when ``unique``) and ``faults`` faulty rows of setting
        ``value``; with ``feed``, the guard then moves on with the clean rows and only ``feed`` of the faults."""
        nonlocal step
        step += 1
        fill = clean.rows(index)
        parts, labels = take_faults(faults, value)
        rows = cat([fill, *parts])
        labels = ["clean"] * len(fill) + labels
        counted = torch.tensor([unique] * len(fill) + [True] * (len(labels) - len(fill)))
        injected = torch.tensor([label != "clean" for label in labels])
        sampling = (value,) if announce_sampling else None
        state = guard.state_dict() if feed is not None else None
        report = guard.inspect(_evidence(rows, injected, not mask_truncated, device), step=step, sampling=sampling)
        origin = torch.cat([index, torch.full((len(labels) - len(fill),), -1, dtype=torch.long)])
        judged.add(report.samples, report.suspect, labels, counted, rows.mask.sum(-1), report.threshold, origin)
        if state is not None:
            guard.load_state_dict(state)
            count = len(labels) - len(fill)  # spread over the step's faults (they come grouped by kind), turning
            chosen = (torch.arange(min(feed, count)) * count // max(feed, 1) + step) % max(count, 1)
            keep = torch.cat([torch.arange(len(fill)), len(fill) + chosen])
            guard.inspect(_evidence(rows.rows(keep), injected[keep], not mask_truncated, device), step=step,
                          sampling=sampling)

    per_step_faults = max(1, round(fault_share * step_rows)) if names else 0  # the most a step holds

    def faults(index: int) -> int:
        return faults_in_step(fault_share, step_rows, index, at_least_one=True) if names else 0

    clean_step_rows = step_rows - per_step_faults
    changes = (torch.nonzero(setting[1:] != setting[:-1]).flatten() + 1).tolist()
    since_change = 0
    for run_start, run_stop in zip([0, *changes], [*changes, len(clean)], strict=True):  # one setting each
        value = int(setting[run_start])
        since_change = 0
        for start in range(run_start, run_stop, clean_step_rows):
            judge(torch.arange(start, min(start + clean_step_rows, run_stop)), True, faults(step), value)
            since_change += 1

    fill = step_rows - step_rows // 4
    feed_share = fault_share / (1 - fault_share)  # faults beside the fill, as in phase 1

    def feed(index: int) -> int | None:
        if dense_phase2:
            return None
        return faults_in_step(feed_share, fill, index) if below_one else round(feed_share * fill)

    last = int(setting[-1]) if len(setting) else 0
    order = [last] + [value for value in setting.unique().tolist() if value != last]
    for value in order:
        if not left(value):
            continue
        of_setting = torch.nonzero(setting == value).flatten()
        since_change = since_change if value == last else 0

        def resampled(count: int, of_setting=of_setting) -> torch.Tensor:
            return of_setting[torch.randint(0, len(of_setting), (count,), generator=generator)]

        while since_change < warmup_steps and left(value):
            judge(resampled(clean_step_rows), False, faults(step), value)
            since_change += 1
        while left(value):
            judge(resampled(fill), False, step_rows // 4, value, feed(step))
            since_change += 1
    return judged


def _settings(rows: Rollouts) -> torch.Tensor:
    """(B,) int64: each row's sampling setting (0 for all rows of a single-setting condition)."""
    return rows.setting if rows.setting is not None else torch.zeros(len(rows), dtype=torch.long)


def figures(judged: Judged, config: GuardConfig) -> dict[str, dict]:
    """Recall per fault and false quarantines of clean rows, with Wilson intervals and PASS/FAIL, and how many rows
    each rule fired on (:func:`firings`: on the false quarantines, on the faults); apart (``clean.resampled``), the
    false quarantines among the judgements of resampled clean rows (each row judged again in later steps)."""
    samples, verdict, labels, counted, tokens = judged.rows()
    origin = judged.origins()
    fired = firings(samples, judged.thresholds(), config.ceiling_delta, config.tolerance_delta)
    out: dict[str, dict] = {}
    for name in sorted(set(labels)):
        rows = torch.tensor([label == name for label in labels]) & counted
        total = int(rows.sum())
        flagged = int((verdict & rows).sum())
        if name == "clean":
            low, high = wilson(flagged, total)
            clean_tokens = int(tokens[rows].sum())
            out[name] = {"rows": total, "tokens": clean_tokens, "false": flagged, "false_rate": flagged / max(total, 1),
                         "ci": [low, high], "false_per_m_tokens": flagged / max(clean_tokens, 1) * 1e6,
                         "pass": flagged / max(total, 1) <= GOAL_FALSE_RATE, "ci_pass": high <= GOAL_FALSE_RATE,
                         "rules": {rule: int((rule_fired & rows).sum()) for rule, rule_fired in fired.items() if (rule_fired & rows).any()}}
            again = torch.tensor([label == name for label in labels]) & ~counted  # resampled clean rows
            rate, rate_low, rate_high, effective = clustered_rate(verdict[again], origin[again])
            distinct = origin[again].unique()
            ever = origin[again & verdict].unique()
            row_low, row_high = wilson(len(ever), len(distinct))
            out[name]["resampled"] = {"judged": int(again.sum()), "false": int((verdict & again).sum()),
                                      "false_rate": rate, "ci": [rate_low, rate_high], "effective": effective,
                                      "rows": len(distinct), "rows_flagged": len(ever),
                                      "rows_flagged_ci": [row_low, row_high],
                                      "rules": {rule: int((rule_fired & again & verdict).sum())
                                                for rule, rule_fired in fired.items() if (rule_fired & again & verdict).any()}}
        else:
            low, high = wilson(flagged, total)
            out[name] = {"rows": total, "caught": flagged, "recall": flagged / max(total, 1), "ci": [low, high],
                         "pass": flagged / max(total, 1) >= GOAL_RECALL, "ci_pass": low >= GOAL_RECALL,
                         "rules": {rule: int((rule_fired & rows).sum()) for rule, rule_fired in fired.items() if (rule_fired & rows).any()}}
    return out
