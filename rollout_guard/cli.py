"""The ``rollout-guard`` command line."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(help="rollout_guard: keep corrupted rollouts out of RL training.", no_args_is_help=True, add_completion=False)


@app.callback()
def main() -> None:
    """Subcommands: report (more in later versions)."""


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


if __name__ == "__main__":
    app()
