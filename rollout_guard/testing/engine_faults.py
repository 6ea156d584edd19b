"""FAULT INJECTION FOR TESTS — never enabled by default; nothing in rollout_guard imports this module.

Reinstates, inside the current process, the vLLM bug that PR #32118 ("Fix stale SSM state for new Mamba requests
scheduled as decode") fixed, so that tests, ``rollout-guard audit --stress`` and the fidelity benchmark can check
that real engine-state corruption is caught. Only this process's vLLM changes, and only while the fault is on.

The bug. When the scheduler's token budget is nearly spent, a *new* request can get exactly one scheduled token
(the first token of its prompt). Before the fix, Mamba's metadata builder classified every row by query length
alone, so that 1-token row ran through the *decode* kernels, which read the conv and SSM state already in the
request's cache slot — state a finished request left there when the slot was recycled — instead of starting from
zeros. The rest of the prompt then ran as a chunked prefill continuing from that corrupted state, and every
generated token after it. The fix (vLLM 0.31 ships it) passes ``treat_short_extends_as_decodes=False`` to
``split_decodes_and_prefills`` in ``vllm/v1/attention/backends/mamba_attn.py`` (a row still in its prompt is a
prefill whatever its length), and the batch reorder puts requests without context after everything else.

The patch undoes both, as they were before the fix:

* ``mamba_attn.split_decodes_and_prefills`` is called with ``treat_short_extends_as_decodes=True`` (rows are split
  by query length only);
* ``gpu_model_runner.reorder_batch_to_split_decodes_and_prefills`` orders the batch decode → extend → prefill
  with "decode" meaning ``num_scheduled_tokens <= threshold`` (the three-region order of that time), so a new
  1-token request lands among the decodes.

It fires only when a new request gets exactly one token *and* its cache slot holds another request's state:
use a tight token budget (``max_num_batched_tokens`` = ``max_num_seqs``: with ``max_num_seqs - 1`` requests
decoding, a newcomer gets one token) and few state slots (``num_gpu_blocks_override``) so slots are recycled
fast; a never-used slot is zeros, on which the decode path happens to compute the right thing.
:func:`stress_engine_kwargs` gives such settings. :data:`FAULT_STATS` counts the rows the fault ran as decodes.

Works with an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by :func:`enable_stale_mamba_state_fault`;
an engine-core subprocess would not see the patch) and inside TRL's colocate engine (in-process): call
:func:`enable_stale_mamba_state_fault_in_trl` before the ``GRPOTrainer`` is built (and, for the control run with
the same engine settings and no fault, :func:`stress_trl_colocate_engine`).

    with stale_mamba_state_fault():
        llm = vllm.LLM(model, dtype="bfloat16", enforce_eager=True, **stress_engine_kwargs())
        outputs = llm.generate(...)
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

FAULT_NAME = "vllm-pr-32118-stale-mamba-state"

FAULT_STATS: dict[str, int] = {"new_rows_run_as_decode": 0, "batches": 0}
"""How often the fault fired since :func:`enable_stale_mamba_state_fault`: new requests (no computed token yet)
whose one scheduled token ran through the decode kernels, and metadata batches seen."""

_ORIGINALS: dict[str, Any] = {}


def _prefix_reorder(input_batch: Any, scheduler_output: Any, decode_threshold: int = 1) -> bool:
    """The batch reorder before the fix: decode (``num_scheduled <= threshold``, new or not) → extend → prefill.

    Stable within each region; moves rows with ``input_batch.swap_states`` as vLLM's own reorder does.
    """
    num_reqs = len(input_batch.req_ids)
    scheduled = np.array([scheduler_output.num_scheduled_tokens[i] for i in input_batch.req_ids])
    computed = input_batch.num_computed_tokens_cpu[:num_reqs]
    is_decode = scheduled <= decode_threshold
    region = np.where(is_decode, 0, np.where(computed > 0, 1, 2))
    order = np.argsort(region, kind="stable")  # order[k] = current index of the row that belongs at k
    if (order == np.arange(num_reqs)).all():
        return False
    position = np.arange(num_reqs)  # position[r] = where original row r sits now
    occupant = np.arange(num_reqs)  # occupant[k] = original row now at k
    for target, row in enumerate(order):
        source = position[row]
        if source != target:
            input_batch.swap_states(target, source)
            displaced = occupant[target]
            occupant[target], occupant[source] = row, displaced
            position[row], position[displaced] = target, source
    return True


def _prefix_split(original: Any) -> Any:
    @functools.wraps(original)
    def split(common_attn_metadata: Any, decode_threshold: int = 1, require_uniform: bool = False,
              treat_short_extends_as_decodes: bool = True) -> tuple[int, int, int, int]:
        result = original(common_attn_metadata, decode_threshold=decode_threshold, require_uniform=require_uniform,
                          treat_short_extends_as_decodes=True)
        num_decodes = result[0]
        FAULT_STATS["batches"] += 1
        if num_decodes:
            query_start = common_attn_metadata.query_start_loc_cpu
            query_lens = (query_start[1:] - query_start[:-1])[:num_decodes]
            seq_lens = common_attn_metadata.seq_lens_cpu_upper_bound
            if seq_lens is not None:
                FAULT_STATS["new_rows_run_as_decode"] += int(((seq_lens[:num_decodes] == query_lens)
                                                              & (query_lens > 0)).sum())
        return result

    return split


def enable_stale_mamba_state_fault() -> None:
    """Turn the fault on in this process (idempotent). Engines built afterwards — and running ones, at their next
    step — run new 1-token Mamba requests as decodes on whatever state their cache slot holds."""
    import vllm.v1.attention.backends.mamba_attn as mamba_attn
    import vllm.v1.worker.gpu_model_runner as gpu_model_runner

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core must run in this process to see the patch
    if _ORIGINALS:
        return
    _ORIGINALS["split"] = mamba_attn.split_decodes_and_prefills
    _ORIGINALS["reorder"] = gpu_model_runner.reorder_batch_to_split_decodes_and_prefills
    mamba_attn.split_decodes_and_prefills = _prefix_split(_ORIGINALS["split"])
    gpu_model_runner.reorder_batch_to_split_decodes_and_prefills = _prefix_reorder
    FAULT_STATS.update(new_rows_run_as_decode=0, batches=0)


def disable_stale_mamba_state_fault() -> None:
    """Restore vLLM's own (fixed) functions. ``VLLM_ENABLE_V1_MULTIPROCESSING`` stays as it is."""
    if not _ORIGINALS:
        return
    import vllm.v1.attention.backends.mamba_attn as mamba_attn
    import vllm.v1.worker.gpu_model_runner as gpu_model_runner

    mamba_attn.split_decodes_and_prefills = _ORIGINALS.pop("split")
    gpu_model_runner.reorder_batch_to_split_decodes_and_prefills = _ORIGINALS.pop("reorder")


def stale_mamba_state_fault_enabled() -> bool:
    return bool(_ORIGINALS)


@contextmanager
def stale_mamba_state_fault() -> Iterator[dict[str, int]]:
    """The fault on inside the block (yields :data:`FAULT_STATS`), off after it."""
    enable_stale_mamba_state_fault()
    try:
        yield FAULT_STATS
    finally:
        disable_stale_mamba_state_fault()


def stress_engine_kwargs(max_num_seqs: int = 8, max_num_batched_tokens: int | None = None,
                         num_state_slots: int | None = None) -> dict[str, Any]:
    """``vllm.LLM`` arguments under which the fault fires: a token budget equal to ``max_num_seqs`` (a newcomer
    next to ``max_num_seqs - 1`` decoding requests gets one token) and ``num_state_slots`` cache blocks (default
    ``2 * max_num_seqs + 2``), so a finished request's slot is soon handed to a new one."""
    return {
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens or max_num_seqs,
        "num_gpu_blocks_override": num_state_slots or 2 * max_num_seqs + 2,
        "enable_chunked_prefill": True,
    }


def stress_trl_colocate_engine(max_num_seqs: int = 8, max_num_batched_tokens: int | None = None,
                               num_state_slots: int | None = None) -> dict[str, Any]:
    """Make the ``LLM`` that TRL's colocate mode constructs use :func:`stress_engine_kwargs` (TRL hard-codes
    ``max_num_batched_tokens=4096``, under which a new request never gets a single token). No fault by itself:
    the control run of a fault test. Call before ``GRPOTrainer(...)``; a later call replaces the settings.
    Returns the settings."""
    import trl.generation.vllm_generation as vllm_generation

    _TRL_STRESS.clear()
    _TRL_STRESS.update(stress_engine_kwargs(max_num_seqs, max_num_batched_tokens, num_state_slots))
    if not getattr(vllm_generation.LLM, "_rollout_guard_stress", False):
        original_llm = vllm_generation.LLM

        @functools.wraps(original_llm)
        def llm_under_stress(*args: Any, **kwargs: Any) -> Any:
            kwargs.update(_TRL_STRESS)
            return original_llm(*args, **kwargs)

        llm_under_stress._rollout_guard_stress = True  # type: ignore[attr-defined]
        vllm_generation.LLM = llm_under_stress
    return dict(_TRL_STRESS)


_TRL_STRESS: dict[str, Any] = {}


def enable_stale_mamba_state_fault_in_trl(max_num_seqs: int = 8, max_num_batched_tokens: int | None = None,
                                          num_state_slots: int | None = None) -> dict[str, Any]:
    """Turn the fault on for TRL's colocate engine: call once before ``GRPOTrainer(...)`` is built (after
    ``enable_trl_colocate_on_vllm_cpu(dtype="bfloat16")`` on the CPU build: Mamba2 runs in bf16 only there).
    :func:`stress_trl_colocate_engine` plus :func:`enable_stale_mamba_state_fault`; returns the engine settings.
    :data:`FAULT_STATS` counts the firings."""
    settings = stress_trl_colocate_engine(max_num_seqs, max_num_batched_tokens, num_state_slots)
    enable_stale_mamba_state_fault()
    return settings


if __name__ == "__main__":
    # `python -m rollout_guard.testing.engine_faults audit MODEL --stress ...`: the rollout-guard command line
    # with the fault switched on in this process (for tests and the README's demonstration only).
    import sys

    from rollout_guard.cli import app

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # as the CLI does; the patch imports vLLM before it runs
    enable_stale_mamba_state_fault()
    print(f"FAULT INJECTION FOR TESTS: {FAULT_NAME} is on in this process", file=sys.stderr)
    try:
        app(prog_name="rollout-guard")
    finally:
        print(f"fault fired: {FAULT_STATS['new_rows_run_as_decode']} new 1-token requests ran as decodes "
              f"({FAULT_STATS['batches']} batches)", file=sys.stderr)
