"""The variants of the eighteenth session that were not taken, as patches for `benchmarks/fidelity.py`.

Run from the repository root at commit 50299ce (before the session's changes) for `memory` and `keep_unlikely`:

    python benchmarks/results-2026-12-02-eighteenth/variants/patches.py memory --faults-per-condition 1000 \
        --same-support --out /tmp/memory

`memory`: the guard keeps a calibration per sampling setting and restores it when the stream returns to that
setting (`per-setting-memory-told.json`). `keep_unlikely`: the histogram of tokens no side found likely survives
a restart and is read as the setting's own once the bucket is calibrated again (`kept-read-at-once-told.json`).
The third, the kept reading without its `spike_excess` minimum (`kept-floor-*.json`), was an edit of
`Calibration._compute_thresholds` at 524b402: `max(fixed_spike, ...)` -> `max(self.spike_floor(), ...)`.
"""

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from rollout_guard.calibration import Calibration  # noqa: E402
from rollout_guard.guard import RolloutGuard  # noqa: E402


def per_setting_memory() -> None:
    inspect = RolloutGuard.inspect

    def remembering(self, evidence, step, batch_size=None, check_failed=False, sampling=None):
        if sampling is not None and not isinstance(evidence, BaseException):
            settings = tuple(sampling)
            if self.sampling is not None and settings != self.sampling:
                memory = self.__dict__.setdefault("_memory", {})
                memory[self.sampling] = copy.deepcopy(self.calibration.state_dict())
                if settings in memory:
                    self.calibration.load_state_dict(memory[settings])
                    self.sampling = settings
        return inspect(self, evidence, step, batch_size, check_failed, sampling)

    RolloutGuard.inspect = remembering


def keep_unlikely() -> None:
    restart = Calibration.restart

    def keeping(self) -> None:
        kept = copy.deepcopy(self._unlikely)
        restart(self)
        self._unlikely = kept

    Calibration.restart = keeping


PATCHES = {"memory": per_setting_memory, "keep_unlikely": keep_unlikely}

if __name__ == "__main__":
    PATCHES[sys.argv[1]]()
    sys.argv = ["fidelity.py", *sys.argv[2:]]
    from benchmarks import fidelity

    fidelity.app()
