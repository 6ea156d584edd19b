"""The variant's cost on healthy runs noisier than the benchmark's (twenty-sixth session): Gaussian healthy
mismatch of spread σ on every token, all tokens in one engine bucket (`tests/test_detector.py`'s
`gaussian_candidates`: a flat, high-entropy policy whose every token carries the same noise), rows of 64 or 256
tokens, 256 rows per step, three runs of six steps each (the steps before the drift threshold is read): rows flagged
with the uncalibrated drift threshold at 6 nats (the default) and at 4 (the variant). Needs the variant's field:

    git apply benchmarks/results-2026-12-03-twentysixth/variants/uncalibrated-drift-4.diff
    python benchmarks/results-2026-12-03-twentysixth/variants/uncalibrated-drift-4-noisy-runs.py
"""

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO / "tests"), str(REPO)]

from test_detector import ONLY_DETECTOR, SETTINGS, gaussian_candidates  # noqa: E402

from rollout_guard import GuardConfig, RolloutGuard  # noqa: E402

for sigma in (0.4, 0.5, 0.6, 0.7, 0.8, 1.0, 1.3):
    for length in (64, 256):
        flagged = []
        for uncalibrated in (6.0, 4.0):
            config = GuardConfig(**ONLY_DETECTOR, calibration_warmup_tokens=160_000, spike_excess=None,
                                 uncalibrated_drift_threshold=uncalibrated)
            total = 0
            for seed in range(3):
                guard, generator = RolloutGuard(config), torch.Generator().manual_seed(100 + seed)
                for step in range(1, 7):
                    evidence = gaussian_candidates(generator, 256, length, sigma=sigma)
                    total += int(guard.inspect(evidence, step=step, sampling=SETTINGS).suspect.sum())
            flagged.append(total)
        print(f"sigma {sigma} length {length}: flagged in steps 1-6 of 3 runs (4,608 rows) at 6: {flagged[0]}, "
              f"at 4: {flagged[1]}", flush=True)
