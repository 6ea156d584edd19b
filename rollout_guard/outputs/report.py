"""A self-contained HTML report (charts embedded) built from the guard's local files, for people without W&B."""

from __future__ import annotations

import base64
import html
import json
import math
import re
import warnings
from pathlib import Path

from rollout_guard.outputs.charts import delta_heatmap, engine_chart, engine_samples_chart, spike_chart, token_chart
from rollout_guard.outputs.engine_view import SAMPLES_FILE, engine_history, engine_summary, read_jsonl, sample_rows
from rollout_guard.outcomes import outcome_lines, outcome_sums
from rollout_guard.outputs.records import QuarantineRecord
from rollout_guard.statistics import DELTA_BIN_EDGES
from rollout_guard.outputs.store import read_records
from rollout_guard.verdict import RULE_TEXT


REPORT_ORDER = ("alerts", "rollouts", "spikes", "worst", "outcomes", "histogram", "engine", "unreadable",
                "configuration")
"""The report's sections, in the order a user scans them: what fired and what was dropped (with why) first, the
charts next, how the guard works last."""
STATISTICS_ONLY = "(statistics only: not among the step's worst evidence_samples_per_step)"


def resolve_run_dir(path: str | Path) -> Path:
    """The guard's folder: ``path`` itself if it holds metrics.jsonl, else ``path/rollout_guard``."""
    path = Path(path)
    for candidate in (path, path / "rollout_guard"):
        if (candidate / "metrics.jsonl").is_file():
            return candidate
    raise FileNotFoundError(
        f"{path}: no metrics.jsonl here or in {path / 'rollout_guard'}; pass the guard's output_dir "
        "(by default <trainer output_dir>/rollout_guard)"
    )


def _read_jsonl(path: Path, problems: list[str] | None = None) -> list[dict]:
    """The JSON lines of a file; a line that does not parse (torn by an interrupted run, corrupted on disk) is
    skipped and described in ``problems``."""
    if not path.is_file():
        return []
    rows = []
    for number, line in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as error:
            if problems is not None:
                problems.append(f"{path}:{number}: not JSON ({str(error)[:120]})")
    return rows


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def format_value(value: object) -> str:
    """A cell or line value: floats to 4 significant digits, NaN/inf/None as a dash."""
    if isinstance(value, float):
        return "–" if not math.isfinite(value) else f"{value:.4g}"
    return "–" if value is None else str(value)


def _engine_sections(run_dir: Path, metrics: list[dict], figures: Path) -> list[str]:
    """The engine context sections: the mismatch against the engine's state per step, and each rollout's |Δ|
    against its own engine context (suspect ones circled)."""
    sections = []
    history = engine_history(metrics)
    if history:
        chart = engine_chart(history, figures / "engine.png")
        sections.append(f"<h2>Mismatch against the engine's state per step</h2>{_img(chart, 'engine chart')}")
    samples = sample_rows(read_jsonl(run_dir / SAMPLES_FILE))
    if samples:
        chart = engine_samples_chart(samples, figures / "engine_samples.png")
        sections.append(f"<h2>Each rollout against its engine context</h2>{_img(chart, 'engine per-sample chart')}")
    return sections


OUTCOME_COLUMNS = ("trl_is/corrected_rows", "trl_is/corrected_token_share", "trl_is/both", "trl_is/only_trl",
                   "trl_is/only_guard", "reward/suspect_mean", "reward/not_suspect_mean",
                   "reward/suspect_above_group_median")
"""The per-step outcome metrics (:mod:`rollout_guard.outcomes`) the report tables, where a run has them."""


def _outcome_sections(metrics: list[dict]) -> list[str]:
    """The trainer's own importance-sampling correction next to the verdict, and the rewards of the suspect rows
    against the others: the run's totals in words and a table per step (steps with suspect or corrected rows)."""
    sums: dict[str, float] = {}
    for row in metrics:
        for key, value in outcome_sums({k: _nan(v) for k, v in row.items() if not isinstance(v, list)}).items():
            sums[key] = sums.get(key, 0.0) + value
    lines = outcome_lines(sums)
    if not lines:
        return []
    columns = [name for name in OUTCOME_COLUMNS if any(name in row for row in metrics)]
    shown = [row for row in metrics if row.get("suspect") or row.get("trl_is/corrected_rows")]
    body = "".join("<tr>" + "".join(f"<td>{html.escape(format_value(cell))}</td>" for cell in
                                    (row["step"], row.get("suspect"), *(_nan(row.get(name)) for name in columns)))
                   + "</tr>" for row in shown)
    header = "".join(f"<th>{html.escape(name)}</th>" for name in ("step", "suspect", *columns))
    items = "".join(f"<li>{html.escape(line.strip())}</li>" for line in lines)
    return [f"<h2>TRL's own correction and the rewards of suspect rollouts</h2><ul>{items}</ul>"
            f"<table><tr>{header}</tr>{body}</table>"]


def build_report(run_dir: str | Path, output: str | Path | None = None, top: int = 10) -> Path:
    """Write ``report.html`` (and its PNGs under ``report/``) for a guard output folder; returns the HTML path."""
    run_dir = resolve_run_dir(run_dir)
    # a run resumed from a checkpoint re-runs the steps after it: the last line of each step wins
    problems: list[str] = []  # lines skipped because they could not be read
    metrics = sorted({row["step"]: row for row in _read_jsonl(run_dir / "metrics.jsonl", problems)
                      if isinstance(row, dict) and "step" in row}.values(), key=lambda row: row["step"])
    alerts = [row for row in _read_jsonl(run_dir / "alerts.jsonl", problems) if isinstance(row, dict)]
    records: list[QuarantineRecord] = list(read_records(run_dir / "quarantine", problems))
    if problems:
        warnings.warn(f"{run_dir}: skipped {len(problems)} unreadable line(s): " + "; ".join(problems[:5])
                      + (" …" if len(problems) > 5 else ""), stacklevel=2)
    config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").is_file() else {}
    try:
        saved_summary = json.loads((run_dir / "summary.json").read_text())
        stopped, would_have_stopped = saved_summary.get("stopped"), saved_summary.get("would_have_stopped")
    except (OSError, ValueError, AttributeError):
        stopped = would_have_stopped = None
    if stopped:
        warnings.warn(f"{run_dir}: TRAINING WAS STOPPED by the circuit breaker: {stopped}", stacklevel=2)
    figures = run_dir / "report"
    history = [
        {key: _nan(row.get(key)) if key != "step" else row["step"] for key in
         ("step", "max_abs_delta", "p99_abs_delta", "kept_max_abs_delta", "max_score", "kept_max_score",
          "score_threshold", "suspect", "quarantined")}
        for row in metrics
    ]
    sections: dict[str, str] = {}  # id → html, put in REPORT_ORDER below
    if history:
        chart = spike_chart(history, config.get("ceiling_delta"), figures / "spikes.png")
        sections["spikes"] = f"<h2>Score and |Δ| per step</h2>{_img(chart, 'spike chart')}"
        histograms = [row["delta_histogram"] for row in metrics if row.get("delta_histogram")]
        if histograms and len(histograms) == len(metrics):
            heatmap = delta_heatmap([row["step"] for row in metrics], histograms, DELTA_BIN_EDGES.tolist(),
                                    figures / "histogram.png")
            sections["histogram"] = f"<h2>Token |Δ| histogram per step</h2>{_img(heatmap, 'histogram heatmap')}"
    sections["engine"] = "".join(_engine_sections(run_dir, metrics, figures))
    sections["outcomes"] = "".join(_outcome_sections(metrics))
    if problems:
        items = "".join(f"<li>{html.escape(problem)}</li>" for problem in problems)
        sections["unreadable"] = f"<h2>Unreadable lines skipped ({len(problems)})</h2><ul>{items}</ul>"
    if alerts:
        items = "".join(f"<li><b>step {a['step']}</b>: {html.escape(a['title'])}<br>"
                        f"<small>{html.escape(a['text'])}</small></li>" for a in alerts)
        sections["alerts"] = f"<h2>Alerts ({len(alerts)})</h2><ul>{items}</ul>"
    # token by token needs the tokens: records without them (beyond evidence_samples_per_step) are tabled only
    worst = sorted((record for record in records if record.full_evidence),
                   key=lambda record: -(record.stats.get("score") or -math.inf))[:top]
    if worst:
        plots = "".join(
            _img(token_chart(record, figures / f"worst_{index:02d}_step{record.step}_row{record.global_row}.png"),
                 f"rollout {record.global_row}")
            for index, record in enumerate(worst)
        )
        sections["worst"] = f"<h2>Highest-scoring {len(worst)} rollouts, token by token</h2>{plots}"
    if records:
        header = ("step", "rollout", "action", "why", "rules", "score", "prompt", "completion", "reward", "max |Δ|",
                  "mean |Δ|", "onset token", "injected", "engine context")
        body = []
        for record in records:
            first = record.stats.get("onset_token")
            first_text = ""
            if first is not None and 0 <= first < len(record.completion_tokens):
                first_text = f"#{int(first)} {record.completion_tokens[int(first)]!r}"
            completion = record.completion_text if record.full_evidence else STATISTICS_ONLY
            cells = (record.step, record.global_row, record.action, record.explanation, ", ".join(record.rules),
                     _nan(record.stats.get("score")), record.prompt_text, completion, record.reward, _nan(record.stats.get("max_abs_delta")),
                     _nan(record.stats.get("mean_abs_delta")), first_text, record.injected,
                     engine_summary(record.engine))
            body.append("<tr>" + "".join(f"<td>{html.escape(format_value(cell))}</td>" for cell in cells) + "</tr>")
        quarantined = sum(record.action == "quarantined" for record in records)
        title = (f"Quarantined rollouts ({len(records)})" if quarantined == len(records) else
                 f"Suspect rollouts ({len(records)}; {quarantined} quarantined, the rest kept in monitor mode)")
        legend = "".join(f"<li><b>{html.escape(name)}</b>: {html.escape(text)}</li>" for name, text in RULE_TEXT.items())
        sections["rollouts"] = (
            f"<h2>{html.escape(title)}</h2><p>Rules:</p><ul>{legend}</ul><table><tr>"
            + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>" + "".join(body) + "</table>"
        )
    summary = {
        "steps": len(metrics),
        "rollouts": int(sum(row.get("samples") or 0 for row in metrics)),
        "suspect": int(sum(row.get("suspect") or 0 for row in metrics)),
        "quarantined": int(sum(row.get("quarantined") or 0 for row in metrics)),
        "steps over max_quarantine_share": int(sum(row.get("over_ceiling") or 0 for row in metrics)),
        "alerts": len(alerts),
        "records in store": len(records),
        "records without tokens": sum(not record.full_evidence for record in records),
        "unreadable lines skipped": len(problems),
    }
    summary_html = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(format_value(v))}</td></tr>"
                           for k, v in summary.items())
    sections["configuration"] = f"<h2>Configuration</h2><pre>{html.escape(json.dumps(config, indent=1))}</pre>"
    ordered = [(key, sections[key]) for key in REPORT_ORDER if sections.get(key)]
    contents = "".join(f'<li><a href="#{key}">{re.sub("<[^>]+>", "", text.split("</h2>")[0])}</a></li>'
                       for key, text in ordered)
    body_html = "".join(f'<section id="{key}">{text}</section>' for key, text in ordered)
    stopped_html = ('<p class="stopped"><b>TRAINING WAS STOPPED by the circuit breaker</b> (the run did not finish as '
                    f'planned): {html.escape(str(stopped))}</p>' if stopped else "")
    if would_have_stopped:
        stopped_html += ('<p class="stopped"><b>Monitor mode: the circuit breaker would have stopped this run</b>: '
                         f'{html.escape(str(would_have_stopped))}</p>')
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>rollout_guard report</title>
<style>body{{font-family:sans-serif;margin:24px;max-width:1400px}} img{{max-width:100%;display:block;margin:8px 0}}
table{{border-collapse:collapse;font-size:13px}} td,th{{border:1px solid #ccc;padding:3px 6px;\
text-align:left;vertical-align:top}}
td{{font-family:monospace;white-space:pre-wrap;max-width:420px}}
.stopped{{background:#fde0dc;border:2px solid #d62728;padding:10px;font-size:16px}}</style></head><body>
<h1>rollout_guard report</h1><p>{html.escape(str(run_dir))}</p>{stopped_html}<table>{summary_html}</table>
<h2>Contents</h2><ul>{contents}</ul>{body_html}</body></html>"""
    output = Path(output) if output is not None else run_dir / "report.html"
    output.write_text(page)
    return output
