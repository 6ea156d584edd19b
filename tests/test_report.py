import json
import re
import subprocess
import sys

import torch

from rollout_guard.config import GuardConfig
from rollout_guard.evidence import RolloutEvidence
from rollout_guard.guard import RolloutGuard
from rollout_guard.outputs.records import QuarantineRecord
from rollout_guard.outputs.report import build_report
from rollout_guard.outputs.sinks import LocalFilesSink


def fill_run(directory):
    config = GuardConfig(ceiling_delta=8.0)  # the spike alert fires above the ceiling
    guard = RolloutGuard(config)
    sink = LocalFilesSink(directory, config)
    for step in range(1, 6):
        trainer = torch.full((4, 3), -0.1)
        if step == 3:
            trainer[2] = -12.0
        report = guard.inspect(RolloutEvidence(mask=torch.ones(4, 3, dtype=torch.long), engine_logprobs=torch.full((4, 3), -0.1),
                                               trainer_logprobs=trainer), step=step)
        if step == 3:
            sink.on_records([QuarantineRecord(
                step=3, process_index=0, row=2, global_row=2, group_size=4, action="quarantined", rules=["score"],
                stats={"max_abs_delta": 11.9, "onset_token": 0.0, "mean_abs_delta": 11.9}, prompt_ids=[1],
                completion_ids=[5, 6, 7], prompt_text="<script>alert(1)</script>=", completion_text="a&b",
                completion_tokens=["a", "&", "b"], engine_logprobs=[-0.1] * 3, trainer_logprobs=[-12.0] * 3, reward=0.5,
                rewards_per_func={"r": 0.5}, advantage_before=0.3, advantage_after=0.0, sampling={}, model="m", engine={}, injected=True,
            )], guard)
        sink.on_step(report, guard)
    sink.on_end(guard)


def test_report_is_self_contained_and_escapes_text(tmp_path):
    fill_run(tmp_path / "rollout_guard")
    page = build_report(tmp_path).read_text()  # the parent folder resolves to rollout_guard/
    assert len(re.findall(r'src="data:image/png;base64,', page)) == 3  # spike chart, histogram, one worst sample
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;" in page and "a&amp;b" in page
    assert "<th>quarantined</th><td>1</td>" in page and "<th>alerts</th><td>2</td>" in page
    assert "#0 &#x27;a&#x27;" in page  # first divergent token with its text
    assert "http" not in page.replace("http-equiv", "")  # nothing fetched from elsewhere


def test_cli_report_and_a_clear_error_for_a_wrong_folder(tmp_path):
    fill_run(tmp_path)
    done = subprocess.run([sys.executable, "-m", "rollout_guard.cli", "report", str(tmp_path), "-o", str(tmp_path / "r.html")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "r.html").stat().st_size > 50_000
    missing = subprocess.run([sys.executable, "-m", "rollout_guard.cli", "report", str(tmp_path / "nope")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no metrics.jsonl" in missing.stderr and "output_dir" in missing.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["quarantined"] == 1


def test_report_skips_corrupt_lines_and_says_where(tmp_path):
    fill_run(tmp_path)
    store = tmp_path / "quarantine" / "quarantine-00000.jsonl"
    good = store.read_text()
    store.write_text("garbage{\n" + good + "\x00\x00\n")  # corrupted lines before and after the record
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write("{not json\n")
    done = subprocess.run([sys.executable, "-m", "rollout_guard.cli", "report", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "skipped 3 unreadable line(s)" in done.stderr
    page = (tmp_path / "report.html").read_text()
    assert "<th>unreadable lines skipped</th><td>3</td>" in page and "<th>records in store</th><td>1</td>" in page
    assert "quarantine-00000.jsonl:1: not a quarantine record" in page and "quarantine-00000.jsonl:3:" in page
    assert "metrics.jsonl:6: not JSON" in page


def test_a_stopped_run_says_so_in_the_report(tmp_path):
    """A circuit-breaker stop does not look like success in `rollout-guard report`: every row past the absolute
    ceiling trips the breaker in the first step."""
    config = GuardConfig(max_quarantine_share=0.5)
    guard, sink = RolloutGuard(config), LocalFilesSink(tmp_path, config)
    trainer = torch.full((4, 3), -30.0)
    report = guard.inspect(RolloutEvidence(mask=torch.ones(4, 3, dtype=torch.long), engine_logprobs=torch.full((4, 3), -0.1),
                                           trainer_logprobs=trainer), step=1)
    assert report.stop_training
    sink.on_step(report, guard)
    sink.on_end(guard)
    done = subprocess.run([sys.executable, "-m", "rollout_guard.cli", "report", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "TRAINING WAS STOPPED by the circuit breaker" in done.stderr
    page = (tmp_path / "report.html").read_text()
    assert '<p class="stopped"><b>TRAINING WAS STOPPED by the circuit breaker</b>' in page and "max_quarantine_share=0.5" in page


def test_a_run_that_finished_has_no_stop_banner(tmp_path):
    fill_run(tmp_path)
    assert 'class="stopped"' not in build_report(tmp_path).read_text()


def _statistics_only(step: int, row: int) -> QuarantineRecord:
    return QuarantineRecord(
        step=step, process_index=0, row=row, global_row=row, group_size=4, action="quarantined", rules=["score"],
        stats={"max_abs_delta": 99.0, "mean_abs_delta": 9.0, "onset_token": 0.0}, prompt_ids=[], completion_ids=[],
        prompt_text="", completion_text="", completion_tokens=[], engine_logprobs=None, trainer_logprobs=None, reward=0.1,
        rewards_per_func={"r": 0.1}, advantage_before=0.2, advantage_after=0.0, sampling={}, model="m", engine={},
        full_evidence=False,
    )


def test_records_without_tokens_are_tabled_but_not_drawn(tmp_path):
    """Records beyond evidence_samples_per_step carry statistics only; the report tables them (marked) and
    draws token charts from full records only, even when a statistics-only one has the larger |Δ|."""
    from rollout_guard.outputs.report import STATISTICS_ONLY
    from rollout_guard.outputs.store import QuarantineStore

    fill_run(tmp_path)
    QuarantineStore(tmp_path / "quarantine").append([_statistics_only(3, 1)])
    page = build_report(tmp_path).read_text()
    assert len(re.findall(r'src="data:image/png;base64,', page)) == 3  # still one worst sample drawn: the full one
    assert "<th>records in store</th><td>2</td>" in page and "<th>records without tokens</th><td>1</td>" in page
    assert STATISTICS_ONLY in page.replace("&#x27;", "'")


def test_replay_refuses_a_store_of_statistics_only_records(tmp_path):
    from typer.testing import CliRunner

    from rollout_guard.cli import app
    from rollout_guard.outputs.store import QuarantineStore

    QuarantineStore(tmp_path / "store").append([_statistics_only(1, 0), _statistics_only(1, 3)])
    result = CliRunner().invoke(app, ["replay", str(tmp_path / "store")])
    assert result.exit_code == 2, result.output
    assert "2 records hold statistics only" in result.output and "evidence_samples_per_step" in result.output


def test_a_monitor_run_over_the_ceiling_says_what_quarantine_mode_would_have_done(tmp_path):
    """Monitor mode removes nothing: the table is not titled "Quarantined", the steps over the ceiling are counted
    (all of them, not the alerts the cooldown let through), and a banner says quarantine mode would have stopped."""
    config = GuardConfig(mode="monitor", max_quarantine_share=0.5)
    guard, sink = RolloutGuard(config), LocalFilesSink(tmp_path, config)
    for step in (1, 2, 3):
        report = guard.inspect(RolloutEvidence(mask=torch.ones(4, 3, dtype=torch.long),
                                               engine_logprobs=torch.full((4, 3), -0.1),
                                               trainer_logprobs=torch.full((4, 3), -30.0)), step=step)
        assert report.stop_training is None
        record = _statistics_only(step, 0)
        record.action = "monitored"
        sink.on_records([record], guard)
        sink.on_step(report, guard)
    sink.on_end(guard)
    page = build_report(tmp_path).read_text()
    assert "Quarantined rollouts" not in page and "Suspect rollouts (3; 0 quarantined" in page
    assert "<th>steps over max_quarantine_share</th><td>3</td>" in page
    assert "the circuit breaker would have stopped this run</b>: quarantine mode (on_ceiling=&#x27;stop&#x27;) would " \
           "have stopped training at step 1" in page


def test_what_was_dropped_and_why_comes_before_the_charts_with_contents(tmp_path):
    fill_run(tmp_path / "rollout_guard")
    page = build_report(tmp_path).read_text()
    order = [page.index(f'<section id="{key}">') for key in ("alerts", "rollouts", "spikes", "worst", "configuration")]
    assert order == sorted(order), order
    assert page.index("Quarantined rollouts (1)") < page.index('src="data:image/png')  # the table before any chart
    for key in ("alerts", "rollouts", "spikes", "histogram", "configuration"):
        assert f'<a href="#{key}">' in page and page.index(f'<a href="#{key}">') < order[0], key
