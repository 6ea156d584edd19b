"""fidelity.py with rollout_guard.calibration.SETTLE_AT_ONCE_STEPS patched: the steps since a start or restart during
which a step's calibration update is applied at once (0: held a step from the first step on).

    python settle_variants.py N [fidelity.py options...]      e.g. python settle_variants.py 3 --same-support --out DIR
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from rollout_guard import calibration  # noqa: E402

calibration.SETTLE_AT_ONCE_STEPS = int(sys.argv.pop(1))
sys.argv[0] = "fidelity.py"
import fidelity  # noqa: E402

if __name__ == "__main__":
    fidelity.app()
