"""What the engine's logprobs mean under this trainer's sampling settings.

vLLM (``logprobs_mode="processed_logprobs"``, what TRL asks for) and ``TransformersRollouts`` report each sampled
token's logprob under the distribution they *sampled from*: after temperature, top-p/top-k/min-p truncation,
penalties and guided decoding. TRL's trainer applies the temperature only. Truncation renormalises the engine's
distribution over the kept tokens, so on every token the engine's logprob is higher than the trainer's by
−log(kept probability mass); penalties and guided decoding move it either way. On clean samples that is |Δ| the
guard's thresholds see as disagreement.
"""

from __future__ import annotations

import math
from typing import Any

_SUPPORT_KEYS = ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "typical_p",
                 "bad_words", "logit_bias", "allowed_token_ids", "structured_outputs", "guided_decoding")


def _generation_kwargs(trainer: Any) -> tuple[Any, dict]:
    """The trainer's args and its ``generation_kwargs`` (an empty dict when unset or not a dict)."""
    args = getattr(trainer, "args", None)
    extra = getattr(args, "generation_kwargs", None) or {}
    return args, extra if isinstance(extra, dict) else {}


def _setting_reader(trainer: Any):
    """``setting(name, default)``: generation_kwargs first, then the trainer's attribute, then its args."""
    args, extra = _generation_kwargs(trainer)

    def setting(name: str, default: Any) -> Any:
        return extra.get(name, getattr(trainer, name, getattr(args, name, default)))

    return setting


def sampling_settings(trainer: Any) -> tuple[str, ...]:
    """What the engine samples with, as ``name=value`` strings (temperature and every support-changing setting):
    handed to the guard each step so that a change starts the detector's noise over (the processed logprobs' offset
    depends on it). Strings, so that the tuple survives the guard's JSON checkpoint unchanged."""
    setting = _setting_reader(trainer)
    names = ("temperature", *_SUPPORT_KEYS, "vllm_structured_outputs_regex")
    return tuple(f"{name}={setting(name, None)!r}" for name in names)


def support_changes(trainer: Any) -> list[str]:
    """Each sampling setting of this trainer that makes the engine's logprobs differ from the trainer's, with what
    it does to |Δ| on a clean sample; empty when the engine samples from exactly what the trainer scores."""
    args, extra = _generation_kwargs(trainer)
    setting = _setting_reader(trainer)
    changes = []
    top_p = setting("top_p", 1.0)
    if top_p is not None and top_p < 1.0:
        changes.append(f"top_p={top_p:g} (engine logprob higher by up to {-math.log(top_p):.3g} nat on every token)")
    top_k = setting("top_k", 0)
    if top_k is not None and top_k > 0:
        changes.append(f"top_k={top_k} (engine logprob higher by −log(mass of the top {top_k}); "
                       "unbounded on flat distributions)")
    min_p = setting("min_p", None)
    if min_p:
        changes.append(f"min_p={min_p:g} (engine logprob higher by −log(kept mass))")
    penalty = setting("repetition_penalty", 1.0)
    if penalty is not None and penalty != 1.0:
        changes.append(f"repetition_penalty={penalty:g} (repeated tokens shift by up to "
                       f"{abs(math.log(penalty)):.3g} nat, either way)")
    for name in ("presence_penalty", "frequency_penalty"):
        if extra.get(name):
            changes.append(f"{name}={extra[name]:g} (logits shifted, |Δ| either way)")
    for name in ("typical_p", "bad_words", "logit_bias", "allowed_token_ids", "structured_outputs", "guided_decoding"):
        if extra.get(name) not in (None, 1.0, [], {}):
            changes.append(f"{name} (tokens removed or shifted: engine logprob higher, unbounded)")
    regex = getattr(args, "vllm_structured_outputs_regex", None)
    if regex:
        changes.append("vllm_structured_outputs_regex (guided decoding: engine logprob higher by −log(allowed mass), "
                       "unbounded)")
    return changes


def processed_logprobs_warning(trainer: Any) -> str | None:
    """The one-time attach message when the sampling settings change the engine's support, else None."""
    changes = support_changes(trainer)
    if not changes:
        return None
    return ("rollout_guard: the engine reports logprobs after " + "; ".join(changes) + ", while the trainer applies "
            "only the temperature. Clean samples then differ by that much on every token, varying from token to token; "
            "the detector learns the offset as each confidence region's centre, but a penalty or logit bias can move "
            "single tokens far enough to be flagged: sample without them, or measure clean rollouts at these "
            "settings first (rollout-guard audit).")
