"""The trainer's logprobs on the engine's support, from the pass that already computes them.

vLLM's processed logprobs are renormalised over what min-p, top-k and top-p kept; TRL's are over the whole
vocabulary (:mod:`rollout_guard.support`). While TRL (or the guard's own pass) scores the sampled tokens, a
forward hook on the model's backbone takes its last hidden states, projects them through the LM head in tiles
and keeps, per completion token, the trainer's ``log Z`` of the engine's support (:func:`kept_log_mass`). The
guard then judges ``trainer − log Z``: no extra forward pass, one LM-head projection more and a ``topk`` of the
vocabulary per completion token (:func:`support_settings` says which settings it serves).

Per token, the hook also recomputes the trainer's logprob of the sampled token from the same logits; where it
differs from TRL's by more than :data:`AGREEMENT` (a logit transform this module does not know), that token's
``log Z`` is 0, i.e. the guard sees the uncorrected logprob there and its detector's centres absorb the offset as they do
without this module. No host sync.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from rollout_guard.integrations.trl.sampling import _setting_reader, support_changes
from rollout_guard.support import TIES, head_logsumexp, kept_log_mass, logits_logsumexp, scaled_logits

AGREEMENT = 0.1  # nats: the recomputed logprob of the sampled token must be this close to TRL's (bf16 logits: ~0.01)
TILE_ELEMENTS = 1 << 25  # logits per tile (128 MiB in float32): tokens per tile = this // vocabulary size
_CUTS = ("top_p=", "top_k=", "min_p=")  # the support_changes entries this module compares on


def support_settings(trainer: Any) -> tuple[int, float, float] | None:
    """``(top_k, top_p, min_p)`` when the engine's support is cut by top-k (with or without top-p and min-p) or by
    min-p alone; None otherwise, and the detector's centres absorb the offset: when nothing is cut; when
    something else changes the engine's logits too (penalties, guided decoding, logit bias: the trainer's logits
    are not the engine's there, so its ``log Z`` of them would not be the engine's); and under top-p without
    top-k, whose offset is at most ``−log top_p`` (0.105 nats at 0.9) while its ``log Z`` needs a sort of the
    vocabulary per token: +296 ms, 222 % of TRL's scoring pass on an H200 (1.5 B-parameter shape, vocabulary
    151,936, ``benchmarks/support_overhead.py``). What changes the engine's logits is read by
    :func:`~rollout_guard.integrations.trl.sampling.support_changes`, as the attach message names it."""
    if any(not change.startswith(_CUTS) for change in support_changes(trainer)):
        return None
    setting = _setting_reader(trainer)
    top_k = max(int(setting("top_k", 0) or 0), 0)
    top_p = float(setting("top_p", 1.0) if setting("top_p", 1.0) is not None else 1.0)
    min_p = float(setting("min_p", 0.0) or 0.0)
    if top_k == 0 and (min_p <= 0.0 or top_p < 1.0):
        return None  # nothing cut, or top-p without top-k (see the docstring)
    return top_k, top_p, min_p


def cuts_support(trainer: Any) -> bool:
    """Whether the engine's support is cut by top-k or min-p, so that its processed logprobs carry an offset
    ``−log Z`` that varies from token to token (top-p alone: at most ``−log top_p``)."""
    setting = _setting_reader(trainer)
    return max(int(setting("top_k", 0) or 0), 0) > 0 or float(setting("min_p", 0.0) or 0.0) > 0.0


def logit_transform(config: Any) -> tuple[float, float | None]:
    """``(scale, softcap)`` a model applies to ``lm_head(hidden)``, read as TRL's fused LM head reads them
    (``trl.trainer.utils.add_fused_lm_head``): ``logit_scale``, ``output_multiplier``, ``lm_head_multiplier``
    (Falcon-H1) or ``logits_scaling`` (divides; HyperCLOVA X multiplies), and ``final_logit_softcapping``."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = getattr(text, "logit_scale", None)
    if scale is None:
        scale = getattr(text, "output_multiplier", None)
    if scale is None:
        scale = getattr(text, "lm_head_multiplier", None)
    if scale is None and getattr(text, "logits_scaling", None) is not None:
        scale = text.logits_scaling if getattr(text, "model_type", "") == "hyperclovax" else 1 / text.logits_scaling
    return (1.0 if scale is None else float(scale)), getattr(text, "final_logit_softcapping", None)


def _parts(model: Any) -> tuple[torch.nn.Module, torch.nn.Module, Any] | None:
    """The backbone, the LM head and the config of a (PEFT-wrapped) causal LM; None where it has no such parts."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    backbone = getattr(model, "base_model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if backbone is None or backbone is model or head is None:
        return None
    return backbone, head, model.config


def head_vocabulary(head: torch.nn.Module) -> int:
    """The LM head's output size: an ``nn.Linear``'s ``out_features``, else its weight's rows. Metadata, not the
    weight: DeepSpeed ZeRO-3 empties the weight outside the head's forward, and reading it during another module's
    forward (the backbone's hook) makes ZeRO-3 gather it there and register it as an external parameter of the
    model's root (as deepspeed 0.19.8 does)."""
    size = getattr(head, "out_features", None)
    return int(size) if size else int(head.weight.shape[0])


def token_log_mass(hidden: torch.Tensor, ids: torch.Tensor, head: torch.nn.Module, scale: float, softcap: float | None,
                   temperature: float, settings: tuple[int, float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position of ``hidden`` (B, K, H) predicting ``ids`` (B, K): ``(log Z, log p(id))``, both (B, K) float32,
    from ``head(hidden)`` scaled, soft-capped and divided by the temperature as TRL does, in tiles of at most
    :data:`TILE_ELEMENTS` logits. Per tile: :func:`head_logsumexp` (on CUDA one Triton pass over the head's output,
    no float32 copy) and, under top-k, a ``topk`` of the head's own output (bf16 on a bf16 model: the logits' map is
    monotone, :func:`scaled_logits`) whose k + :data:`~rollout_guard.support.TIES` values alone go through
    :func:`kept_log_mass`; min-p alone scales the whole tile once (its sum, its own logprob and its mass)."""
    top_k, top_p, min_p = settings
    flat, flat_ids = hidden.reshape(-1, hidden.shape[-1]), ids.reshape(-1)
    vocabulary = head_vocabulary(head)
    tile = max(1, TILE_ELEMENTS // vocabulary)
    masses, own = [], []
    for start in range(0, flat.shape[0], tile):
        raw = head(flat[start : start + tile])
        chosen = flat_ids[start : start + tile].clamp(0, vocabulary - 1)
        if 0 < top_k < vocabulary:
            total, own_logprob = head_logsumexp(raw, chosen, scale, softcap, temperature)
            top = raw.topk(min(top_k + TIES, vocabulary), dim=-1).values
            logits = scaled_logits(top, scale, softcap, temperature)
        else:  # min-p alone (or k ≥ V) needs the whole tile scaled: once, for the sum and the mass
            logits = scaled_logits(raw, scale, softcap, temperature)
            total, own_logprob = logits_logsumexp(logits, chosen)
        masses.append(kept_log_mass(logits, top_k=top_k, top_p=top_p, min_p=min_p, total=total))
        own.append(own_logprob)
    shape = ids.shape
    return torch.cat(masses).reshape(shape), torch.cat(own).reshape(shape)


class SupportCapture:
    """Captures, while active, the trainer's ``log Z`` of the engine's support for the tokens TRL's
    ``_get_per_token_logps_and_entropies`` scores with the policy model: one ``(B, K)`` tensor per call, aligned
    with the logprobs that call returns, in :attr:`calls`."""

    def __init__(self, trainer: Any, settings: tuple[int, float, float]) -> None:
        self.trainer = trainer
        self.settings = settings
        self.calls: list[torch.Tensor] = []
        self.error: BaseException | None = None  # what failed in the hook (an unknown model, an LM head it cannot call)

    @contextlib.contextmanager
    def active(self, first_only: bool = False) -> Iterator[SupportCapture]:
        """Wrap this trainer's ``_get_per_token_logps_and_entropies`` (its instance only) for the block; with
        ``first_only``, only its first call with the policy model (TRL's trainer logprobs come before its
        reference logprobs, which a PEFT run scores with the same model)."""
        trainer = self.trainer
        name = "_get_per_token_logps_and_entropies"
        had_own = name in vars(trainer)
        original = getattr(trainer, name)
        self.calls = []

        def wrapped(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                    *args: Any, **kwargs: Any) -> Any:
            unwrapped = trainer.accelerator.unwrap_model(model)
            policy = unwrapped is trainer.accelerator.unwrap_model(trainer.model)
            parts = _parts(unwrapped) if policy and not (first_only and self.calls) else None
            if parts is None:
                return original(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
            backbone, head, config = parts
            scale, softcap = logit_transform(config)
            temperature = float(getattr(trainer, "temperature", 1.0) or 1.0)
            chunks: list[tuple[torch.Tensor, torch.Tensor]] = []

            def hook(module: Any, hook_args: tuple, hook_kwargs: dict, output: Any) -> None:
                if self.error is not None:
                    return
                try:  # never into TRL's forward: a failure here leaves log Z = 0 (the adapter reports it)
                    hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
                    ids = hook_kwargs.get("input_ids", hook_args[0] if hook_args else None)
                    with torch.no_grad():
                        chunks.append(token_log_mass(hidden[:, -logits_to_keep - 1 : -1].detach(),
                                                     ids[:, -logits_to_keep:],
                                                     head, scale, softcap, temperature, self.settings))
                except Exception as error:  # noqa: BLE001
                    self.error = error

            handle = backbone.register_forward_hook(hook, with_kwargs=True)
            try:
                output = original(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
            finally:
                handle.remove()
            logprobs = output[0]
            if self.error is not None or not chunks or sum(mass.shape[0] for mass, _ in chunks) != logprobs.shape[0]:
                self.calls.append(torch.zeros_like(logprobs, dtype=torch.float32))  # not the pass it expected
                return output
            mass, own = (torch.cat(part).to(logprobs.device) for part in zip(*chunks, strict=True))
            agrees = (own - logprobs.float()).abs() <= AGREEMENT
            self.calls.append(torch.where(agrees, mass, torch.zeros_like(mass)))
            return output

        setattr(trainer, name, wrapped)
        try:
            yield self
        finally:
            if had_own:
                setattr(trainer, name, original)
            else:
                delattr(trainer, name)

    def first(self) -> torch.Tensor | None:
        """The first captured call's ``log Z`` (B, K), or None."""
        return self.calls[0] if self.calls else None


def describe(settings: tuple[int, float, float] | None) -> str:
    """``top_k=…, top_p=…, min_p=…`` of the settings that are on, for messages."""
    if settings is None:
        return "none"
    top_k, top_p, min_p = settings
    parts = [f"top_k={top_k}"] * (top_k > 0) + [f"top_p={top_p:g}"] * (top_p < 1) + [f"min_p={min_p:g}"] * (min_p > 0)
    return ", ".join(parts) or "none"
