"""Detection fidelity benchmark: how often the guard misses corruption and drops good samples.

Replays real clean rollouts (``benchmarks/fidelity_data/*.parquet``: engine vs trainer logprobs with their real
numeric mismatch) under several noise conditions, mixed with the fault zoo, through ``RolloutGuard`` as a stream
of training steps, and prints per fault type × noise condition the recall, and per condition the false
quarantines per clean sample and per million clean tokens, with Wilson 95 % intervals and PASS/FAIL against the
goal: recall ≥ 99.9 % of corrupted rollouts at ≤ 0.1 % false quarantines of clean rollouts, in the same step,
with no extra forward pass (the guard only reads the logprobs TRL already has). PASS compares the point
estimate; CI-PASS also needs the whole interval on the right side of the goal.

    python benchmarks/fidelity.py --same-support          # today's GuardConfig defaults, into runs/fidelity/
    python benchmarks/fidelity.py --preset v0.1 --out runs/fidelity-v0.1   # release 0.1's fixed thresholds
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
from types import SimpleNamespace

import torch
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fidelity_kit import noise, zoo  # noqa: E402
from benchmarks.fidelity_kit.rollouts import (Rollouts, cat, from_table, padded_column, read_tables,  # noqa: E402
    stitched)
from benchmarks.fidelity_kit.score import GOAL_FALSE_RATE, GOAL_RECALL, figures, replay  # noqa: E402
from rollout_guard.config import GuardConfig  # noqa: E402
from rollout_guard.guard import RolloutGuard  # noqa: E402
from rollout_guard.errors import GuardConfigError  # noqa: E402
from rollout_guard.statistics import COLUMN  # noqa: E402
from rollout_guard.verdict import judge  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = str(REPO / "benchmarks" / "fidelity_data" / "h200-*.parquet")  # the 27 conditions
# (the cpu-vllm-* files are the vLLM CPU runs of the data README, with sources of their own: --data to add them)

app = typer.Typer(add_completion=False)


def preset(name: str) -> GuardConfig:
    """The guard configurations the benchmark knows. The circuit breaker is off: it is about stopping a run, not
    about which samples are judged corrupt, and a stream with many faults would trip it."""
    if name == "defaults":
        return GuardConfig(max_quarantine_share=None)
    if name == "v0.1":  # the fixed thresholds of release 0.1, chosen on the tiny copy model
        return GuardConfig(max_quarantine_share=None, spike_delta=8.0, mean_delta=1.0, confident_wrong_tokens=2,
                           spike_excess=None, drift_threshold=None, changepoint_budget=None)
    if name == "detector-only":  # the direction-aware rules and NaN rules alone
        return GuardConfig(max_quarantine_share=None, spike_delta=None, mean_delta=None, confident_wrong_tokens=None)
    if name == "single-score":  # rollout_guard.detector.Detector with its defaults (SingleScore); no rule of these
        return GuardConfig(max_quarantine_share=None, spike_delta=None, mean_delta=None, confident_wrong_tokens=None,
                           nonfinite_engine_tokens=None, nonfinite_trainer_tokens=None, spike_excess=None,
                           drift_threshold=None, changepoint_budget=None)
    raise typer.BadParameter(f"--preset {name!r}: use 'defaults', 'v0.1', 'detector-only' or 'single-score'")


class SingleScore:
    """:class:`rollout_guard.detector.Detector` behind the part of ``RolloutGuard``'s interface the replay uses:
    each step judged, then learned from its kept rows; a change of sampling setting starts the noise over."""

    def __init__(self, device: str) -> None:
        from rollout_guard.detector import Detector

        self.detector = Detector(device=device)
        self.sampling: tuple | None = None

    def inspect(self, evidence, step: int, sampling=None) -> SimpleNamespace:
        if sampling is not None:
            if self.sampling is not None and tuple(sampling) != self.sampling:
                self.detector.reset()
            self.sampling = tuple(sampling)
        judgement = self.detector.judge(evidence.engine_logprobs, evidence.trainer_logprobs, evidence.mask)
        self.detector.update(judgement.kept_counts)
        samples = torch.full((evidence.batch_size, len(COLUMN)), math.nan, dtype=torch.float64)
        return SimpleNamespace(samples=samples, suspect=judgement.suspect.cpu(), drift_threshold=None,
                               changepoint_threshold=None)

    def state_dict(self) -> dict:
        return {"detector": self.detector.state_dict(), "sampling": self.sampling}

    def load_state_dict(self, state: dict) -> None:
        self.detector.load_state_dict(state["detector"])
        self.sampling = state["sampling"]


def with_overrides(config: GuardConfig, overrides: list[str]) -> GuardConfig:
    """``config`` with ``FIELD=VALUE`` overrides (``--set``; VALUE a Python literal: ``2.0``, ``None``, ``True``), checked
    by :class:`GuardConfig` itself, before any data is read.

    >>> with_overrides(preset("defaults"), ["calibrated_drift_floor=2.0"]).calibrated_drift_floor
    2.0
    """
    known = {field.name for field in fields(GuardConfig)}
    changes = {}
    for item in overrides:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or name not in known:
            raise typer.BadParameter(f"--set {item!r}: use FIELD=VALUE with FIELD a GuardConfig field, e.g. "
                                     "calibrated_drift_floor=2.0")
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
               noise_shape: str = "surprise") -> list[tuple[str, Rollouts, dict[str, Rollouts], Noise, dict]]:
    """(name, clean base rollouts, real faulty rollouts by fault, noise applied on top, noise parameters) per noise
    condition. The noise goes on top of faulty rows too (after the fault): an engine that reads stale state still
    returns processed logprobs, and a run's numeric noise does not stop at a corrupted sample. ``same_support``:
    the trainer's logprobs renormalised over the engine's support (``noise.on_engine_support``) where it was cut by
    top-k, as the TRL adapter's ``compare_on_engine_support`` does (top-p alone stays with the calibration).
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
        if not (same_support and top_k > 0):  # as the TRL adapter: top-p alone is left to the calibration
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


def _guard(config: GuardConfig, device: str, per_token_offset: bool, single_score: bool = False) -> RolloutGuard:
    """The guard of one condition, told whether a top-k cut's offset stays in the trainer's logprobs
    (``Calibration.per_token_offset``, as the TRL adapter sets it); ``single_score``: :class:`SingleScore`."""
    if single_score:
        return SingleScore(device)
    guard = RolloutGuard(config, device=device)
    guard.calibration.per_token_offset = per_token_offset
    return guard


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


def sweep(judged_all: list, config: GuardConfig, factors: torch.Tensor) -> dict[str, list[float]]:
    """Recall per fault and clean false rate, pooled over conditions, with every nat threshold scaled by a factor
    (``token_spike``, ``mean_drift`` and ``drift`` thresholds × f, the drift one each row's calibrated one; the
    spike floor of ``directional_spike`` moved by (f − 1) × ``spike_excess``), re-judging the stored per-sample
    statistics; the ``changepoint`` rule, whose threshold is no nats, at each row's own."""
    samples = torch.cat([j.rows()[0] for j in judged_all])
    drift = torch.cat([j.drift_thresholds() for j in judged_all])  # each row's calibrated drift threshold
    changepoint = torch.cat([j.changepoint_thresholds() for j in judged_all])
    labels = [label for j in judged_all for label in j.rows()[2]]
    counted = torch.cat([j.rows()[3] for j in judged_all])
    curves: dict[str, list[float]] = {}
    names = sorted(set(labels))
    label_rows = {name: torch.tensor([label == name for label in labels]) & counted for name in names}
    margin = COLUMN["spike_margin"]
    for factor in factors.tolist():
        scaled = replace(config, spike_delta=config.spike_delta * factor if config.spike_delta else None,
                         mean_delta=config.mean_delta * factor if config.mean_delta else None)
        shifted = samples.clone()
        if config.spike_excess is not None:
            shifted[:, margin] -= (factor - 1.0) * config.spike_excess
        suspect = judge(shifted, scaled, drift * factor, changepoint).suspect
        for name in names:
            rows = label_rows[name]
            curves.setdefault(name, []).append(float((suspect & rows).sum()) / max(int(rows.sum()), 1))
    return curves


def plot_sweep(curves: dict[str, list[float]], factors: torch.Tensor, path: Path, title: str) -> None:
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
    default = int((factors - 1.0).abs().argmin())
    axis.axvline(GOAL_FALSE_RATE, color="grey", linestyle="--", linewidth=1)
    axis.axhline(GOAL_RECALL, color="grey", linestyle="--", linewidth=1)
    axis.scatter([float(false_rate[default])] * 1, [0.0], marker="^", color="black", label="default thresholds (x)")
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
    preset_name: str = typer.Option("defaults", "--preset", help="guard configuration to measure"),
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
                                      "faults: the calibration fed the missed ones at that density)"),
    mask_truncated: bool = typer.Option(False, help="as TRL's mask_truncated_completions=True: truncated rows' loss mask is zero"),
    same_support: bool = typer.Option(False, help="judge the trainer's logprobs renormalised over the engine's kept "
                                      "support, as the TRL adapter does with compare_on_engine_support (the engine's "
                                      "recorded log-mass stands in for the trainer's, plus an error: noise.on_engine_support)"),
    announce_sampling: bool = typer.Option(True, help="tell the guard each step's sampling setting, as the TRL adapter "
                                           "does (a change restarts its calibration); off: the pooled streams change "
                                           "setting unannounced, like a policy whose entropy jumps"),
    noise_shape: str = typer.Option("surprise", help="the tail models' broad part, fitted to the same published "
                                    "figures: 'surprise' (its spread grows with a token's surprise), 'flat' (the same "
                                    "on every token) or 'softmax' (1 − p: quiet where the engine is sure)"),
    seed: int = typer.Option(0),
    device: str = typer.Option("cpu", help="where the guard runs (cpu, cuda)"),
    out: Path = typer.Option(REPO / "runs" / "fidelity",
                             help="folder for results-<preset>.{json,md} and sweep-<preset>.{json,png} (default: "
                                  "runs/fidelity, ignored by git; the published runs are under benchmarks/)"),
    overrides: list[str] = typer.Option([], "--set", help="FIELD=VALUE: measure the preset with this GuardConfig field "
                                        "changed (repeat for more), e.g. --set calibrated_drift_floor=2.0"),
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
        # as the TRL adapter: off the engine's support, a top-k cut leaves a per-token offset in the trainer's logprobs
        per_token_offset = not same_support and params.get("top_k_cut", False)
        judged = replay(apply(clean), faulty, config, generator, step_rows=step_rows, fault_share=fault_share,
                        mask_truncated=mask_truncated, device=device, announce_sampling=announce_sampling,
                        warmup_steps=warmup_steps, dense_phase2=dense_phase2,
                        make_guard=functools.partial(_guard, device=device, per_token_offset=per_token_offset,
                                                     single_score=preset_name == "single-score"))
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
    factors = torch.logspace(-1, 1, 21)
    curves = sweep(judged_all, config, factors)
    (out / f"sweep-{preset_name}.json").write_text(json.dumps({"factors": factors.tolist(), "curves": curves}))
    plot_sweep(curves, factors, out / f"sweep-{preset_name}.png",
               f"preset {preset_name}: every nat threshold scaled ×0.1…×10 (pooled over conditions)")
    print(table_md)
    print(f"overall: {'PASS' if all_pass else 'FAIL'} against recall ≥ {GOAL_RECALL:.1%} at ≤ {GOAL_FALSE_RATE:.1%} "
          f"false quarantines ({summary['seconds']} s)")


if __name__ == "__main__":
    app()
