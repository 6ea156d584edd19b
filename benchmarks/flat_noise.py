"""Healthy runs whose every token carries the same noise: what the guard flags where `fidelity.py` does not look.

`fidelity.py`'s noise is the data's own plus models fitted to published 7B figures, whose spread grows with a
token's surprise: the large mismatch of a row sits on its few unlikely tokens. A flat, high-entropy policy puts every
token of a row in one engine bucket with the same spread, and there a drift CUSUM grows on every token. The
twenty-sixth session's variant (the drift threshold at 4 nats until the run's own is read) cost nothing on
`fidelity.py` and flagged up to 7 % of such a run's rows; only a unit test caught it. This benchmark asks the
question directly, for any configuration (``--set FIELD=VALUE``, as ``fidelity.py``).

Each run: ``--steps`` steps of ``--rows`` rows of ``--length`` tokens, told the sampling settings (as the TRL
adapter does), every token's engine logprob ``--engine`` nats (default −1: the bucket [−1.5, −0.5)) and the
trainer's that less Gaussian noise of spread σ (clamped below 0); no fault. Printed per σ × length: the healthy
rows flagged while the drift threshold is not yet the run's own (a run's first steps: ``MIN_DRIFT_ROWS`` kept
samples) and after, of how many, and the rules that fired. Seeds 100, 101, … per run. ~1 min on the 2-core CPU at
the defaults.

    python benchmarks/flat_noise.py [--set uncalibrated_drift_threshold=4.0] [--out runs/flat_noise.json]
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import torch
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fidelity import preset, with_overrides  # noqa: E402
from rollout_guard import RolloutEvidence, RolloutGuard  # noqa: E402
from rollout_guard.calibration import MIN_DRIFT_ROWS  # noqa: E402
from rollout_guard.verdict import RULES  # noqa: E402

SETTINGS = ("temperature=1.0", "top_p=1.0")  # what the TRL adapter hands over each step

app = typer.Typer(add_completion=False)


def flat_rows(generator: torch.Generator, rows: int, length: int, sigma: float, engine: float) -> RolloutEvidence:
    """``rows`` healthy rows of ``length`` tokens: engine logprob ``engine`` on every token, the trainer's that less
    N(0, σ²) noise (clamped at −0.01 nats)."""
    engine_logprobs = torch.full((rows, length), engine)
    trainer = engine_logprobs - sigma * torch.randn(rows, length, generator=generator)
    return RolloutEvidence(mask=torch.ones(rows, length, dtype=torch.long), engine_logprobs=engine_logprobs,
                           trainer_logprobs=trainer.clamp(max=-0.01))


@app.command()
def main(sigmas: str = typer.Option("0.4,0.5,0.6,0.7,0.8,1.0,1.3", help="noise spreads σ (nats), comma-separated"),
         lengths: str = typer.Option("64,256", help="tokens per row, comma-separated"),
         rows: int = typer.Option(256, help="rows per step"), steps: int = typer.Option(30, help="steps per run"),
         runs: int = typer.Option(3, help="runs per σ × length"),
         engine: float = typer.Option(-1.0, help="every token's engine logprob (nats)"),
         preset_name: str = typer.Option("defaults", "--preset", help="as fidelity.py"),
         overrides: list[str] = typer.Option([], "--set", help="FIELD=VALUE, as fidelity.py"),
         out: Path | None = typer.Option(None, help="also write the figures here (JSON)")) -> None:
    config = with_overrides(preset(preset_name), overrides)
    results = []
    print(f"preset {preset_name} {' '.join(overrides)}: healthy rows flagged, before / after the run's own drift "
          f"threshold is read ({runs} runs of {steps} steps of {rows} rows, engine logprob {engine})")
    for sigma in (float(s) for s in sigmas.split(",")):
        for length in (int(n) for n in lengths.split(",")):
            flagged, judged, fired = Counter(), Counter(), Counter()
            for run in range(runs):
                guard, generator = RolloutGuard(config), torch.Generator().manual_seed(100 + run)
                for step in range(1, steps + 1):
                    # the drift threshold is the run's own once MIN_DRIFT_ROWS kept samples were judged alike
                    phase = "after" if guard.state_dict()["calibration"]["drift_rows"] >= MIN_DRIFT_ROWS else "before"
                    report = guard.inspect(flat_rows(generator, rows, length, sigma, engine), step=step,
                                           sampling=SETTINGS)
                    judged[phase] += rows
                    flagged[phase] += int(report.suspect.sum())
                    for bit, rule in enumerate(RULES):
                        fired[rule] += int(((report.reasons.int() >> bit) & 1).sum())
            rules = {rule: count for rule, count in fired.items() if count}
            results.append({"sigma": sigma, "length": length, "flagged": dict(flagged), "judged": dict(judged),
                            "rules": rules})
            print(f"σ {sigma:4.2f}  {length:4d} tokens:  before {flagged['before']:5d} of {judged['before']:6d} "
                  f"({100 * flagged['before'] / max(judged['before'], 1):6.3f} %)  after {flagged['after']:5d} of "
                  f"{judged['after']:6d} ({100 * flagged['after'] / max(judged['after'], 1):6.3f} %)  {rules}",
                  flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"preset": preset_name, "overrides": overrides, "config": config.to_dict(),
                                   "rows": rows, "steps": steps, "runs": runs, "engine": engine,
                                   "results": results}, indent=1))


if __name__ == "__main__":
    app()
