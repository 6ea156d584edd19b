"""The ``rollout-guard`` command line (the ``cli`` extra; ``audit`` and ``replay`` also need vLLM: ``cpu`` or
``gpu``)."""

from __future__ import annotations

import math
import os
from pathlib import Path

from rollout_guard.extras import require_extra

require_extra("the rollout-guard command line", ("typer", "rich", "matplotlib"), "cli")
import typer

from rollout_guard.outputs.report import format_value

app = typer.Typer(help="rollout_guard: keep corrupted rollouts out of RL training.", no_args_is_help=True,
                  add_completion=False)


@app.callback()
def main() -> None:
    """report: HTML from a run's local files. audit: check a vLLM deployment against transformers. replay:
    score a quarantined sample again."""


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="The guard's output folder (or the trainer output_dir holding "
                                   "rollout_guard/)."),
    output: Path | None = typer.Option(None, "--output", "-o", help="HTML file to write "
                                       "(default RUN_DIR/report.html)."),
    top: int = typer.Option(10, help="How many of the worst samples to draw token by token."),
) -> None:
    """Build one self-contained HTML report (spike chart, |Δ| histograms, alerts, worst samples, quarantine table)."""
    from rollout_guard.outputs.report import build_report

    try:
        path = build_report(run_dir, output, top=top)
    except FileNotFoundError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from error
    typer.echo(str(path))


def _quiet_vllm() -> None:
    """vLLM logs INFO lines to stdout; keep the command's own output readable (set VLLM_LOGGING_LEVEL to see them)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def _fail(message: str) -> typer.Exit:
    """One line on stderr, exit code 2 (usage or environment error)."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


@app.command()
def audit(
    model: str = typer.Argument(..., help="Model folder (or hub id already in the local cache) that vLLM and "
                                "transformers load."),
    prompts: Path | None = typer.Option(None, help="Prompts, one per line (.txt) or {'prompt': ...} per line (.jsonl). "
                                        "Default: random token prompts."),
    random_prompts: int = typer.Option(16, help="How many random token prompts when no --prompts file is given."),
    prompt_tokens: int = typer.Option(8, help="Tokens per random prompt (with --stress: 1 to 2 × this)."),
    samples: int = typer.Option(4, help="Completions per prompt (per round)."),
    max_tokens: int = typer.Option(32, help="Tokens per completion (with --stress: each request draws its limit from "
                                   "\\[max/4, max])."),
    temperature: float = typer.Option(1.0),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16, for vLLM and transformers alike."),
    trainer_dtype: str | None = typer.Option(None, help="dtype of the transformers model only (default: --dtype), e.g. "
                                             "float32 next to a bfloat16 engine."),
    inject_rate: float = typer.Option(0.0, help="Share of samples to corrupt with stale context "
                                      "(to see the guard fire)."),
    seed: int = typer.Option(0),
    output: Path | None = typer.Option(None, "--output", "-o", help="Write the guard's local files "
                                       "(and records) here."),
    stress: bool = typer.Option(False, "--stress", help="Run under the conditions in which cache-recycling bugs show: "
                                "8 concurrent requests, a token budget of 8 per step (a new request next to 7 decoding "
                                "ones gets one token), 32 cache blocks, prefix caching on, 3 rounds, varied lengths. "
                                "The options below override single conditions."),
    max_num_batched_tokens: int | None = typer.Option(None, help="vLLM token budget per engine step."),
    max_num_seqs: int | None = typer.Option(None, help="vLLM concurrent requests."),
    cache_blocks: int | None = typer.Option(None, help="vLLM KV/state cache blocks (num_gpu_blocks_override): "
                                            "few blocks "
                                            "recycle cache slots fast."),
    prefix_caching: bool | None = typer.Option(None, "--prefix-caching/--no-prefix-caching",
                                               help="vLLM prefix caching."),
    rounds: int | None = typer.Option(None, help="Generate every prompt this many times with one engine (default 1; "
                                      "3 with --stress)."),
    show: int = typer.Option(20, help="How many suspect samples to list."),
) -> None:
    """Sample with vLLM, score the same tokens with transformers, judge every sample as in training.

    Exit code 0: every sample agrees (with --inject-rate: exactly the injected ones are flagged). 1: suspect
    samples found. 2: usage or environment error (one line on stderr, before any engine starts)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from rollout_guard.integrations.vllm_tools import (DTYPES, AuditUsageError, StressSettings, check_audit_inputs,
        check_model)
    from rollout_guard.integrations.vllm_tools import audit as run_audit

    _quiet_vllm()
    if stress:
        settings = StressSettings.stress(max_num_seqs, max_num_batched_tokens, cache_blocks, prefix_caching, rounds)
    else:
        settings = StressSettings(max_num_batched_tokens, max_num_seqs, cache_blocks, prefix_caching, rounds or 1)
    try:
        check_audit_inputs(prompts, samples, max_tokens, temperature, dtype, inject_rate, settings, random_prompts,
                           prompt_tokens)
        if trainer_dtype is not None and trainer_dtype not in DTYPES:
            raise AuditUsageError(f"--trainer-dtype {trainer_dtype}: use one of {', '.join(DTYPES)}")
        check_model(model)
    except AuditUsageError as error:
        raise _fail(str(error)) from error
    console = Console()
    console.print("conditions: " + "; ".join(settings.lines()), highlight=False, soft_wrap=True)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=True)
    tasks: dict[str, object] = {}

    def on_progress(phase: str, done: int, total: int) -> None:
        if phase not in tasks:
            tasks[phase] = progress.add_task({"generate": "vLLM rounds", "rescore": "re-scoring samples"}[phase],
                                             total=total)
        progress.update(tasks[phase], completed=done)

    try:
        with progress:
            result = run_audit(model, prompt_file=prompts, samples_per_prompt=samples, max_tokens=max_tokens,
                               temperature=temperature, dtype=dtype, inject_rate=inject_rate, seed=seed,
                               output_dir=output,
                               random_prompt_count=random_prompts, random_prompt_tokens=prompt_tokens, stress=settings,
                               on_progress=on_progress, trainer_dtype=trainer_dtype)
    except AuditUsageError as error:
        raise _fail(str(error)) from error
    metrics = result.report.metrics
    dtypes = dtype if trainer_dtype in (None, dtype) else f"vLLM {dtype}, transformers {trainer_dtype}"
    table = Table(title=f"rollout-guard audit: {model} ({dtypes})", show_header=False)
    for key in ("samples", "tokens", "max_abs_delta", "mean_abs_delta", "p99_abs_delta", "kl_k3", "engine_mean_logprob",
                "trainer_mean_logprob", "max_score", "nonfinite_engine_tokens", "suspect", "caught",
                "missed", "false_alarms"):
        if key in metrics:
            table.add_row(key, format_value(metrics[key]))
    table.add_row("seconds (load / generate / score)", " / ".join(f"{v:.1f}" for v in result.seconds.values()))
    console.print(table)
    worst = sorted(result.records, key=lambda r: -(r.stats.get("score") or -math.inf))
    for record in worst[:show]:
        console.print(f"suspect sample {record.row} (round {record.extra.get('round', 0)}; {', '.join(record.rules)}; "
                      f"max |Δ| {format_value(record.stats['max_abs_delta'])}): {record.explanation}. "
                      f"{record.prompt_text!r} -> {record.completion_text[:60]!r}", highlight=False, soft_wrap=True)
    if len(worst) > show:
        console.print(f"... and {len(worst) - show} more suspect samples"
                      + (f" (all in {output}/quarantine)" if output else ""),
                      highlight=False)
    if inject_rate > 0:
        clean = metrics.get("missed", 0) == 0 and metrics.get("false_alarms", 0) == 0
    else:
        clean = metrics["suspect"] == 0
    console.print("verdict: " + ("agrees" if clean else f"DISAGREES: {int(metrics['suspect'])} suspect samples of "
                                 f"{int(metrics['samples'])}"), style="green" if clean else "bold red")
    raise typer.Exit(0 if clean else 1)


def replay_config(run_dir: Path):  # noqa: ANN201 - GuardConfig, imported lazily
    """The detector's settings of the run whose guard folder is ``run_dir`` (its ``config.json``), the circuit
    breaker off (one record is judged at a time); the defaults where the folder has no readable config."""
    import json

    from rollout_guard.config import GuardConfig

    try:
        saved = json.loads((run_dir / "config.json").read_text())
        return GuardConfig(false_alarm_budget=saved["false_alarm_budget"], ceiling_delta=saved["ceiling_delta"],
                           tolerance_delta=saved.get("tolerance_delta"), max_quarantine_share=None)
    except (OSError, ValueError, KeyError, TypeError):
        return GuardConfig(max_quarantine_share=None)


def calibration_lines(results: list, run_dir: Path) -> list[str]:
    """What each replayed verdict was judged against: the run's detector state at the record's step (the verdict
    training made, from the same logprobs), or the detector's prior where the run's folder has no state for it."""
    uncalibrated = sorted({result.record.step for result in results if not result.calibrated})
    lines = []
    if len(uncalibrated) < len(results):
        lines.append(f"verdicts judged against the run's detector state at each record's step "
                     f"({run_dir / 'detector_states.jsonl'}), as training judged them")
    if uncalibrated:
        lines.append(f"NOT CALIBRATED: {run_dir} holds no detector state for step(s) {uncalibrated}; those verdicts "
                     "are judged against the detector's prior, not the run's noise, and may differ from training's")
    return lines


@app.command()
def replay(
    store: Path = typer.Argument(..., help="A quarantine store folder or file (…/rollout_guard/quarantine, "
                                 "or audit's -o DIR/quarantine)."),
    step: int | None = typer.Option(None, help="Step of the record to replay."),
    row: int | None = typer.Option(None, help="Global row of the record (with --step)."),
    index: int = typer.Option(0, help="Otherwise: the index of the record in the store (0 = oldest), "
                       "counting records with tokens only."),
    all_records: bool = typer.Option(False, "--all", help="Replay every record of the store that has tokens, "
                                     "one line each."),
    model: str | None = typer.Option(None, help="Model to score with (default: the record's model; pass the checkpoint "
                                     "of that step to reproduce the trainer's weights)."),
    engine_model: str | None = typer.Option(None, help="Weights the fresh vLLM engine loads (default: --model); pass "
                                            "the engine's weights when they may differ from the trainer's."),
    dtype: str = typer.Option("float32"),
    vllm: bool = typer.Option(True, help="Also score with a fresh vLLM engine."),
) -> None:
    """Score a quarantined sample's tokens again, given its true prompt, compare with what was recorded, and name
    the pattern: divergent from the start, isolated spikes, late onset, every token, or not reproducible."""
    from rich.console import Console
    from rich.table import Table

    from rollout_guard.integrations.vllm_tools import DTYPES, AuditUsageError, check_model, replay_many
    from rollout_guard.outputs.sinks import read_detector_states
    from rollout_guard.outputs.store import read_records

    _quiet_vllm()
    if not store.exists():
        raise _fail(f"STORE {store}: no such folder or file; pass the quarantine folder the guard wrote "
                    "(OUTPUT/rollout_guard/quarantine, or audit's -o DIR/quarantine)")
    if dtype not in DTYPES:
        raise _fail(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
    try:
        records = list(read_records(store))
    except (ValueError, OSError) as error:
        raise _fail(f"STORE {store}: {error}") from error
    if not records:
        raise _fail(f"STORE {store}: holds no quarantine records; nothing to replay")
    without_tokens = sum(not record.full_evidence for record in records)
    records = [record for record in records if record.full_evidence]  # replay needs the tokens
    if not records:
        raise _fail(f"STORE {store}: its {without_tokens} records hold statistics only, no tokens to replay "
                    "(raise GuardConfig.evidence_samples_per_step to record tokens)")
    if all_records:
        chosen = records
    elif step is not None:
        chosen = [r for r in records if r.step == step and (row is None or r.global_row == row)][:1]
        if not chosen:
            raise _fail(f"no record with step={step}"
                        + (f" and row={row}" if row is not None else "") + f" in {store}; "
                        f"steps present: {sorted({r.step for r in records})}")
    else:
        if not 0 <= index < len(records):
            raise _fail(f"--index {index} is outside the store's {len(records)} records (0 to {len(records) - 1})")
        chosen = [records[index]]
    run_dir = store if store.is_dir() else store.parent  # the quarantine folder
    run_dir = run_dir.parent if run_dir.name == "quarantine" else run_dir  # the guard's folder beside it
    states = read_detector_states(run_dir)
    config = replay_config(run_dir)
    try:
        for name in {model or r.model for r in chosen} | ({engine_model} if engine_model else set()):
            check_model(name)
        results = replay_many(chosen, model=model, dtype=dtype, with_vllm=vllm, engine_model=engine_model,
                              config=config, states=states)
    except AuditUsageError as error:
        raise _fail(str(error)) from error
    console = Console()
    for line in calibration_lines(results, run_dir):
        console.print(line, highlight=False, soft_wrap=True)
    if all_records:
        for result in results:
            record = result.record
            console.print(f"step {record.step} row {record.global_row}: {result.pattern.line()}", highlight=False,
                          soft_wrap=True)
        return
    result = results[0]
    record = result.record
    table = Table(title=f"replay: step {record.step}, rollout {record.global_row}, prompt {record.prompt_text!r}")
    for column in ("#", "token", "engine (recorded)", "trainer (recorded)", "trainer (replayed)", "engine (fresh)"):
        table.add_column(column, justify="right")
    engine_recorded = record.engine_logprobs or [None] * len(record.completion_ids)
    trainer_recorded = record.trainer_logprobs or [None] * len(record.completion_ids)
    fresh = result.engine or [None] * len(record.completion_ids)
    for i, token in enumerate(record.completion_tokens):
        table.add_row(str(i), repr(token), format_value(engine_recorded[i]), format_value(trainer_recorded[i]),
                      format_value(result.trainer[i]), format_value(fresh[i]))
    console.print(table)
    trainer_drift = max((abs(a - b) for a, b in zip(result.trainer, trainer_recorded, strict=True) if b is not None),
                        default=0.0)
    console.print(f"trainer replayed vs recorded: max |diff| {trainer_drift:.3g} nats"
                  + ("" if trainer_drift < 1e-3 else " (other weights than at that step? pass --model <checkpoint>)"),
                  highlight=False)
    recorded = result.verdict_recorded
    console.print(f"recorded engine vs replayed trainer: max |Δ| {format_value(recorded.metrics['max_abs_delta'])}, "
                  f"suspect: {bool(recorded.suspect[0])}",
                  highlight=False)
    if result.verdict_fresh_engine is not None:
        fresh_report = result.verdict_fresh_engine
        console.print("fresh engine vs replayed trainer: max |Δ| "
                      f"{format_value(fresh_report.metrics['max_abs_delta'])}, "
                      f"suspect: {bool(fresh_report.suspect[0])}", highlight=False)
        if bool(recorded.suspect[0]) and not bool(fresh_report.suspect[0]):
            console.print("conclusion: a fresh engine agrees with the trainer on this prompt; the recorded engine "
                          "logprobs came from state the prompt does not explain (stale cache, wrong context) at "
                          "generation time.",
                          style="bold")
        elif bool(fresh_report.suspect[0]):
            console.print("conclusion: the disagreement reproduces from the prompt alone: "
                          "look at kernels, dtype or weights.",
                          style="bold")
    console.print(result.pattern.line(), style="bold", highlight=False, soft_wrap=True)
