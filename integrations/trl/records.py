"""Evidence records: a :class:`~rollout_guard.outputs.records.QuarantineRecord` for each suspect sample of a TRL batch."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from rollout_guard.config import GuardConfig
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.guard import StepReport
from rollout_guard.integrations.trl.batch import require
from rollout_guard.integrations.trl_versions import version, vllm_version
from rollout_guard.outputs.records import QuarantineRecord, decode_records, verdict_fields
from rollout_guard.statistics import COLUMN


def build_records(trainer: Any, config: GuardConfig, process_index: int, batch: dict[str, Any], report: StepReport,
                  evidence: RolloutEvidence, rewards: torch.Tensor | None,
                  advantages_before: torch.Tensor | None, full_rows: set[int] | None = None,
                  decode: bool = True) -> list[QuarantineRecord]:
    """Records of this process's suspect samples. ``full_rows``: the global rows that get full evidence (token ids,
    texts, per-token logprobs; every suspect row when None); the other suspects get statistics, rules, rewards
    and advantages only (``full_evidence=False``). Host copies of the suspect rows only, tokens of the full ones
    only. ``decode``: fill in the texts here (:func:`decode_records`, one tokenizer call); the adapter passes False
    and decodes on its background writer, on the main process only."""
    local_suspect = report.suspect[report.local_rows]
    rows = torch.nonzero(local_suspect).flatten().tolist()
    if not rows:
        return []
    start = report.local_rows.start
    full = [row for row in rows if full_rows is None or start + row in full_rows]
    index = torch.tensor(rows, device=evidence.device)
    # onset_token is a position in the padded row; records count loss-mask tokens only: tokens before it
    first = report.samples[[start + row for row in rows], COLUMN["onset_token"]]
    counted = torch.nn.functional.pad(evidence.mask[index].long().cumsum(dim=1), (1, 0))
    position = torch.nan_to_num(first, nan=-1.0).clamp(min=0).long().clamp(max=counted.shape[1] - 1).to(counted.device)
    tokens_before = counted.gather(1, position.view(-1, 1)).flatten().cpu()
    after = require(batch, "advantages")[index].float().cpu()
    before = (advantages_before[index].float().cpu() if advantages_before is not None
        else torch.full_like(after, math.nan))
    reward_rows = rewards.float().cpu() if rewards is not None else None
    injected = evidence.injected.cpu() if evidence.injected is not None else None
    tokens_of: dict[int, dict[str, Any]] = {}
    if full:
        full_index = torch.tensor(full, device=evidence.device)
        mask = evidence.mask[full_index].bool().cpu()
        prompt_mask = batch["prompt_mask"][full_index].bool().cpu()
        prompt_ids = batch["prompt_ids"][full_index].cpu()
        completion_ids = batch["completion_ids"][full_index].cpu()
        engine = evidence.engine_logprobs[full_index].float().cpu() if evidence.has_engine else None
        trainer_lp = evidence.trainer_logprobs[full_index].float().cpu() if evidence.has_trainer else None
        prompts = [prompt_ids[i][prompt_mask[i]].tolist() for i in range(len(full))]
        completions = [completion_ids[i][mask[i]].tolist() for i in range(len(full))]
        for i, row in enumerate(full):
            tokens_of[row] = dict(
                prompt_ids=prompts[i], completion_ids=completions[i], prompt_text="", completion_text="",
                completion_tokens=[],
                engine_logprobs=engine[i][mask[i]].tolist() if engine is not None else None,
                trainer_logprobs=trainer_lp[i][mask[i]].tolist() if trainer_lp is not None else None,
            )
    no_tokens = dict(prompt_ids=[], completion_ids=[], prompt_text="", completion_text="", completion_tokens=[],
                     engine_logprobs=None, trainer_logprobs=None)
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
    created = time.time()
    records = []
    for position, row in enumerate(rows):
        global_row = start + row
        reward_row = reward_rows[global_row] if reward_rows is not None else None
        records.append(
            QuarantineRecord(
                step=report.step, process_index=process_index, row=row, global_row=global_row,
                group_size=trainer.num_generations, action=action,
                **verdict_fields(report.samples[global_row].tolist(), int(report.reasons[global_row]),
                                 report.threshold, float(tokens_before[position])),
                **tokens_of.get(row, no_tokens),
                reward=None if reward_row is None or bool(reward_row.isnan().all())
                       else float((reward_row * weights).nansum()),
                rewards_per_func=dict(zip(names, reward_row.tolist(), strict=False)) if reward_row is not None else {},
                advantage_before=float(before[position]), advantage_after=float(after[position]),
                sampling=sampling, model=str(model), engine=engine_info,
                injected=None if injected is None else bool(injected[row]),
                created_unix=created, full_evidence=row in tokens_of,
            )
        )
    return decode_records(records, trainer.processing_class) if decode else records
