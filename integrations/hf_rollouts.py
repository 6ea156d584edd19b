"""A transformers-based rollout engine for TRL, for machines without vLLM.

``TransformersRollouts`` is a TRL ``rollout_func``: it samples completions with ``model.generate`` and returns
each sampled token's logprob under the sampling distribution (after temperature and top-k/top-p, as vLLM's
``processed_logprobs``), so TRL passes them on as ``sampling_per_token_logps`` and the guard has an engine to
compare with the trainer even with ``use_vllm=False``. It samples from the policy itself, optionally in another
dtype (``engine_dtype=torch.bfloat16`` next to an fp32 trainer gives real engine/trainer numeric noise).

With ``stale_context_rate > 0`` it also injects the stale-state corruption: the selected rollouts are generated
from another request's prompt and attributed to their own (see ``rollout_guard.injection``).

    trainer = GRPOTrainer(..., args=GRPOConfig(use_vllm=False, ...), rollout_func=TransformersRollouts())
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

from rollout_guard.injection import choose_rows, plan_injection


class TransformersRollouts:
    def __init__(self, stale_context_rate: float = 0.0, seed: int = 0, engine_dtype: torch.dtype | None = None,
                 generation_batch_size: int | None = None) -> None:
        self.stale_context_rate = stale_context_rate
        self.seed = seed
        self.engine_dtype = engine_dtype
        self.generation_batch_size = generation_batch_size
        self.generator: torch.Generator | None = None
        self.last_selected: torch.Tensor | None = None
        self.total_injected = 0

    def __call__(self, prompts: list, trainer: Any) -> dict[str, list]:
        if self.generator is None:
            self.generator = torch.Generator().manual_seed(self.seed * 1000 + trainer.accelerator.process_index)
            if self.stale_context_rate > 0:
                trainer._rollout_guard_injector = self
        prompt_ids, _, _ = trainer._tokenize_prompts(prompts)
        selected = choose_rows(len(prompt_ids), self.stale_context_rate, self.generator)
        plan = plan_injection(prompt_ids, selected, group_size=trainer.num_generations)
        self.last_selected = plan.selected
        self.total_injected += int(plan.selected.sum())
        completion_ids, logprobs = [], []
        step = self.generation_batch_size or len(plan.contexts)
        for start in range(0, len(plan.contexts), max(step, 1)):
            ids, lps = self._sample(plan.contexts[start : start + step], trainer)
            completion_ids += ids
            logprobs += lps
        return {"prompt_ids": [list(ids) for ids in prompt_ids], "completion_ids": completion_ids, "logprobs": logprobs}

    @torch.no_grad()
    def _sample(self, contexts: list[list[int]], trainer: Any) -> tuple[list[list[int]], list[list[float]]]:
        # as TRL generates without vLLM: its unwrapping (gathers ZeRO-3 parameters) and, under FSDP1, the root
        # unit's parameters gathered first (else a decoder layer's FSDP unit, run first, takes itself for the root
        # and the next forward of the real root fails: "Non-root FSDP instance's `_is_root` should not have been set")
        from trl.models import unwrap_model_for_generation

        wrapped = getattr(trainer, "model_wrapped", None)
        wrapped = trainer.model if wrapped is None else wrapped
        with (unwrap_model_for_generation(wrapped, trainer.accelerator) as model,
              trainer._dist.summon_full_params(wrapped, recurse=False)):
            return self._generate(model, contexts, trainer)

    def _generate(self, model: Any, contexts: list[list[int]],
                  trainer: Any) -> tuple[list[list[int]], list[list[float]]]:
        tokenizer = trainer._tokenizer
        device = trainer.accelerator.device
        width = max(len(ids) for ids in contexts)
        input_ids = torch.full((len(contexts), width), tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(contexts), width), dtype=torch.long)
        for row, ids in enumerate(contexts):  # left padding
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention[row, width - len(ids) :] = 1
        was_training = model.training
        model.eval()
        dtype = next(model.parameters()).dtype
        autocast = (torch.autocast(device.type, dtype=self.engine_dtype) if self.engine_dtype not in (None, dtype)
            else contextlib.nullcontext())
        config = copy.deepcopy(trainer.generation_config)  # TRL's own: temperature, top-p/k, min-p, penalties
        config.output_scores = True
        config.return_dict_in_generate = True
        with autocast:
            out = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                                 generation_config=config)
        if was_training:
            model.train()
        sequences = out.sequences[:, width:]
        scores = torch.stack(out.scores, dim=1).float()  # (B, T, V) processed logits of each step
        token_logprobs = torch.log_softmax(scores, dim=-1).gather(-1, sequences.unsqueeze(-1)).squeeze(-1)
        eos = getattr(trainer, "eos_token_ids", None)  # TRL 1.14.1 on; 1.14.0 ends at the tokenizer's EOS only
        if eos is None:
            tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
            eos = [tokenizer.eos_token_id]
        is_eos = torch.isin(sequences, torch.tensor(list(eos), device=sequences.device))
        after_eos = (is_eos.cumsum(dim=1) - is_eos.long()) > 0  # tokens after the first EOS are padding
        lengths = (~after_eos).sum(dim=1).tolist()
        sequences, token_logprobs = sequences.cpu(), token_logprobs.cpu()
        return ([sequences[row, :n].tolist() for row, n in enumerate(lengths)],
                [token_logprobs[row, :n].tolist() for row, n in enumerate(lengths)])
