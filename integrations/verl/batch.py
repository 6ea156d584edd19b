"""Pure functions on a verl batch (a ``DataProto``): the evidence the guard judges, the rows left out of the
advantages, and the advantages computed without them.

verl's group estimators (GRPO, RLOO, REINFORCE++ with baseline, GPG, OPO, …) average every row that shares a
``uid``, including rows whose ``response_mask`` was zeroed. Here the left-out rows are removed from the batch before
verl's own advantage function runs, so that they vote in no baseline and no batch statistic, whatever the estimator;
their advantages and returns are 0 and their ``response_mask`` is zero, so the loss and its normaliser (verl counts
``response_mask`` tokens) skip them. None of these functions imports verl: they take its objects as they come.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from rollout_guard.errors import GuardInputError
from rollout_guard.evidence import RolloutEvidence

ENGINE_KEY = "rollout_log_probs"  # the engine's logprob of each sampled token (rollout.calculate_log_probs)
TRAINER_KEY = "old_log_probs"  # the trainer's, from verl's old-logprob pass (the engine's own in bypass mode)
MASK_KEY = "response_mask"


def evidence_of(tensors: Any, bypass: bool) -> RolloutEvidence:
    """The guard's evidence from a verl batch's tensors (``DataProto.batch``, padded (B, T)): the engine's
    ``rollout_log_probs``, the trainer's ``old_log_probs`` and ``response_mask``. In bypass mode verl copies the
    engine's logprobs into ``old_log_probs``: the trainer side is then left out (comparing the engine with itself
    would find nothing), and the guard checks the engine's logprobs for NaN/±inf only. A missing side is left out
    the same way; a float mask counts its nonzero tokens; a missing mask raises :class:`GuardInputError` naming it."""
    keys = set(tensors.keys())
    if MASK_KEY not in keys:
        raise GuardInputError(MASK_KEY, "not in the verl batch", "run the guard after verl has set response_mask")
    engine = tensors[ENGINE_KEY].float() if ENGINE_KEY in keys else None
    trainer = tensors[TRAINER_KEY].float() if TRAINER_KEY in keys and not bypass else None
    mask = tensors[MASK_KEY]
    return RolloutEvidence(mask=mask != 0 if mask.is_floating_point() else mask, engine_logprobs=engine,
                           trainer_logprobs=trainer)


NEUTRAL_KEYS = ("old_log_probs", "rollout_log_probs", "ref_log_prob", "rollout_is_weights")
"""The per-token float fields of a verl batch that the actor's losses read besides ``advantages``."""


def neutral_rows(data: Any, excluded: torch.Tensor) -> list[str]:
    """Fill every :data:`NEUTRAL_KEYS` field of ``data`` (a ``DataProto``) with 0.0 on the ``excluded`` rows ((B,)
    bool), in place; returns the fields filled. A masked row still passes through the loss's arithmetic before the
    mask: a NaN or ±inf there (a corrupted engine's logprobs, in bypass mode the old logprobs too) turns into a NaN
    gradient under several of verl's policy losses (``dppo_tv``, ``dppo_kl``, …) although the loss value is finite.

    >>> from types import SimpleNamespace
    >>> data = SimpleNamespace(batch={"old_log_probs": torch.tensor([[float("nan")], [-1.0]])})
    >>> neutral_rows(data, torch.tensor([True, False])), data.batch["old_log_probs"].flatten().tolist()
    (['old_log_probs'], [0.0, -1.0])
    """
    filled = []
    for key in NEUTRAL_KEYS:
        if key in data.batch.keys():
            values = data.batch[key]
            rows = excluded.to(values.device).bool().view(-1, *([1] * (values.dim() - 1)))
            data.batch[key] = values.masked_fill(rows, 0.0)
            filled.append(key)
    return filled


def trajectory_of(batch_keys: Sequence[str]) -> list[str]:
    """The agent-loop trajectory of each row of a verl v1 batch: its key ``{uid}_{trajectory}_{output}`` without
    the output index (verl's ``session_id`` is the middle part). The outputs of one trajectory share the advantage of
    its final output.

    >>> trajectory_of(["a_0_0", "a_0_1", "b_3_0"])
    ['a_0', 'a_0', 'b_3']
    """
    trajectories = []
    for key in batch_keys:
        parts = str(key).rsplit("_", 2)
        if len(parts) != 3:
            raise GuardInputError("batch.keys", f"key {key!r} is not '{{uid}}_{{trajectory}}_{{index}}'",
                                  "use the guarded trainer with verl's v1 TransferQueue batches")
        trajectories.append(f"{parts[0]}_{parts[1]}")
    return trajectories


def widen_to_trajectories(rows: torch.Tensor, trajectories: Sequence[str]) -> torch.Tensor:
    """``rows`` (B,) bool, widened to every row of a trajectory that has one selected row: a trajectory's outputs
    share one advantage, so a corrupted turn takes its whole trajectory out.

    >>> widen_to_trajectories(torch.tensor([False, True, False]), ["a_0", "a_0", "b_0"])
    tensor([ True,  True, False])
    """
    names = {name: index for index, name in enumerate(dict.fromkeys(trajectories))}
    ids = torch.tensor([names[name] for name in trajectories], dtype=torch.long)
    hit = torch.zeros(len(names), dtype=torch.bool).index_fill_(0, ids[rows.cpu().bool()], True)
    return hit[ids].to(rows.device)


def rejected_whole(mask_before: torch.Tensor, mask_after: torch.Tensor) -> torch.Tensor:
    """(B,) bool: rows that had loss tokens before and none after (verl's ``rollout_rs`` rejected them whole).

    >>> rejected_whole(torch.tensor([[1, 1], [1, 0], [0, 0]]), torch.tensor([[0, 0], [1, 0], [0, 0]]))
    tensor([ True, False, False])
    """
    return (mask_before.sum(dim=-1) > 0) & (mask_after.sum(dim=-1) == 0)


def thin_groups(excluded: torch.Tensor, uid: Sequence[Any], min_kept: int) -> torch.Tensor:
    """``excluded`` (B,) bool, widened to every row of a group (rows sharing a ``uid``) left with fewer than
    ``min_kept`` rows: an estimator that needs that many (verl's ``grpo_passk``: 2) gets none of such a group.

    >>> thin_groups(torch.tensor([True, False, False, False]), ["a", "a", "b", "b"], 2).tolist()
    [True, True, False, False]
    """
    names = {name: index for index, name in enumerate(dict.fromkeys(uid))}
    ids = torch.tensor([names[name] for name in uid], dtype=torch.long)
    kept = torch.zeros(len(names), dtype=torch.long).index_add_(0, ids, (~excluded.cpu().bool()).long())
    return excluded.cpu().bool() | (kept[ids] < min_kept)


def advantages_without(data: Any, excluded: torch.Tensor, compute: Callable[[Any, torch.Tensor], Any]) -> Any:
    """``data`` (a ``DataProto``) with ``advantages`` and ``returns`` from ``compute`` run on the rows not
    ``excluded`` ((B,) bool) only: ``compute(kept_data, kept_index)`` is verl's advantage function on
    ``data.select_idxs(kept_index)``. Excluded rows get advantages and returns 0 and a zero ``response_mask``.
    With nothing excluded this is ``compute(data, all rows)`` itself. Returns ``data``, changed in place."""
    excluded = excluded.cpu().bool()
    if not excluded.any():
        return compute(data, torch.arange(len(data)))
    mask = data.batch[MASK_KEY]
    data.batch[MASK_KEY] = mask * (~excluded).to(mask.device).unsqueeze(-1).to(mask.dtype)
    kept = torch.nonzero(~excluded).flatten()
    shape = data.batch[MASK_KEY].shape
    if kept.numel() == 0:
        data.batch["advantages"] = torch.zeros(shape, dtype=torch.float32, device=mask.device)
        data.batch["returns"] = torch.zeros(shape, dtype=torch.float32, device=mask.device)
        return data
    part = compute(data.select_idxs(kept), kept)
    for key in ("advantages", "returns"):
        values = part.batch[key]
        full = torch.zeros(shape, dtype=values.dtype, device=values.device)
        full[kept.to(values.device)] = values
        data.batch[key] = full
    return data
