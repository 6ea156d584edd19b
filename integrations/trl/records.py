"""Evidence records: a :class:`~rollout_guard.records.QuarantineRecord` for each suspect sample of a TRL batch."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from rollout_guard.config import GuardConfig
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.guard import StepReport
from rollout_guard.integrations.trl.batch import require
from rollout_guard.integrations.trl.versions import version, vllm_version
from rollout_guard.records import QuarantineRecord
from rollout_guard.statistics import SAMPLE_COLUMNS
from rollout_guard.verdict import rule_names


def build_records(trainer: Any, config: GuardConfig, process_index: int, batch: dict[str, Any], report: StepReport,
                  evidence: RolloutEvidence, rewards: torch.Tensor | None,
                  advantages_before: torch.Tensor | None) -> list[QuarantineRecord]:
    """Records of this process's suspect samples (host copies of those rows only)."""
    local_suspect = report.suspect[report.local_rows]
    rows = torch.nonzero(local_suspect).flatten().tolist()
    if not rows:
        return []
    index = torch.tensor(rows, device=evidence.device)
    mask = evidence.mask[index].bool().cpu()
    prompt_mask = batch["prompt_mask"][index].bool().cpu()
    prompt_ids = batch["prompt_ids"][index].cpu()
    completion_ids = batch["completion_ids"][index].cpu()
    engine = evidence.engine_logprobs[index].float().cpu() if evidence.has_engine else None
    trainer_lp = evidence.trainer_logprobs[index].float().cpu() if evidence.has_trainer else None
    after = require(batch, "advantages")[index].float().cpu()
    before = advantages_before[index].float().cpu() if advantages_before is not None else torch.full_like(after, math.nan)
    tokenizer = trainer.processing_class
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    names = list(getattr(trainer, "reward_func_names", []))
    weights = trainer.reward_weights.float().cpu()
    sampling = {
        "temperature": trainer.temperature, "top_p": trainer.top_p, "top_k": trainer.top_k, "min_p": trainer.min_p,
        "repetition_penalty": trainer.repetition_penalty, "max_tokens": trainer.max_completion_length,
        "logprobs_mode": "processed_logprobs",
    }
    engine_info = {
        "name": "vllm" if trainer.use_vllm else "transformers",
        "mode": trainer.vllm_mode if trainer.use_vllm else None,
        "vllm_version": vllm_version(), "trl_version": version("trl"), "transformers_version": version("transformers"),
    }
    model = getattr(trainer.model, "name_or_path", None) or getattr(trainer.model.config, "_name_or_path", "")
    action = "quarantined" if config.quarantines else "monitored"
    records = []
    for position, row in enumerate(rows):
        global_row = report.local_rows.start + row
        stats = dict(zip(SAMPLE_COLUMNS, report.samples[global_row].tolist(), strict=True))
        token_mask = mask[position]
        first = stats.get("first_divergent_token")
        if first is not None and first >= 0:  # a position in the padded row; the record keeps loss-mask tokens only
            stats["first_divergent_token"] = float(token_mask[: int(first)].sum())
        prompt = prompt_ids[position][prompt_mask[position]].tolist()
        completion = completion_ids[position][token_mask].tolist()
        reward_row = rewards[global_row].float().cpu() if rewards is not None else None
        records.append(
            QuarantineRecord(
                step=report.step, process_index=process_index, row=row, global_row=global_row,
                group_size=trainer.num_generations, action=action,
                rules=rule_names(int(report.reasons[global_row])), stats=stats,
                prompt_ids=prompt, completion_ids=completion,
                prompt_text=tokenizer.decode(prompt, skip_special_tokens=False),
                completion_text=tokenizer.decode(completion, skip_special_tokens=False),
                completion_tokens=[tokenizer.decode([token], skip_special_tokens=False) for token in completion],
                engine_logprobs=engine[position][token_mask].tolist() if engine is not None else None,
                trainer_logprobs=trainer_lp[position][token_mask].tolist() if trainer_lp is not None else None,
                reward=None if reward_row is None or bool(reward_row.isnan().all()) else float((reward_row * weights).nansum()),
                rewards_per_func=dict(zip(names, reward_row.tolist(), strict=False)) if reward_row is not None else {},
                advantage_before=float(before[position]), advantage_after=float(after[position]),
                sampling=sampling, model=str(model), engine=engine_info,
                injected=None if evidence.injected is None else bool(evidence.injected[row]),
                created_unix=time.time(),
            )
        )
    return records
