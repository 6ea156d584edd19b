"""Evidence: what the guard looks at for one batch of rollouts, checked for structure.

Three B×T tensors, aligned token by token over the completions: the engine's logprob of each sampled token
(what the inference engine believed when it sampled), the trainer's logprob of the same token given the same
prompt, and the mask of tokens that count (the loss mask). Either logprob tensor may be missing: without engine
logprobs, or without trainer logprobs, the guard can only check the one side for non-finite values (every other
rule compares the two).

Data problems (NaN, ±inf, empty rows) are not errors here: they are evidence, judged by the verdict rules.
Structural problems (wrong shape, dtype, device) raise :class:`GuardInputError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout_guard.errors import GuardInputError


@dataclass(frozen=True)
class RolloutEvidence:
    mask: torch.Tensor
    """(B, T) bool or integer; nonzero where the token counts (the loss mask). Padding must be zero."""

    engine_logprobs: torch.Tensor | None = None
    """(B, T) float; the engine's logprob of each sampled token, NaN where the engine gave none."""

    trainer_logprobs: torch.Tensor | None = None
    """(B, T) float; the trainer's logprob of the same tokens given the same prompt."""

    injected: torch.Tensor | None = None
    """(B,) bool; ground truth from a fault injector, used only to score detection (never by the verdict)."""

    @property
    def batch_size(self) -> int:
        return self.mask.shape[0]

    @property
    def device(self) -> torch.device:
        return self.mask.device

    @property
    def has_engine(self) -> bool:
        return self.engine_logprobs is not None

    @property
    def has_trainer(self) -> bool:
        return self.trainer_logprobs is not None

    def validated(self) -> RolloutEvidence:
        """Return self after checking structure; raises GuardInputError naming the first bad field."""
        mask = self.mask
        if not isinstance(mask, torch.Tensor):
            raise GuardInputError("mask", f"expected a torch.Tensor, got {type(mask).__name__}",
                                  "pass the (B, T) loss mask")
        if mask.dim() != 2:
            raise GuardInputError("mask", f"expected 2 dimensions (B, T), got shape {tuple(mask.shape)}",
                                  "pass the (B, T) loss mask")
        if mask.is_floating_point() or mask.is_complex():
            raise GuardInputError("mask", f"expected bool or integer dtype, got {mask.dtype}",
                                  "pass mask.bool() or mask.long()")
        if self.engine_logprobs is None and self.trainer_logprobs is None:
            raise GuardInputError(
                "engine_logprobs/trainer_logprobs", "both are missing", "pass at least one of the two logprob tensors"
            )
        for name in ("engine_logprobs", "trainer_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, torch.Tensor):
                raise GuardInputError(name, f"expected a torch.Tensor, got {type(value).__name__}",
                                      "pass a (B, T) float tensor")
            if tuple(value.shape) != tuple(mask.shape):
                raise GuardInputError(
                    name,
                    f"shape {tuple(value.shape)} does not match mask shape {tuple(mask.shape)}",
                    "align both tensors with the completion tokens (same B and T, right-padded)",
                )
            if not value.is_floating_point():
                raise GuardInputError(name, f"expected a floating dtype, got {value.dtype}", f"pass {name}.float()")
            if value.device != mask.device:
                raise GuardInputError(name, f"on {value.device} but mask is on {mask.device}",
                                      "move both to one device")
        if self.injected is not None and tuple(self.injected.shape) != (mask.shape[0],):
            raise GuardInputError(
                "injected", f"expected shape ({mask.shape[0]},), got {tuple(self.injected.shape)}",
                "pass one flag per sample"
            )
        return self
