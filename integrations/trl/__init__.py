"""TRL adapter: one line guards an existing ``GRPOTrainer``.

    trainer = GRPOTrainer(...)
    attach_guard(trainer)          # <- the one line
    trainer.train()

TRL gives callbacks neither the batch nor the trainer, so a pure ``TrainerCallback`` cannot act before the
loss. ``attach_guard`` wraps three methods of this trainer instance (no subclassing, nothing global) and adds
one callback:

* ``_generate_and_score_completions``: after TRL builds the batch (engine logprobs from vLLM, its own trainer
  logprobs, rewards, advantages, loss normaliser), the guard judges every sample and, in quarantine mode,
  zeroes the loss mask of suspect samples, recomputes their groups' advantages without them and corrects
  ``num_items_in_batch``. Runs in training mode only; evaluation batches pass through.
* ``_calculate_rewards``: only records the (all-process) reward matrix the advantages are computed from.
* ``_load_optimizer_and_scheduler``: where TRL itself restores its own extra state on resume; the guard
  restores its running state from the same checkpoint folder.
* the callback saves that state with every checkpoint (``on_save``), stops training when the circuit breaker
  trips (``on_step_end``) and closes the sinks (``on_train_end``).

Trainer logprobs: TRL computes them whenever vLLM importance-sampling correction is on (its default), and the
guard reuses them: no extra forward pass. Otherwise the guard runs one no-grad forward pass over the
generation batch (``GuardConfig.compute_trainer_logprobs``), or, if that is off, checks non-finite engine logprobs
only. Without an engine (``use_vllm=False``, no ``rollout_func``) it runs no pass and checks non-finite values of
the trainer logprobs TRL computes itself, if any.

Truncated rows: with ``mask_truncated_completions`` TRL zeroes their masks before the guard runs, yet their
rewards set their groups' baselines. The guard judges them (judged mask: their tokens, tool mask kept; the loss
mask stays TRL's), with trainer logprobs from one no-grad pass over those rows only (TRL's are computed under a
zero attention mask), and takes flagged ones out of the baseline like any quarantined row. ``_generate`` is
wrapped to keep the token lists TRL decides truncation from (host data: no device sync).

One concern per module:

``attach``: ``attach_guard`` and ``TrlGuard``, the wrapped methods and the callback (attach and lifecycle).
``batch``: pure transforms of TRL's batch (evidence in it, the quarantine action) and the advantage replica check.
``sampling``: what the engine's processed logprobs mean under the trainer's sampling settings.
``records``: evidence records of suspect samples. ``engine_context``: the vLLM engine's context of each rollout.
``checkpoint``: the guard's state next to TRL checkpoints.
``fault_injection``: stale-context corruption of vLLM rollouts. ``capture``: host copies of each step, for tests.
The supported TRL range and the installed TRL/vLLM/transformers versions: ``rollout_guard.integrations.trl_versions``.
"""

from rollout_guard.extras import require_extra

require_extra("rollout_guard.integrations.trl", ("trl", "transformers", "accelerate"), "trl")

from rollout_guard.integrations.trl.attach import (TRL_METRIC_KEYS, TRL_METRIC_PREFIX, TrlGuard, attach_guard,
    default_sinks)
from rollout_guard.integrations.trl.batch import (
    NEUTRAL_FILL, GroupSettings, check_action_inputs, evidence_of, loss_mask_of, quarantine_batch, replica_differs,
    require,
)
from rollout_guard.integrations.trl.capture import GuardedStep, host_tensors
from rollout_guard.checkpoint import STATE_FILE, load_state, save_state
from rollout_guard.integrations.trl.engine_context import (EngineContextCollector, StepEngineContext,
    enable_vllm_engine_stats)
from rollout_guard.integrations.trl.fault_injection import StaleContextInjector, inject_stale_context
from rollout_guard.integrations.trl.records import build_records, decode_records

__all__ = [
    "EngineContextCollector", "STATE_FILE", "StepEngineContext", "TRL_METRIC_KEYS", "TRL_METRIC_PREFIX",
    "GroupSettings", "GuardedStep", "StaleContextInjector", "TrlGuard", "attach_guard", "NEUTRAL_FILL", "build_records",
    "check_action_inputs", "decode_records", "default_sinks", "evidence_of", "host_tensors", "inject_stale_context",
    "enable_vllm_engine_stats", "load_state", "loss_mask_of", "quarantine_batch", "replica_differs", "require",
    "save_state",
]
