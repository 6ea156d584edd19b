"""Draw ``wandb_panels.png``: the guard's W&B panels, from the logged history of an offline W&B run.

Reads the run's ``.wandb`` file with ``wandb leet inspect --json`` (its history records, as the tests read them)
and draws, with matplotlib, a grid of line plots laid out like W&B's workspace: the ``rollout_guard`` section
(mismatch, score against its threshold, quarantined rows, the |Δ| histogram per step) and the
``rollout_guard_internal`` section (the healthy noise per region, the guard's own time), each panel titled with the
keys it plots and drawn against ``train/global_step``, its y axis logarithmic where the values span decades. Nothing
is drawn that the run did not log.

    make demo ARGS="--report-to wandb"
    .venv/bin/python docs/images/make_wandb_panels.py runs/demo/wandb/latest-run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "wandb_panels.png"

# (title, keys, y scale) per panel; a key is drawn where the run logged it.
SECTIONS = {
    "rollout_guard": [
        ("max_abs_delta, kept_max_abs_delta",
         ["rollout_guard/max_abs_delta", "rollout_guard/kept_max_abs_delta"], "log"),
        ("p99_abs_delta", ["rollout_guard/p99_abs_delta"], "log"),
        ("max_score, score_threshold", ["rollout_guard/max_score", "rollout_guard_internal/score_threshold"], "symlog"),
        ("quarantined", ["rollout_guard/quarantined"], "linear"),
        ("quarantined_share", ["rollout_guard/quarantined_share"], "linear"),
        ("log10_abs_delta (histogram)", ["rollout_guard/log10_abs_delta"], "linear"),
        ("reward/suspect_mean, reward/not_suspect_mean",
         ["rollout_guard/reward/suspect_mean", "rollout_guard/reward/not_suspect_mean"], "linear"),
        ("injected, caught", ["rollout_guard/injected", "rollout_guard/caught"], "linear"),
        ("engine/generation_seconds", ["rollout_guard/engine/generation_seconds"], "linear"),
    ],
    "rollout_guard_internal": [
        ("noise/scale_r0 … r3", [f"rollout_guard_internal/noise/scale_r{r}" for r in range(4)], "linear"),
        ("guard_seconds", ["rollout_guard_internal/guard_seconds"], "linear"),
        ("compared_tokens", ["rollout_guard_internal/compared_tokens"], "linear"),
    ],
}


def history(run: Path) -> tuple[dict, list[dict]]:
    """The run record and the history items of the offline run at ``run`` (a ``.wandb`` file or a run folder)."""
    done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run)], capture_output=True,
                          text=True, check=True, timeout=600)
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    header = next(r["run"] for r in records if r["type"] == "run")
    return header, [r["history"]["item"] for r in records if r["type"] == "history"]


def draw(header: dict, items: list[dict], out: Path) -> None:
    """The panels of the history ``items`` as a PNG at ``out``, in 128 colours to keep it small."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from PIL import Image

    ours = [item for item in items if "rollout_guard/max_abs_delta" in item]
    step = "train/global_step"
    columns = 3
    rows = [len(panels) // columns + bool(len(panels) % columns) for panels in SECTIONS.values()]
    figure = plt.figure(figsize=(13, 2.4 * sum(rows) + 1.2), dpi=80)
    grid = figure.add_gridspec(sum(rows), columns, hspace=0.8, wspace=0.22, top=1 - 1.2 / figure.get_figheight(),
                               bottom=0.05, left=0.05, right=0.98)
    first = 0
    for (section, panels), height in zip(SECTIONS.items(), rows, strict=True):
        for index, (title, keys, scale) in enumerate(panels):
            axes = figure.add_subplot(grid[first + index // columns, index % columns])
            if index == 0:
                axes.text(0, 1.3, f"▾ {section}", transform=axes.transAxes, fontsize=12, fontweight="bold")
            if keys[0].endswith("log10_abs_delta"):
                logged = [item for item in ours if f"{keys[0]}.values" in item]
                edges = np.asarray(logged[0][f"{keys[0]}.bins"])
                counts = np.asarray([item[f"{keys[0]}.values"] for item in logged], dtype=float).T
                steps = [item[step] for item in logged]
                axes.pcolormesh(np.append(steps, steps[-1] + 1) - 0.5, edges, np.log1p(counts), cmap="Blues",
                                shading="flat")
                axes.set_ylabel("log10 |Δ|")
            for key, style in zip([] if keys[0].endswith("log10_abs_delta") else keys, ("-", "--", ":", "-."),
                                  strict=False):
                points = [(item[step], item[key]) for item in ours if key in item]
                if points:
                    x, y = zip(*points, strict=True)
                    axes.plot(x, y, style, marker="." if len(points) < len(ours) else None, linewidth=1.3,
                              label=key.split("/", 1)[1])
            axes.set_yscale(scale)
            if len(keys) > 1 and not keys[0].endswith("log10_abs_delta"):
                axes.legend(fontsize=7, loc="best", framealpha=0.85, edgecolor="none")
            axes.set_title(title + ("" if scale == "linear" else f" ({scale} y)"), fontsize=9, loc="left")
            axes.set_xlabel(step, fontsize=7)
            axes.tick_params(labelsize=7)
            axes.grid(alpha=0.3)
            for side in ("top", "right"):
                axes.spines[side].set_visible(False)
        first += height
    figure.suptitle(f"W&B project {header.get('project', '?')}, offline run {header.get('run_id', '?')}: the guard's "
                    f"panels, drawn from the run's logged history ({len(ours)} steps)", fontsize=11, x=0.05, ha="left")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    Image.open(buffer).convert("RGB").quantize(colors=128).save(out, optimize=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="the offline run: its .wandb file or its folder")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    header, items = history(args.run)
    draw(header, items, args.out)
    print(f"{args.out}: {args.out.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
