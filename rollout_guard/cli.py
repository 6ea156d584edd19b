"""The ``rollout-guard`` command line (the ``cli`` extra; ``audit`` and ``replay`` also need vLLM: ``cpu`` or ``gpu``)."""

from __future__ import annotations

from pathlib import Path

from rollout_guard.extras import require_extra

require_extra("the rollout-guard command line", ("typer", "rich", "matplotlib"), "cli")
import typer

from rollout_guard.report import format_value

app = typer.Typer(help="rollout_guard: keep corrupted rollouts out of RL training.", no_args_is_help=True, add_completion=False)


@app.callback()
def main() -> None:
    """report: HTML from a run's local files. audit: check a vLLM deployment against transformers. replay:
    score a quarantined sample again."""


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="The guard's output folder (or the trainer output_dir holding rollout_guard/)."),
    output: Path | None = typer.Option(None, "--output", "-o", help="HTML file to write (default RUN_DIR/report.html)."),
    top: int = typer.Option(10, help="How many of the worst samples to draw token by token."),
) -> None:
    """Build one self-contained HTML report (spike chart, |Δ| histograms, alerts, worst samples, quarantine table)."""
    from rollout_guard.report import build_report

    try:
        path = build_report(run_dir, output, top=top)
    except FileNotFoundError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from error
    typer.echo(str(path))


@app.command()
def audit(
    model: str = typer.Argument(..., help="Model folder (or hub id already in the local cache) that vLLM and transformers load."),
    prompts: Path | None = typer.Option(None, help="Prompts, one per line (.txt) or {'prompt': ...} per line (.jsonl). "
                                        "Default: random token prompts."),
    random_prompts: int = typer.Option(16, help="How many random token prompts when no --prompts file is given."),
    prompt_tokens: int = typer.Option(8, help="Tokens per random prompt."),
    samples: int = typer.Option(4, help="Completions per prompt."),
    max_tokens: int = typer.Option(32, help="Tokens per completion."),
    temperature: float = typer.Option(1.0),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16, for vLLM and transformers alike."),
    inject_rate: float = typer.Option(0.0, help="Share of samples to corrupt with stale context (to see the guard fire)."),
    seed: int = typer.Option(0),
    output: Path | None = typer.Option(None, "--output", "-o", help="Write the guard's local files (and records) here."),
) -> None:
    """Sample with vLLM, score the same tokens with transformers, judge every sample as in training.

    Exit code 0 when every sample is clean (with --inject-rate: when exactly the injected ones are flagged)."""
    from rich.console import Console
    from rich.table import Table

    from rollout_guard.integrations.vllm_tools import audit as run_audit

    result = run_audit(model, prompt_file=prompts, samples_per_prompt=samples, max_tokens=max_tokens, temperature=temperature,
                       dtype=dtype, inject_rate=inject_rate, seed=seed, output_dir=output, random_prompt_count=random_prompts,
                       random_prompt_tokens=prompt_tokens)
    metrics = result.report.metrics
    console = Console()
    table = Table(title=f"rollout-guard audit: {model} ({dtype})", show_header=False)
    for key in ("samples", "tokens", "max_abs_delta", "mean_abs_delta", "p99_abs_delta", "kl_k3", "engine_mean_logprob",
                "trainer_mean_logprob", "confident_wrong_tokens", "nonfinite_engine_tokens", "suspect", "caught", "missed", "false_alarms"):
        if key in metrics:
            table.add_row(key, format_value(metrics[key]))
    table.add_row("seconds (load / generate / score)", " / ".join(f"{v:.1f}" for v in result.seconds.values()))
    console.print(table)
    worst = sorted(result.records, key=lambda r: -(r.stats.get("max_abs_delta") or 0))[:5]
    for record in worst:
        console.print(f"suspect row {record.row} ({', '.join(record.rules)}; max |Δ| {format_value(record.stats['max_abs_delta'])}): "
                      f"{record.prompt_text!r} -> {record.completion_text[:60]!r}", highlight=False, soft_wrap=True)
    if inject_rate > 0:
        clean = metrics.get("missed", 0) == 0 and metrics.get("false_alarms", 0) == 0
    else:
        clean = metrics["suspect"] == 0
    console.print("verdict: " + ("agrees" if clean else "DISAGREES: see the suspect rows"), style="green" if clean else "bold red")
    raise typer.Exit(0 if clean else 1)


@app.command()
def replay(
    store: Path = typer.Argument(..., help="A quarantine store folder or file (…/rollout_guard/quarantine)."),
    step: int | None = typer.Option(None, help="Step of the record to replay."),
    row: int | None = typer.Option(None, help="Global row of the record (with --step)."),
    index: int = typer.Option(0, help="Otherwise: the index of the record in the store (0 = oldest)."),
    model: str | None = typer.Option(None, help="Model to score with (default: the record's model; pass the checkpoint "
                                     "of that step to reproduce the trainer's weights)."),
    dtype: str = typer.Option("float32"),
    vllm: bool = typer.Option(True, help="Also score with a fresh vLLM engine."),
) -> None:
    """Score a quarantined sample's tokens again, given its true prompt, and compare with what was recorded."""
    from rich.console import Console
    from rich.table import Table

    from rollout_guard.integrations.vllm_tools import replay as run_replay
    from rollout_guard.store import read_records

    records = list(read_records(store))
    if step is not None:
        chosen = [r for r in records if r.step == step and (row is None or r.global_row == row)]
        if not chosen:
            typer.echo(f"error: no record with step={step}" + (f" and row={row}" if row is not None else "") + f" in {store}; "
                       f"steps present: {sorted({r.step for r in records})}", err=True)
            raise typer.Exit(2)
        record = chosen[0]
    else:
        if not 0 <= index < len(records):
            typer.echo(f"error: --index {index} is outside the store's {len(records)} records", err=True)
            raise typer.Exit(2)
        record = records[index]
    result = run_replay(record, model=model, dtype=dtype, with_vllm=vllm)
    console = Console()
    table = Table(title=f"replay: step {record.step}, rollout {record.global_row}, prompt {record.prompt_text!r}")
    for column in ("#", "token", "engine (recorded)", "trainer (recorded)", "trainer (replayed)", "engine (fresh)"):
        table.add_column(column, justify="right")
    engine_recorded = record.engine_logprobs or [None] * len(record.completion_ids)
    trainer_recorded = record.trainer_logprobs or [None] * len(record.completion_ids)
    fresh = result.engine or [None] * len(record.completion_ids)
    for i, token in enumerate(record.completion_tokens):
        table.add_row(str(i), repr(token), format_value(engine_recorded[i]), format_value(trainer_recorded[i]), format_value(result.trainer[i]), format_value(fresh[i]))
    console.print(table)
    trainer_drift = max((abs(a - b) for a, b in zip(result.trainer, trainer_recorded, strict=True) if b is not None), default=0.0)
    console.print(f"trainer replayed vs recorded: max |diff| {trainer_drift:.3g} nats"
                  + ("" if trainer_drift < 1e-3 else " (other weights than at that step? pass --model <checkpoint>)"), highlight=False)
    recorded = result.verdict_recorded
    console.print(f"recorded engine vs replayed trainer: max |Δ| {format_value(recorded.metrics['max_abs_delta'])}, suspect: {bool(recorded.suspect[0])}",
                  highlight=False)
    if result.verdict_fresh_engine is not None:
        fresh_report = result.verdict_fresh_engine
        console.print(f"fresh engine vs replayed trainer: max |Δ| {format_value(fresh_report.metrics['max_abs_delta'])}, "
                      f"suspect: {bool(fresh_report.suspect[0])}", highlight=False)
        if bool(recorded.suspect[0]) and not bool(fresh_report.suspect[0]):
            console.print("conclusion: a fresh engine agrees with the trainer on this prompt; the recorded engine logprobs "
                          "came from state the prompt does not explain (stale cache, wrong context) at generation time.",
                          style="bold")
        elif bool(fresh_report.suspect[0]):
            console.print("conclusion: the disagreement reproduces from the prompt alone: look at kernels, dtype or weights.",
                          style="bold")


if __name__ == "__main__":
    app()
