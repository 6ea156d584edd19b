"""One quarantine record: the evidence needed to understand and reproduce a suspect sample offline."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from rollout_guard.statistics import SAMPLE_COLUMNS
from rollout_guard.verdict import explain, rule_names

SCHEMA_VERSION = 1


def json_safe(value: Any) -> Any:
    """``value`` with every NaN and ±inf float, at any depth of dicts, lists and tuples, replaced by None (JSON has
    no NaN; a reward function that returns None gives TRL a NaN reward)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


@dataclass
class QuarantineRecord:
    """A suspect sample, with everything needed to replay it (see ``rollout-guard replay``).

    Logprob lists are aligned with ``completion_ids``; a value the engine or trainer did not give (or that was
    NaN/±inf) is ``null`` in JSON and counted in ``stats``.
    """

    step: int  # the 1-based training step (as TRL logs it) whose update first uses this rollout
    process_index: int
    row: int  # row in this process's generation batch
    global_row: int  # row in the gathered batch (group = global_row // group_size)
    group_size: int
    action: str  # "quarantined" (removed from the loss) or "monitored" (monitor mode: reported only)
    rules: list[str]  # verdict rules that fired (rollout_guard.verdict.RULE_TEXT says what each means)
    stats: dict[str, float]  # the sample's row of statistics.SAMPLE_COLUMNS
    prompt_ids: list[int]
    completion_ids: list[int]
    prompt_text: str
    completion_text: str
    completion_tokens: list[str]  # each completion token decoded on its own, for token-by-token views
    engine_logprobs: list[float | None] | None
    trainer_logprobs: list[float | None] | None
    reward: float | None  # weighted sum over reward functions
    rewards_per_func: dict[str, float | None]
    advantage_before: float | None  # what the trainer would have used
    advantage_after: float | None  # after the guard (0.0 when quarantined)
    sampling: dict[str, Any]  # temperature, top_p, top_k, min_p, repetition_penalty, max_tokens, seed
    model: str  # name_or_path of the trained model
    engine: dict[str, Any]  # e.g. {"name": "vllm", "mode": "colocate", "version": "0.31.0"}
    injected: bool | None = None  # ground truth when a fault injector is on
    explanation: str = ""  # one sentence on why it was judged so (rollout_guard.verdict.explain)
    # False: statistics, rules, rewards and advantages only; no token ids, texts or per-token logprobs (the step
    # had more suspect samples than GuardConfig.evidence_samples_per_step and this one was not among the worst)
    full_evidence: bool = True
    created_unix: float = 0.0
    schema_version: int = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json_dict(self) -> dict[str, Any]:
        return json_safe(asdict(self))

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> QuarantineRecord:
        known = {f.name for f in fields(cls)}
        missing = [f.name for f in fields(cls) if f.name not in data and f.default is MISSING
                   and f.default_factory is MISSING]
        if missing:
            raise ValueError(f"quarantine record lacks {missing}")
        return cls(**{key: value for key, value in data.items() if key in known})


def verdict_fields(sample: Sequence[float], reasons: int, threshold: float,
                   tokens_before_onset: float) -> dict[str, Any]:
    """A suspect row's ``stats``, ``rules`` and ``explanation``, as its record holds them: ``sample`` its statistics
    in ``SAMPLE_COLUMNS`` order, ``reasons`` its verdict bits, ``threshold`` the score's (ln Λ).
    ``tokens_before_onset``: the loss-mask tokens before the onset, which the record gives in place of the onset's
    position in the padded row (where there is an onset)."""
    stats = dict(zip(SAMPLE_COLUMNS, sample, strict=True))
    onset = stats.get("onset_token")
    if onset is not None and math.isfinite(onset) and onset >= 0:
        stats["onset_token"] = float(tokens_before_onset)
    rules = rule_names(int(reasons))
    return {"stats": stats, "rules": rules, "explanation": explain(stats, rules, threshold)}


def decode_records(records: list[QuarantineRecord], tokenizer: Any) -> list[QuarantineRecord]:
    """Fill in the texts of the records with full evidence (prompt, completion, each completion token on its own),
    in place, with one tokenizer call: ``batch_decode`` of the prompts, the completions and every distinct
    completion token (decoded once, however often it occurs). Returns the records."""
    full = [record for record in records if record.full_evidence]
    if not full:
        return records
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer
    distinct = sorted({token for record in full for token in record.completion_ids})
    sequences = [record.prompt_ids for record in full] + [record.completion_ids for record in full]
    texts = tokenizer.batch_decode(sequences + [[token] for token in distinct], skip_special_tokens=False)
    piece = dict(zip(distinct, texts[len(sequences) :], strict=True))
    for index, record in enumerate(full):
        record.prompt_text, record.completion_text = texts[index], texts[len(full) + index]
        record.completion_tokens = [piece[token] for token in record.completion_ids]
    return records
