"""The guard of one verl run: its settings from the Hydra config, the step's verdict on a verl batch, the records of
suspect rows, the outputs, and the state saved with verl's checkpoints. No verl import: the trainer
(:mod:`rollout_guard.integrations.verl.trainer`) hands it verl's objects.

verl's trainer runs ``_compute_advantage`` in one process (the driver) on the whole batch, so the guard there
gathers nothing: its one collective is the identity.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from rollout_guard import checkpoint
from rollout_guard.config import GuardConfig
from rollout_guard.errors import CircuitBreakerTripped, GuardConfigError, GuardError
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.guard import RolloutGuard, StepReport
from rollout_guard.integrations.trl_versions import version
from rollout_guard.integrations.verl.batch import evidence_of, rejected_whole, trajectory_of, widen_to_trajectories
from rollout_guard.outputs.console import ConsoleSink
from rollout_guard.outputs.records import QuarantineRecord, decode_records, verdict_fields
from rollout_guard.outputs.sinks import LocalFilesSink, Sink, finite_metrics
from rollout_guard.selection import worst_suspects
from rollout_guard.statistics import COLUMN

logger = logging.getLogger("rollout_guard")

CONFIG_KEY = "rollout_guard"  # the Hydra node of the guard's settings: +rollout_guard.mode=monitor, …
PREFIX = "rollout_guard/"  # the guard's per-step metrics in verl's metrics dict (logged by verl's tracking)
INTERNAL_PREFIX = "rollout_guard_internal/"  # how the detector works (noise level, threshold inputs, timers)


def _node(config: Any, path: str, default: Any = None) -> Any:
    """``config``'s value at a dotted ``path`` (an OmegaConf node or nested mappings), or ``default``."""
    node = config
    for part in path.split("."):
        if node is None:
            return default
        getter = getattr(node, "get", None)
        node = getter(part, None) if getter is not None else getattr(node, part, None)
    return default if node is None else node


def guard_config(verl_config: Any) -> GuardConfig:
    """The :class:`GuardConfig` from the ``rollout_guard`` node of a verl config (every field optional; unset:
    the default), its ``output_dir`` defaulting to ``{trainer.default_local_dir}/rollout_guard``. An unknown key
    or a bad value raises a one-line :class:`GuardConfigError` naming it, before any worker starts."""
    node = _node(verl_config, CONFIG_KEY, {})
    try:
        from omegaconf import OmegaConf

        settings = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)
    except ImportError:
        settings = dict(node)
    known = {field.name for field in fields(GuardConfig)}
    for key in settings:
        if key not in known:
            raise GuardConfigError(key, settings[key], f"'{CONFIG_KEY}.{key}' is not a setting of the guard; use "
                                   f"one of {sorted(known)}")
    if settings.get("output_dir") is None:
        checkpoints = str(_node(verl_config, "trainer.default_local_dir", "."))
        settings["output_dir"] = os.path.join(checkpoints, "rollout_guard")
    return GuardConfig(**settings)


def sampling_of(verl_config: Any) -> dict[str, Any]:
    """What verl's engine samples with (``actor_rollout_ref.rollout``): temperature, top_p, top_k, the response
    length and the logprobs mode."""
    rollout = _node(verl_config, "actor_rollout_ref.rollout", {})
    return {
        "temperature": _node(rollout, "temperature", 1.0), "top_p": _node(rollout, "top_p", 1.0),
        "top_k": _node(rollout, "top_k", -1), "max_tokens": _node(verl_config, "data.max_response_length"),
        "logprobs_mode": _node(rollout, "logprobs_mode", "processed_logprobs"), "n": _node(rollout, "n", 1),
    }


def support_note(sampling: Mapping[str, Any]) -> str | None:
    """The one-time message when the engine's processed logprobs are renormalised over a truncated support (top-p
    or top-k), else None: clean rows then differ from the trainer's by −log(kept mass) on every token."""
    top_p, top_k = sampling.get("top_p") or 1.0, sampling.get("top_k") or -1
    if (top_p >= 1.0 and top_k <= 0) or sampling.get("logprobs_mode") != "processed_logprobs":
        return None
    return (f"rollout_guard: verl's engine reports processed logprobs under top_p={top_p:g}, top_k={top_k}, while the "
            "actor applies only the temperature: clean rows differ by −log(kept mass) on every token. The detector "
            "learns that offset as each confidence region's centre; sampling without truncation judges sharper.")


class VerlGuard:
    """The guard attached to one verl trainer (driver process). ``sinks``: where the guard reports besides verl's
    metrics dict (default: local files under ``output_dir`` and the console)."""

    def __init__(self, verl_config: Any, sinks: Sequence[Sink] | None = None) -> None:
        self.config = guard_config(verl_config)
        self.sampling = sampling_of(verl_config)
        # what the guard's noise was learned under, as it compares settings from step to step (name=value strings)
        self._sampling_key = tuple(f"{name}={value!r}" for name, value in sorted(self.sampling.items()))
        self.group_size = int(self.sampling["n"] or 1)
        correction = _node(verl_config, "algorithm.rollout_correction")
        self.bypass = bool(_node(correction, "bypass_mode", False)) if correction is not None else False
        if bool(_node(verl_config, "algorithm.use_pf_ppo", False)) and self.config.quarantines:
            raise GuardConfigError("mode", self.config.mode, "algorithm.use_pf_ppo resamples the batch's rows after "
                                   "the advantages, which a quarantine cannot follow; use +rollout_guard.mode=monitor")
        self.output_dir = Path(self.config.output_dir)
        self.guard = RolloutGuard(self.config)
        self.sinks = list(sinks) if sinks is not None else [LocalFilesSink(self.output_dir, self.config),
                                                             ConsoleSink(self.output_dir)]
        self.model = str(_node(verl_config, "actor_rollout_ref.model.path", ""))
        self.engine = {"name": str(_node(verl_config, "actor_rollout_ref.rollout.name", "")), "verl": version("verl")}
        self.last_report: StepReport | None = None
        self._said: set[str] = set()
        self._closed = False
        if self.bypass:
            self.guard.checks = self.checks()  # in the summary
            self._say_once("checks", self.checks())
        else:
            logger.info(self.checks())
        note = support_note(self.sampling)
        if note:
            self._say_once("support", note)

    def checks(self) -> str:
        """Which checks run in this setup, in one sentence."""
        if self.bypass:
            return ("rollout_guard: verl's rollout_correction.bypass_mode reuses the engine's logprobs as "
                    "old_log_probs, so the guard checks the engine's logprobs for NaN/±inf only (one-sided); turn "
                    "bypass_mode off for the two-sided check of engine against trainer")
        return ("rollout_guard: two-sided checks of verl's rollout_log_probs (engine) against old_log_probs "
                f"(trainer), mode={self.config.mode}; rows left out are removed from their group's baseline")

    # -- the step ----------------------------------------------------------------------------------------------

    def judge(self, data: Any, mask_before: torch.Tensor, batch_keys: Sequence[str], step: int,
              ) -> tuple[torch.Tensor, StepReport, RolloutEvidence | None]:
        """Judge one batch (``data``: the padded ``DataProto`` after verl's rollout correction; ``mask_before``: its
        ``response_mask`` before it). Returns the rows to leave out of the advantages ((B,) bool: quarantined rows,
        widened to their agent-loop trajectories, and in quarantine mode rows verl's own ``rollout_rs`` rejected
        whole; in monitor mode none, so that verl trains as it would alone), the step's report and the evidence."""
        rows = len(data)
        evidence: RolloutEvidence | BaseException
        try:
            tensors = dict(data.batch.items())
            tensors["response_mask"] = mask_before
            evidence = evidence_of(tensors, self.bypass)
        except Exception as error:  # noqa: BLE001 - judged as a failed step by the guard
            evidence = error
        report = self.guard.inspect(evidence, step=step, batch_size=rows,
                                    sampling=self._sampling_key)
        self.last_report = report
        rejected = rejected_whole(mask_before, data.batch["response_mask"]).cpu()
        quarantined = report.quarantined.clone() if not report.skipped else torch.zeros(rows, dtype=torch.bool)
        if quarantined.any():
            quarantined = widen_to_trajectories(quarantined, trajectory_of(batch_keys))
        report.metrics["quarantined_with_trajectories"] = float(quarantined.sum())
        report.metrics["rejected_by_verl"] = float(rejected.sum())
        excluded = quarantined | rejected if self.config.quarantines else quarantined
        return excluded, report, evidence if isinstance(evidence, RolloutEvidence) else None

    def metrics(self, report: StepReport) -> dict[str, float]:
        """The step's metrics for verl's metrics dict: finite values, ``rollout_guard/*`` and, for how the detector
        works, ``rollout_guard_internal/*``."""
        return finite_metrics(report.metrics, PREFIX, INTERNAL_PREFIX)

    def publish(self, report: StepReport, records: list[QuarantineRecord]) -> None:
        """Hand the step's records and report to the sinks, then act on the circuit breaker: in quarantine mode
        with ``on_ceiling`` "stop" or "raise" it raises :class:`CircuitBreakerTripped` here, before verl updates
        the actor with the step's batch, after the outputs are written."""
        if records:
            self._to_sinks("on_records", records, self.guard)
        self._to_sinks("on_step", report, self.guard)
        if report.stop_training:
            self.close()
            raise CircuitBreakerTripped(f"{report.stop_training} verl stopped before updating the actor with step "
                                        f"{report.step}'s batch; the guard's records and summary are written.")

    def records(self, report: StepReport, evidence: RolloutEvidence, tokens: Mapping[int, tuple[list[int], list[int]]],
                rewards: torch.Tensor | None, advantages_before: torch.Tensor | None,
                advantages_after: torch.Tensor | None, tokenizer: Any = None) -> list[QuarantineRecord]:
        """A record for each suspect row: full evidence (token ids, texts, per-token logprobs) for the rows in
        ``tokens`` (row → (prompt ids, response ids), the step's worst :meth:`full_rows`), statistics, rules,
        reward and advantages for the others. ``rewards`` (B,), ``advantages_*`` (B,): per row, or None."""
        rows = torch.nonzero(report.suspect).flatten().tolist()
        mask = evidence.mask.bool().cpu()
        engine = evidence.engine_logprobs.cpu() if evidence.has_engine else None
        trainer = evidence.trainer_logprobs.cpu() if evidence.has_trainer else None
        action = "quarantined" if self.config.quarantines else "monitored"
        created = time.time()
        records = []
        for row in rows:
            sample = report.samples[row].tolist()
            onset = sample[COLUMN["onset_token"]]
            counted = float(mask[row, : int(onset)].sum()) if onset >= 0 else math.nan  # NaN: no onset
            full = row in tokens
            prompt_ids, response_ids = tokens.get(row, ([], []))
            kept = mask[row]
            records.append(QuarantineRecord(
                step=report.step, process_index=0, row=row, global_row=row, group_size=self.group_size,
                action=action, **verdict_fields(sample, int(report.reasons[row]), report.threshold, counted),
                prompt_ids=list(prompt_ids), completion_ids=list(response_ids), prompt_text="", completion_text="",
                completion_tokens=[],
                engine_logprobs=engine[row][kept].tolist() if full and engine is not None else None,
                trainer_logprobs=trainer[row][kept].tolist() if full and trainer is not None else None,
                reward=_value(rewards, row), rewards_per_func={},
                advantage_before=_value(advantages_before, row), advantage_after=_value(advantages_after, row),
                sampling=dict(self.sampling), model=self.model, engine=dict(self.engine), injected=None,
                created_unix=created, full_evidence=full,
            ))
        if tokenizer is not None:
            try:
                decode_records(records, tokenizer)
            except Exception as error:  # noqa: BLE001 - the records stay, without texts
                self.output_failure("decoding evidence tokens", error)
        return records

    def full_rows(self, report: StepReport) -> list[int]:
        """The step's worst suspect rows that get full evidence (at most ``evidence_samples_per_step``)."""
        return worst_suspects(report.samples, report.reasons, self.config.evidence_samples_per_step).tolist()

    # -- checkpoints and the end -------------------------------------------------------------------------------

    def save(self, checkpoint_dir: str | Path, global_step: int) -> Path:
        """Write the guard's state into verl's checkpoint folder (``global_step_N``)."""
        return checkpoint.save_state(self.guard, checkpoint_dir, global_step)

    def resume(self, checkpoint_dir: str | Path) -> bool:
        """Restore the guard's state from verl's checkpoint folder; the sinks drop what they wrote after it."""
        state = checkpoint.load_state(self.guard, checkpoint_dir)
        if state is None:
            return False
        step = checkpoint.saved_step(state)
        self._to_sinks("on_resume", step, self.guard)
        return True

    def close(self) -> None:
        """The end of the run: the sinks' summaries and report (once)."""
        if self._closed:
            return
        self._closed = True
        self._to_sinks("on_end", self.guard)

    def _to_sinks(self, event: str, *payload: Any) -> None:
        for sink in self.sinks:
            try:
                getattr(sink, event)(*payload)
            except Exception as error:  # noqa: BLE001 - an output failure, not a verdict failure
                self.output_failure(f"{type(sink).__name__}.{event}", error)

    def output_failure(self, what: str, error: BaseException) -> None:
        """An output failure: raised with ``strict=True``, else counted in ``output_failures`` and logged."""
        if self.config.strict:
            raise GuardError(f"rollout_guard (strict=True): {what} failed ({type(error).__name__}: {error})") from error
        self.guard.totals.output_failures += 1
        logger.warning("rollout_guard: %s failed (%s: %s); the step was judged", what, type(error).__name__, error)

    def _say_once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.warning(message)


def _value(values: torch.Tensor | None, row: int) -> float | None:
    if values is None:
        return None
    value = float(values[row])
    return value if math.isfinite(value) else None


__all__ = ["CONFIG_KEY", "INTERNAL_PREFIX", "PREFIX", "VerlGuard", "guard_config", "sampling_of",
           "support_note"]
