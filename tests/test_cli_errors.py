"""rollout-guard audit/replay: bad input ends in one line on stderr and exit code 2, before any engine starts."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rollout_guard.cli import app


@pytest.fixture()
def model_dir(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")  # enough for the checks; no engine may start in these tests
    return folder


@pytest.fixture()
def prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("abc=\n")
    return path


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def one_line_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.output and "verdict" not in result.stdout


def test_audit_usage_errors(tmp_path, model_dir, prompts):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"abc\x00\xff\xfe")
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"abc=\x00\n")
    bad_jsonl = tmp_path / "prompts.jsonl"
    bad_jsonl.write_text(json.dumps({"text": "abc="}) + "\n")
    m = str(model_dir)
    one_line_error(run("audit", m, "--prompts", str(empty)), "--prompts", "empty")
    one_line_error(run("audit", m, "--prompts", str(prompts), "--samples", "0"), "--samples 0")
    one_line_error(run("audit", m, "--dtype", "float64"), "--dtype float64", "bfloat16")
    one_line_error(run("audit", m, "--trainer-dtype", "int8"), "--trainer-dtype int8")
    one_line_error(run("audit", m, "--inject-rate", "2"), "--inject-rate 2")
    one_line_error(run("audit", m, "--inject-rate", "-0.1"), "--inject-rate -0.1")
    one_line_error(run("audit", m, "--max-tokens", "0"), "--max-tokens 0")
    one_line_error(run("audit", m, "--temperature", "0"), "--temperature 0")
    one_line_error(run("audit", m, "--prompts", str(binary)), "not UTF-8")
    one_line_error(run("audit", m, "--prompts", str(nul)), "binary")
    one_line_error(run("audit", m, "--prompts", str(bad_jsonl)), '"prompt"')
    one_line_error(run("audit", m, "--prompts", str(tmp_path / "missing.txt")), "no such file")
    one_line_error(run("audit", str(tmp_path / "no-model")), "MODEL", "no such folder")
    one_line_error(run("audit", str(tmp_path)), "no config.json")
    one_line_error(run("audit", m, "--stress", "--max-num-seqs", "16", "--max-num-batched-tokens", "8"),
                   "--max-num-batched-tokens 8", "--max-num-seqs 16")
    one_line_error(run("audit", m, "--stress", "--rounds", "0"), "--rounds 0")
    one_line_error(run("audit", m, "--random-prompts", "0"), "--random-prompts 0")


def test_audit_accepts_the_borderline_values(model_dir, prompts, monkeypatch):
    """Values at the edge of each check pass it (the run is stopped right after, before an engine would start)."""
    import rollout_guard.integrations.vllm_tools as vllm_tools

    started = []

    def fake_audit(*args, **kwargs):
        started.append(kwargs)
        raise vllm_tools.AuditUsageError("stopped by the test")

    monkeypatch.setattr(vllm_tools, "audit", fake_audit)
    result = run("audit", str(model_dir), "--prompts", str(prompts), "--samples", "1", "--inject-rate", "1",
                 "--max-tokens", "1", "--stress", "--max-num-seqs", "8", "--max-num-batched-tokens", "8")
    one_line_error(result, "stopped by the test")
    assert len(started) == 1 and started[0]["stress"].max_num_batched_tokens == 8
    assert "conditions: token budget per step (--max-num-batched-tokens): 8" in result.stdout
    assert "prefix caching: on; rounds: 3; lengths: varied" in result.stdout


def test_replay_usage_errors(tmp_path):
    one_line_error(run("replay", str(tmp_path / "nowhere")), "no such folder", "quarantine")
    empty = tmp_path / "store"
    empty.mkdir()
    one_line_error(run("replay", str(empty)), "no quarantine records")
    one_line_error(run("replay", str(empty), "--dtype", "float64"), "--dtype float64")
    junk = tmp_path / "junk.jsonl"
    junk.write_text("not json\n")
    one_line_error(run("replay", str(junk)), "holds no quarantine records")  # its one unreadable line is skipped and counted


def test_help_texts_keep_their_square_brackets():
    """Typer renders help with rich markup, where an unescaped ``[max/4, max]`` is a tag and vanishes."""
    result = CliRunner().invoke(app, ["audit", "--help"], env={"COLUMNS": "240"}, terminal_width=240)
    assert result.exit_code == 0, result.output
    assert "[max/4, max]" in result.output
