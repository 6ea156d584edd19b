"""`benchmarks/soak.py`'s checks, without a run: the step times and the guard's share of the step from the run's
files, and the memory probe."""

from __future__ import annotations

import doctest
import json
import sys
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import soak  # noqa: E402


def test_docstring_examples():
    result = doctest.testmod(soak, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def _progress(step_seconds: dict[int, float], attempt: int = 0) -> list[dict]:
    rows, now = [], 1000.0
    for step, seconds in sorted(step_seconds.items()):
        now += seconds
        rows.append({"attempt": attempt, "event": "step", "step": step, "time": now})
    return rows


def test_the_guard_share_is_flat_when_load_slows_every_step_and_not_when_the_guard_slows_alone():
    """A second half of the run on a loaded machine (every step, the guard's part included, twice as slow) leaves
    the guard's share of the step level, while its absolute time doubles; a guard that slows alone raises it."""
    steps = range(1, 2001)
    load = {step: 2.0 if step > 1000 else 1.0 for step in steps}
    progress = _progress({step: 0.05 * load[step] for step in steps})
    seconds = soak.step_seconds(progress, {0: 0}, warmup=50)
    loaded = soak.guard_share({step: 0.003 * load[step] for step in steps}, seconds, 250)
    assert abs(loaded["slope_relative_per_1000_steps"]) < 0.01 and loaded["mean"] == 0.06
    assert [b["guard_ms"] for b in loaded["bins"]] == [3.0] * 4 + [6.0] * 4
    slower = soak.guard_share({step: 0.003 * load[step] for step in steps},
                              soak.step_seconds(_progress(dict.fromkeys(steps, 0.05)), {0: 0}, warmup=50), 250)
    assert slower["slope_relative_per_1000_steps"] > 0.25


def test_step_times_of_a_resumed_run_count_in_its_last_process_run():
    """Steps 41–50 run twice (a kill after step 50, a resume from checkpoint 40): their times are the second run's,
    and each run's first `warmup` steps are left out (41–45: neither run's time counts)."""
    first = _progress(dict.fromkeys(range(1, 51), 0.1))
    second = _progress(dict.fromkeys(range(41, 61), 0.3), attempt=1)
    seconds = soak.step_seconds(first + second, {0: 0, 1: 40}, warmup=5)
    assert sorted(seconds) == list(range(6, 41)) + list(range(46, 61))
    assert {round(seconds[step], 6) for step in range(46, 61)} == {0.3}


def test_a_memory_probe_names_the_allocation_site_that_grew(tmp_path):
    was_tracing = tracemalloc.is_tracing()
    probe = soak.MemoryProbe(tmp_path / "memory.jsonl", frames=2)
    probe.start()
    try:
        probe.probe(1)
        kept = [[bytearray(1024)] for _ in range(2000)]  # ~2 MiB held from here, in 2,000 lists
        probe.probe(2)
    finally:
        if not was_tracing:
            tracemalloc.stop()
    first, second = (json.loads(line) for line in (tmp_path / "memory.jsonl").read_text().splitlines())
    assert first["step"] == 1 and "top_sites" not in first and second["step"] == 2
    top = second["top_sites"][0]
    assert top["site"].startswith(__file__) and top["kib_gained"] >= 2000 and len(kept) == 2000
    assert second["traced_kib"] - first["traced_kib"] >= 2000 and second["rss_kib"] > 0
    assert dict(second["types_gained"]).get("list", 0) >= 2000
