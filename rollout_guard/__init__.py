"""rollout_guard: keep corrupted rollouts out of RL training of language models.

The data path: evidence → statistics → verdict → action → sinks. This package is engine-agnostic (no import of
trl or vllm; it needs torch only); framework adapters live in ``rollout_guard.integrations`` (pip extras).
"""

from rollout_guard.config import GuardConfig
from rollout_guard.outputs.console import ConsoleSink
from rollout_guard.errors import CircuitBreakerTripped, GuardConfigError, GuardError, GuardInputError
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.extras import MissingExtraError
from rollout_guard.guard import RolloutGuard, StepReport
from rollout_guard.outputs.records import QuarantineRecord
from rollout_guard.outputs.sinks import LocalFilesSink, Sink
from rollout_guard.outputs.store import QuarantineStore, read_records

__all__ = [
    "CircuitBreakerTripped", "ConsoleSink", "GuardConfig", "GuardConfigError", "GuardError", "GuardInputError",
    "LocalFilesSink",
    "MissingExtraError", "QuarantineRecord", "QuarantineStore", "RolloutEvidence", "RolloutGuard", "Sink", "StepReport",
    "read_records",
]
__version__ = "0.1.0"
