"""Detection fidelity benchmark: how often the guard misses corruption and drops good samples.

Replays real clean rollouts (``benchmarks/fidelity_data/*.parquet``: engine vs trainer logprobs with their real
numeric mismatch) under several noise conditions, mixed with the fault zoo, through ``RolloutGuard`` as a stream
of training steps, and prints per fault type × noise condition the recall, and per condition the false
quarantines per clean sample and per million clean tokens, with Wilson 95 % intervals and PASS/FAIL against the
goal: recall ≥ 99.9 % of corrupted rollouts at ≤ 0.1 % false quarantines of clean rollouts, in the same step,
with no extra forward pass (the guard only reads the logprobs TRL already has). PASS compares the point
estimate; CI-PASS also needs the whole interval on the right side of the goal.

    python benchmarks/fidelity.py --same-support          # GuardConfig's defaults, into runs/fidelity/
    python benchmarks/fidelity.py --same-support --set false_alarm_budget=1e-4 --out runs/fidelity-1e-4
"""

from __future__ import annotations

import ast
import functools
import glob
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path

import torch
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fidelity_kit import noise, zoo  # noqa: E402
from benchmarks.fidelity_kit.rollouts import (Rollouts, cat, from_table, padded_column, read_tables,  # noqa: E402
    stitched)
from benchmarks.fidelity_kit.score import GOAL_FALSE_RATE, GOAL_RECALL, figures, firings, replay  # noqa: E402
from rollout_guard.config import GuardConfig  # noqa: E402
from rollout_guard.errors import GuardConfigError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = str(REPO / "benchmarks" / "fidelity_data" / "h200-*.parquet")  # the 27 conditions
# (the cpu-vllm-* files are the vLLM CPU runs of the data README, with sources of their own: --data to add them)

app = typer.Typer(add_completion=False)


PRESETS = ("defaults",)


def preset(name: str) -> GuardConfig:
    """The guard configuration a preset names: ``"defaults"``, :class:`GuardConfig`'s defaults (variants with
    ``--set``). The circuit breaker is off: it is about stopping a run, not about which samples are judged corrupt,
    and a stream with many faults would trip it."""
    if name == "defaults":
        return GuardConfig(max_quarantine_share=None)
    raise typer.BadParameter(f"--preset {name!r}: use one of {', '.join(repr(p) for p in PRESETS)} (variants: --set "
                             "FIELD=VALUE)")


def with_overrides(config: GuardConfig, overrides: list[str]) -> GuardConfig:
    """``config`` with ``FIELD=VALUE`` overrides (``--set``; VALUE a Python literal: ``2.0``, ``None``, ``True``), checked
    by :class:`GuardConfig` itself, before any data is read.

    >>> with_overrides(preset("defaults"), ["false_alarm_budget=1e-4"]).false_alarm_budget
    0.0001
    """
    known = {field.name for field in fields(GuardConfig)}
    changes = {}
    for item in overrides:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or name not in known:
            raise typer.BadParameter(f"--set {item!r}: use FIELD=VALUE with FIELD a GuardConfig field, e.g. "
                                     "false_alarm_budget=1e-4")
        try:
            changes[name] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            raise typer.BadParameter(f"--set {item!r}: VALUE must be a Python literal (2.0, None, True)") from None
    try:
        return replace(config, **changes)
    except GuardConfigError as error:
        raise typer.BadParameter(f"--set: {error}") from None


def checked_noise_shape(shape: str) -> str:
    """``--noise-shape``'s value (a key of ``noise.SHAPES``), or a one-line refusal naming the option, before any data
    is read (``fidelity.py`` and ``separability.py`` alike)."""
    if shape not in noise.SHAPES:
        raise typer.BadParameter(f"--noise-shape {shape!r}: use one of {', '.join(noise.SHAPES)}")
    return shape


Noise = Callable[[Rollouts], Rollouts]


def conditions(table, seed: int, step_rows: int, same_support: bool = False, stitch: int = 1,
               noise_shape: str = "softmax") -> list[tuple[str, Rollouts, dict[str, Rollouts], Noise, dict]]:
    """(name, clean base rollouts, real faulty rollouts by fault, noise applied on top, noise parameters) per noise
    condition. The noise goes on top of faulty rows too (after the fault): an engine that reads stale state still
    returns processed logprobs, and a run's numeric noise does not stop at a corrupted sample. ``same_support``:
    the trainer's logprobs renormalised over the engine's support (``noise.on_engine_support``) where it was cut by
    top-k, as the TRL adapter's ``compare_on_engine_support`` does (top-p alone stays with the detector's
    per-region centre).
    ``stitch``: rows that many times as long (:func:`~benchmarks.fidelity_kit.rollouts.stitched`): clean rows and
    real faults corrupted from their first token (context swaps, stale weights) end to end with their own kind, a
    real late-onset row last after ``stitch − 1`` clean rows of its setting; ``step_rows`` then counts the long
    rows (pass the original's divided by ``stitch`` for the same tokens per step)."""
    import pyarrow.compute as pc

    generator = torch.Generator().manual_seed(seed)
    support_generator = torch.Generator().manual_seed(seed + 7919)  # its own draws: the other conditions' stay as they were
    stitch_generator = torch.Generator().manual_seed(seed + 104729)  # its own too (none drawn when stitch is 1)

    def load(part, name: str, top_k: int) -> Rollouts:
        rows = from_table(part, name)
        if not (same_support and top_k > 0):  # as the TRL adapter: top-p alone is left to the detector's centre
            return rows
        raw, _ = padded_column(part, "engine_raw_logprobs")
        return noise.on_engine_support(rows, raw[:, : rows.mask.shape[1]], support_generator)
    out = []
    for source in sorted(set(table.column("source").to_pylist())):
        of_source = table.filter(pc.equal(table.column("source"), source))
        keys = sorted(set(zip(of_source.column("temperature").to_pylist(), of_source.column("top_p").to_pylist(),
                              of_source.column("top_k").to_pylist(), strict=True)))
        pooled_clean, pooled_faults = [], {}
        cut = any(top_k > 0 for _, _, top_k in keys)  # the pooled stream samples some of its steps with top-k
        for temperature, top_p, top_k in keys:
            part = of_source.filter(pc.and_(pc.and_(pc.equal(of_source.column("temperature"), temperature),
                                                    pc.equal(of_source.column("top_p"), top_p)),
                                            pc.equal(of_source.column("top_k"), top_k)))
            name = f"{source}/T{temperature:g}/top_p{top_p:g}/top_k{top_k}"
            clean_table = part.filter(pc.equal(part.column("fault"), "none"))
            if clean_table.num_rows == 0:
                continue
            clean = load(clean_table, name, top_k)
            real_faults = {f"real_{fault}": load(part.filter(pc.equal(part.column("fault"), fault)), name, top_k)
                           for fault in sorted(set(part.column("fault").to_pylist()) - {"none"})}
            if stitch > 1:
                real_faults = {fault: stitched(rows, stitch, stitch_generator,
                                               prefix=clean if "late_onset" in fault else None)
                               for fault, rows in real_faults.items()}
                clean = stitched(clean, stitch, stitch_generator)
                if len(clean) == 0:  # fewer clean rows than one stitched row takes
                    continue
            for fault, rows in real_faults.items():  # in the pooled stream, sampled under this setting
                pooled_faults.setdefault(fault, []).append(
                    replace(rows, setting=torch.full((len(rows),), len(pooled_clean), dtype=torch.long)))
            out.append((name, clean, real_faults, lambda rows: rows,
                        {"noise": "real (as measured)", "top_k_cut": top_k > 0, **noise.describe(clean)}))
            pooled_clean.append(clean)
        if not pooled_clean:
            continue
        # which sampling setting each row of the pooled stream was drawn with: the stream is a run that changes
        # its settings between steps (``replay`` cuts its steps there and, with announce_sampling, tells the guard)
        clean = cat([replace(part, setting=torch.full((len(part),), index, dtype=torch.long))
                     for index, part in enumerate(pooled_clean)])
        real = {name: cat(parts) for name, parts in pooled_faults.items()}
        for profile in (noise.DENSE_7B, noise.HYBRID_7B):
            profile = noise.shaped(profile, noise_shape)
            fitted = noise.fit_heavy_tail(clean, generator, profile, step_rows)
            apply = functools.partial(noise.heavy_tail, generator=generator, fitted=fitted)
            achieved = noise.describe(apply(clean))
            out.append((f"{source}/+{profile.name}", clean, real, apply,
                        {"noise": profile.name, "source": profile.source, "top_k_cut": cut, **fitted, **achieved}))
        apply = functools.partial(noise.topk_high_entropy, generator=generator, same_support=same_support)
        out.append((f"{source}/+topk5_high_entropy", clean, real, apply,
                    {"noise": "topk5_high_entropy", "top_k_cut": True, **noise.describe(apply(clean))}))
    return out


def synthetic_faults(clean: Rollouts, count: int, generator: torch.Generator,
                     sources: dict[str, torch.Tensor] | None = None) -> dict[str, Rollouts]:
    """``count`` faulty rows per synthetic fault kind, each made from a clean row drawn at random; ``sources``, if
    given, receives each kind's (count,) indices of those clean rows."""
    pools = {}
    for name, function in zoo.SYNTHETIC_FAULTS.items():
        index = torch.randint(0, len(clean), (count,), generator=generator)
        pools[name] = function(clean.rows(index), generator)
        if sources is not None:
            sources[name] = index
    return pools


SWEPT_BUDGETS = tuple(10.0 ** (k / 4) for k in range(-32, -3))
"""The false-alarm budgets α the sweep judges at, 10⁻⁸ to 10⁻¹ a quarter-decade apart (thresholds ln(1/α))."""


def sweep(judged_all: list, config: GuardConfig,
          budgets: tuple[float, ...] = SWEPT_BUDGETS) -> dict[str, list[float]]:
    """Recall per fault and clean false rate, pooled over conditions, with the score's threshold at ``ln(1/α)`` for
    each false-alarm budget α of ``budgets``, re-judging the stored per-sample statistics (:func:`firings`); the
    non-finite and ``ceiling`` rules stay as configured. The guard's own state is the one each row was judged with:
    a budget judged here does not change which rows the detector learned from."""
    samples = torch.cat([j.rows()[0] for j in judged_all])
    labels = [label for j in judged_all for label in j.rows()[2]]
    counted = torch.cat([j.rows()[3] for j in judged_all])
    fixed = firings(samples, math.inf, config.ceiling_delta, config.tolerance_delta)
    always = fixed["nonfinite_engine"] | fixed["nonfinite_trainer"] | fixed["ceiling"]
    curves: dict[str, list[float]] = {}
    names = sorted(set(labels))
    label_rows = {name: torch.tensor([label == name for label in labels], dtype=torch.bool) & counted
                  for name in names}
    for budget in budgets:
        suspect = always | firings(samples, math.log(1.0 / budget), None)["score"]
        for name in names:
            rows = label_rows[name]
            curves.setdefault(name, []).append(float((suspect & rows).sum()) / max(int(rows.sum()), 1))
    return curves


def plot_sweep(curves: dict[str, list[float]], budgets: tuple[float, ...], budget: float, path: Path,
               title: str) -> None:
    """The sweep's recall per fault against its clean false rate, the configured budget's point marked."""
    try:
        import matplotlib
    except ImportError:  # the curves are in sweep-<preset>.json; draw them where matplotlib is installed
        print(f"matplotlib is not installed: {path.name} not drawn")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5.5))
    false_rate = torch.tensor(curves["clean"]).clamp(min=1e-6)
    for name, recall in curves.items():
        if name == "clean":
            continue
        axis.plot(false_rate, recall, marker=".", label=name)
    default = min(range(len(budgets)), key=lambda i: abs(math.log(budgets[i] / budget)))
    axis.axvline(GOAL_FALSE_RATE, color="grey", linestyle="--", linewidth=1)
    axis.axhline(GOAL_RECALL, color="grey", linestyle="--", linewidth=1)
    axis.scatter([float(false_rate[default])] * 1, [0.0], marker="^", color="black", label=f"false_alarm_budget {budget:g} (x)")
    axis.set_xscale("log")
    axis.set_xlabel("false quarantines per clean rollout (pooled; 1e-6 = none)")
    axis.set_ylabel("recall of corrupted rollouts")
    axis.set_title(title, fontsize=10)
    axis.legend(fontsize=7, loc="lower right")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _cell(value: dict, key: str) -> str:
    ci = value["ci"]
    mark = "PASS" if value["pass"] else "FAIL"
    if value["ci_pass"]:
        mark = "CI-PASS"
    if key == "recall":
        return f"{100 * value['recall']:.2f} % [{100 * ci[0]:.2f}, {100 * ci[1]:.2f}] {mark}"
    return f"{100 * value['false_rate']:.3f} % [{100 * ci[0]:.3f}, {100 * ci[1]:.3f}] {mark}"


def markdown(results: list[dict]) -> str:
    faults = sorted({name for result in results for name in result["figures"] if name != "clean"})
    lines = ["| condition | clean rows | false quarantines (95 % CI) | per M clean tokens | "
             + " | ".join(faults) + " |", "|" + " --- |" * (4 + len(faults))]
    for result in results:
        f = result["figures"]
        clean = f["clean"]
        cells = [f"{100 * f[name]['recall']:.1f}{'' if f[name]['pass'] else ' ✗'}" if name in f else "–" for name in faults]
        lines.append(f"| {result['condition']} | {clean['rows']} | {_cell(clean, 'false')} | "
                     f"{clean['false_per_m_tokens']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@app.command()
def main(
    data: str = typer.Option(DEFAULT_DATA, help="glob of parquet files of clean (and model-generated faulty) rollouts"),
    preset_name: str = typer.Option("defaults", "--preset", help="guard configuration to measure: 'defaults' "
                                     "(GuardConfig's defaults, the circuit breaker off; variants with --set)"),
    faults_per_condition: int = typer.Option(1000, help="rollouts per synthetic fault kind per condition (every "
                                             "published figure used 1000)"),
    step_rows: int = typer.Option(256, help="rollouts per training step (with --stitch N, of the data's rows: a "
                                  "step then holds step_rows // N long rows, at least 8: the same tokens per step)"),
    stitch: int = typer.Option(1, min=1, help="rows N times as long, each N of the data's rows of one setting end to "
                               "end (fidelity_kit.rollouts.stitched): the noise per token as measured, N times the "
                               "tokens per verdict (the data's rows hold at most 256 tokens)"),
    fault_share: float = typer.Option(0.02, help="share of faulty rollouts in each step of the clean stream "
                                     "(below half a row a step: one faulty row every few steps, e.g. 0.001 of "
                                     "256 rows, AI21's rate: one every 4th step)"),
    warmup_steps: int = typer.Option(20, help="steps of a setting (phase 1's, then resampled clean rows with "
                                     "fault_share of faults) before phase 2 judges that setting's other faults"),
    dense_phase2: bool = typer.Option(False, help="phase 2 moves the guard on with its whole steps (a quarter "
                                      "faults: the detector learns from the missed ones at that density)"),
    mask_truncated: bool = typer.Option(False, help="as TRL's mask_truncated_completions=True: truncated rows' loss mask is zero"),
    same_support: bool = typer.Option(False, help="judge the trainer's logprobs renormalised over the engine's kept "
                                      "support, as the TRL adapter does with compare_on_engine_support (the engine's "
                                      "recorded log-mass stands in for the trainer's, plus an error: noise.on_engine_support)"),
    announce_sampling: bool = typer.Option(True, help="tell the guard each step's sampling setting, as the TRL adapter "
                                           "does (a change starts its healthy noise over); off: the pooled streams "
                                           "change setting unannounced, like a policy whose entropy jumps"),
    noise_shape: str = typer.Option("softmax", help="the tail models' broad part, fitted to the same published "
                                    "figures: 'softmax' (1 − p: quiet where the engine is sure, flat where not; the "
                                    "shape benchmarks/noise_shape.py measured on real engines), 'surprise' (its "
                                    "spread grows with a token's surprise) or 'flat' (the same on every token)"),
    seed: int = typer.Option(0),
    device: str = typer.Option("cpu", help="where the guard runs (cpu, cuda)"),
    out: Path = typer.Option(REPO / "runs" / "fidelity",
                             help="folder for results-<preset>.{json,md} and sweep-<preset>.{json,png} (default: "
                                  "runs/fidelity, ignored by git; the published runs are under benchmarks/)"),
    overrides: list[str] = typer.Option([], "--set", help="FIELD=VALUE: measure the preset with this GuardConfig field "
                                        "changed (repeat for more), e.g. --set false_alarm_budget=1e-4"),
) -> None:
    paths = sorted(glob.glob(data))
    if not paths:
        raise typer.BadParameter(f"--data {data!r} matches no file: generate the data (benchmarks/fidelity_data/README.md)")
    config = with_overrides(preset(preset_name), overrides)
    checked_noise_shape(noise_shape)
    started = time.perf_counter()
    table = read_tables(paths)
    generator = torch.Generator().manual_seed(seed)
    results, judged_all = [], []
    if stitch > 1:
        step_rows = max(step_rows // stitch, 8)
    for name, clean, real_faults, apply, params in conditions(table, seed, step_rows, same_support, stitch,
                                                              noise_shape):
        faulty = {key: apply(rows) for key, rows in
                  {**synthetic_faults(clean, faults_per_condition, generator), **real_faults}.items()}
        judged = replay(apply(clean), faulty, config, generator, step_rows=step_rows, fault_share=fault_share,
                        mask_truncated=mask_truncated, device=device, announce_sampling=announce_sampling,
                        warmup_steps=warmup_steps, dense_phase2=dense_phase2)
        judged_all.append(judged)
        f = figures(judged, config)
        results.append({"condition": name, "params": params, "figures": f})
        clean_f = f["clean"]
        worst = min((v["recall"], k) for k, v in f.items() if k != "clean") if len(f) > 1 else (math.nan, "-")
        again = clean_f["resampled"]
        print(f"{name}: clean {clean_f['rows']} rows, false {_cell(clean_f, 'false')} {clean_f['rules']} "
              f"(resampled: {again['false']} of {again['judged']} judgements, {100 * again['false_rate']:.3f} % "
              f"[{100 * again['ci'][0]:.3f}, {100 * again['ci'][1]:.3f}] counting each row's judgements together; "
              f"{again['rows_flagged']} of {again['rows']} distinct rows ever flagged); "
              f"lowest recall {100 * worst[0]:.2f} % ({worst[1]})", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    all_pass = all(v["pass"] for r in results for v in r["figures"].values())
    summary = {
        "preset": preset_name, "overrides": overrides, "config": config.to_dict(), "data": [str(Path(p).relative_to(REPO)) if Path(p).is_relative_to(REPO) else p for p in paths],
        "rows": table.num_rows, "faults_per_condition": faults_per_condition, "step_rows": step_rows, "stitch": stitch,
        "fault_share": fault_share, "warmup_steps": warmup_steps, "noise_shape": noise_shape,
        "dense_phase2": dense_phase2, "mask_truncated": mask_truncated, "announce_sampling": announce_sampling,
        "same_support": same_support,
        "seed": seed,
        "goal": {"recall": GOAL_RECALL, "false_rate": GOAL_FALSE_RATE}, "all_pass": all_pass,
        "seconds": round(time.perf_counter() - started, 1), "results": results,
    }
    (out / f"results-{preset_name}.json").write_text(json.dumps(summary, indent=1))
    table_md = markdown(results)
    (out / f"results-{preset_name}.md").write_text(
        f"# Fidelity: preset `{preset_name}`\n\nGoal: recall ≥ {100 * GOAL_RECALL:g} % at ≤ {100 * GOAL_FALSE_RATE:g} % "
        f"false quarantines. Recall cells in %, ✗ = below goal. Overall: {'PASS' if all_pass else 'FAIL'}.\n\n{table_md}\n")
    curves = sweep(judged_all, config)
    (out / f"sweep-{preset_name}.json").write_text(json.dumps(
        {"false_alarm_budgets": list(SWEPT_BUDGETS), "thresholds": [math.log(1 / b) for b in SWEPT_BUDGETS],
         "curves": curves}))
    plot_sweep(curves, SWEPT_BUDGETS, config.false_alarm_budget, out / f"sweep-{preset_name}.png",
               f"preset {preset_name}: score threshold ln(1/α), α = 1e-8…1e-1 (pooled over conditions)")
    print(table_md)
    print(f"overall: {'PASS' if all_pass else 'FAIL'} against recall ≥ {GOAL_RECALL:.1%} at ≤ {GOAL_FALSE_RATE:.1%} "
          f"false quarantines ({summary['seconds']} s)")


if __name__ == "__main__":
    app()
