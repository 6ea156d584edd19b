"""The docs' tables of benchmark results, generated from the committed results files.

A generated table sits in a Markdown file of the repository (``README.md``, ``docs/*.md``, ``benchmarks/README.md``)
between two marker comments, the table's name in the first::

    <!-- table: statistics_speed -->
    ...
    <!-- /table -->

Each name is a function of :data:`TABLES` that reads the benchmark's one results file,
``benchmarks/results/<benchmark>/*.json.gz``, and returns the Markdown between the markers; no figure is written
here by hand. Without options the script rewrites every marked region in place; ``--check`` writes nothing and exits
1, naming each file and table whose text differs from what the results files give (``benchmarks/tests/test_tables.py``
runs it, so a doc that disagrees with its results file fails the tests).

    python benchmarks/tables.py            # rewrite the docs' tables from benchmarks/results/
    python benchmarks/tables.py --check    # exit 1 if a table is out of date
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fidelity_kit.results_file import read_results  # noqa: E402
from benchmarks.fidelity_summary import summary as fidelity_totals_of  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/*.md", "benchmarks/README.md")
MARKED = re.compile(r"^<!-- table: (?P<name>[\w-]+) -->\n(?P<body>.*?)^<!-- /table -->$", re.MULTILINE | re.DOTALL)
OPENING = re.compile(r"^<!-- table: ([\w-]+) -->$", re.MULTILINE)


def results_file(root: Path, benchmark: str) -> Path:
    """The one results file of ``benchmark``: ``benchmarks/results/<benchmark>/*.json.gz``."""
    found = sorted((root / "benchmarks" / "results" / benchmark).glob("*.json.gz"))
    if len(found) != 1:
        raise FileNotFoundError(f"benchmarks/results/{benchmark}/ holds {len(found)} results files, not one: {found}")
    return found[0]


def results(root: Path, benchmark: str) -> tuple[dict, str]:
    """The results of ``benchmark`` and their path relative to ``root``."""
    path = results_file(root, benchmark)
    return read_results(path), path.relative_to(root).as_posix()


def every_result(root: Path, benchmark: str) -> list[tuple[dict, str]]:
    """The results of a benchmark with one results file per set-up (``training_step_ab``: ``cpu.json.gz`` and a
    GPU's), each with its path relative to ``root``, in order of name."""
    found = sorted((root / "benchmarks" / "results" / benchmark).glob("*.json.gz"))
    if not found:
        raise FileNotFoundError(f"benchmarks/results/{benchmark}/ holds no results file")
    return [(read_results(path), path.relative_to(root).as_posix()) for path in found]


# Number formats.

def thousands(value: float) -> str:
    """``1,024``."""
    return f"{value:,.0f}"


def fixed(value: float, decimals: int) -> str:
    """``value`` with ``decimals`` decimals, thousands separated."""
    return f"{value:,.{decimals}f}"


def span(values: Iterable[float], decimals: int) -> str:
    """``low–high`` at ``decimals`` decimals, one figure where both read the same."""
    values = list(values)
    low, high = fixed(min(values), decimals), fixed(max(values), decimals)
    return low if low == high else f"{low}–{high}"


def mib(value: float) -> str:
    """A memory size in MiB to two significant places: ``0.04``, ``1.4``, ``23``, ``181``."""
    return fixed(value, 0 if value >= 10 else 1 if value >= 1 else 2)


def signed(value: float, decimals: int = 0) -> str:
    """``+37``, ``-2.5``."""
    return f"{value:+,.{decimals}f}"


def percent(share: float, decimals: int = 1) -> str:
    """A share as a percentage: ``0.01919`` → ``1.9 %``."""
    return f"{100 * share:.{decimals}f} %"


def seconds(value: float) -> str:
    """Seconds, two decimals, three below 0.01: ``0.20 s``, ``0.001 s``."""
    return f"{value:.{2 if value >= 0.01 else 3}f} s"


def size(rows: int, tokens: int) -> str:
    """``64 × 1,024``."""
    return f"{thousands(rows)} × {thousands(tokens)}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def code(text: str) -> str:
    """``text`` as inline code."""
    return f"`{text}`"


# The tables.

def statistics_speed(root: Path) -> list[str]:
    """``statistics_speed.py``: per size the TRL ops' and the guard's time over the interleaved rounds, the ratio's
    median and range, the detector's part, host syncs, extra device memory and the corrupted rows flagged."""
    data, path = results(root, "statistics_speed")
    rows = []
    for row in data["rows"]:
        rounds = row["rounds"]
        ratios = [r["ratio"] for r in rounds]
        syncs = row["host_syncs_per_step"]
        rows.append([size(row["rows"], row["tokens_per_row"]), span((r["trl_ops_ms"] for r in rounds), 2),
                     span((r["guard_ms"] for r in rounds), 2),
                     f"{statistics.median(ratios):.1f} ({span(ratios, 1)})", fixed(row["detector_ms"], 1),
                     f"{syncs['guard']} / {syncs['trl_ops']}",
                     f"{mib(row['guard_extra_mib'])} / {mib(row['trl_ops_extra_mib'])}",
                     f"{row['suspect']} of {row['corrupted']}"])
    at_most = [size(row["rows"], row["tokens_per_row"]) for row in data["rows"]
               if statistics.median(r["ratio"] for r in row["rounds"]) <= 1]
    return [f"`{path}`: {data['device']}, torch {data['torch']}, medians of {data['repeats']} runs, "
            f"{data['rounds']} rounds.", ""] + table(
        ["rows × tokens", "TRL ops (ms, over the rounds)", "guard (ms, over the rounds)",
         "guard / TRL ops (×, median of rounds, range)", "detector's part (ms)",
         "host syncs per step (guard / TRL ops)",
         "extra device memory (MiB, guard / TRL ops)", "corrupted rows flagged"], rows) + [
        "", f"The guard's step at most TRL's ops: {', '.join(at_most) if at_most else 'at no size'}."]


def statistics_speed_parts(root: Path) -> list[str]:
    """``statistics_speed.py``: per size the guard's step in parts from its own clock (host time until its one host
    copy, waiting in the copy, after it), medians, with its whole step and TRL's ops (medians over the rounds)."""
    data, path = results(root, "statistics_speed")
    rows = []
    for row in data["rows"]:
        parts = row["step_parts_ms"]
        rounds = row["rounds"]
        rows.append([size(row["rows"], row["tokens_per_row"]), fixed(parts["until_copy"], 2),
                     fixed(parts["copy"], 2), fixed(parts["after_copy"], 2),
                     fixed(statistics.median(r["guard_ms"] for r in rounds), 2),
                     fixed(statistics.median(r["trl_ops_ms"] for r in rounds), 2)])
    return [f"`{path}`: medians of {data['repeats']} steps.", ""] + table(
        ["rows × tokens", "until the copy (ms)", "in the copy: waiting for the device (ms)", "after the copy (ms)",
         "whole step (ms)", "TRL's ops (ms)"], rows)


def cost_summary(root: Path) -> list[str]:
    """The README's costs measured by benchmarks with a committed results file: the guard's step against TRL's ops
    (``statistics_speed``), whole training steps with and without the guard (``training_step_ab``, one row per
    results file: the demo's small set-up, then a GPU's large one) and the engine context's host work
    (``engine_context``)."""
    speed, speed_path = results(root, "statistics_speed")
    sizes = speed["rows"]

    def over_rounds(key: str) -> str:
        return " / ".join(span((r[key] for r in row["rounds"]), 1) for row in sizes)

    ratios = " / ".join(f"{statistics.median(r['ratio'] for r in row['rounds']):.1f}×" for row in sizes)
    at_most = [row for row in sizes if statistics.median(r["ratio"] for r in row["rounds"]) <= 1]
    syncs = {(row["host_syncs_per_step"]["guard"], row["host_syncs_per_step"]["trl_ops"]) for row in sizes}
    speed_cell = (
        f"{speed['device']}, warm, {speed['rounds']} interleaved rounds: **{ratios}** TRL's ops at "
        + " / ".join(f"{row['rows']}×{row['tokens_per_row']}" for row in sizes)
        + f" tokens (guard {over_rounds('guard_ms')} ms against {over_rounds('trl_ops_ms')} ms; the detector's part "
        + " / ".join(fixed(row["detector_ms"], 1) for row in sizes) + " ms); host syncs per step "
        + ", ".join(f"{guard} (TRL's ops: {trl})" for guard, trl in sorted(syncs))
        + f"; extra device memory {span((row['guard_extra_mib'] for row in sizes), 2)} MiB; at most TRL's ops at "
        + (f"{len(at_most)} of {len(sizes)} sizes" if at_most else "no size")
        + " ([details](docs/detector.md#implementation-and-speed))")

    ab_rows = [[f"whole training steps with and without the guard, {training_step_scale(ab)} scale "
                f"(`benchmarks/training_step_ab.py`, `{ab_path}`)", training_step_cell(ab)]
               for ab, ab_path in sorted(every_result(root, "training_step_ab"),
                                         key=lambda found: found[0].get("engine") == "transformers")]

    engine, engine_path = results(root, "engine_context")
    host = engine["host"]
    engine_cell = (
        "host work per generation call: " + ", ".join(
            f"{fixed(1e3 * row['seconds'], 0)} ms for {thousands(row['rows'])} × {thousands(row['tokens'])}-token "
            "rollouts" for row in host[-2:])
        + f"; vLLM's own stats {fixed(1e3 * engine['engine']['on']['record_seconds_median'], 0)} ms per generate call; "
        "no extra engine call ([details](docs/engine-context.md))")
    return table(["measured by (results file)", "figure"], [
        [f"guard step vs TRL's own mismatch-metric ops (`benchmarks/statistics_speed.py`, `{speed_path}`)", speed_cell],
        *ab_rows,
        [f"engine context, vLLM colocate (`benchmarks/engine_context_overhead.py`, `{engine_path}`)", engine_cell]])


def training_step_scale(ab: dict) -> str:
    """``small`` for the demo's set-up (vLLM CPU), ``large`` for a GPU's (``--engine transformers``)."""
    return "large" if ab.get("engine") == "transformers" else "small"


def training_step_cell(ab: dict) -> str:
    """One ``training_step_ab.py`` results file: the set-up, the median step judged and passed with their difference
    and quartiles, the guard's own timers, and the time ``train()`` takes after its last step."""
    median, quartiles = ab["step_ms_median"], ab["step_ms_quartiles"]
    after = ab["after_last_step_s"]
    decimals = 1 if median["passed"] < 1000 else 0

    def ms(value: float) -> str:
        return fixed(value, decimals)

    if ab.get("engine") == "transformers":
        model = ab["model"]
        millions = model["parameters"] / 1e6
        setup = (f"{ab['card'] or ab['device']}, the transformers engine (`TransformersRollouts`) sampling from a "
                 f"random {fixed(millions, 0 if millions >= 10 else 2)} M-parameter Qwen2-architecture model "
                 f"({model['num_layers']} layers, hidden {model['hidden_size']}, vocabulary "
                 f"{thousands(model['vocab_size'])}) in {model['dtype']}, {ab['rollouts_per_step']} rollouts of "
                 f"{ab['completion_tokens']} tokens after {ab['prompt_tokens']}-token prompts per step, "
                 f"{percent(ab['injected']['rate'], 0)} injected, {ab['steps']} steps")
        own = ("; the guard's step includes its extra no-grad forward pass over the batch (TRL computes no trainer "
               "logprobs without vLLM)" if ab.get("extra_forward") else "")
    else:
        setup, own = f"the demo's set-up, {ab['steps']} steps", ""
    plain = "" if ab.get("plain_steps", ab["steps"]) == ab["steps"] else f" (a {ab['plain_steps']}-step run)"
    return (
        f"{setup} alternating in one run ({ab['steps_compared']['judged']} judged and "
        f"{ab['steps_compared']['passed']} passed compared): median step {ms(median['judged'])} ms judged against "
        f"{ms(median['passed'])} ms passed straight to the loss (**{signed(ab['step_ms_difference'], decimals)} ms, "
        f"{signed(100 * ab['step_ms_difference'] / median['passed'], 1)} %**; quartiles "
        f"{ms(quartiles['judged'][0])}–{ms(quartiles['judged'][2])} against "
        f"{ms(quartiles['passed'][0])}–{ms(quartiles['passed'][2])} ms), next to the guard's own timers: `inspect` "
        f"{fixed(ab['guard_seconds_ms_median'], 1)} ms, the adapter's whole step "
        f"{fixed(ab['adapter_overhead_ms_median'], 1)} ms{own}; `train()` returns {seconds(after['guarded'])} after "
        f"its last step with the guard (writer flush, final charts, summary) against {seconds(after['plain'])} "
        f"without{plain}")


def engine_context(root: Path) -> list[str]:
    """``engine_context_overhead.py``: the host work per generation call by batch shape (``--host``), and the
    generate calls with vLLM's stats off and on (``--engine``)."""
    data, path = results(root, "engine_context")
    host = table(["rollouts × tokens", "engine iterations", "host work per generation call (ms, median)"],
                 [[size(row["rows"], row["tokens"]), thousands(row["iterations"]), fixed(1e3 * row["seconds"], 1)]
                  for row in data["host"]])
    lines = [f"`{path}`:", ""] + host
    if "engine" in data:
        lines += ["", *table(
            ["vLLM's stats", "generate calls", "generate call (s: least, median, most)",
             "vLLM's stat recording per call (ms, median)", "its share of the median call"],
            [[setting, str(len(runs["seconds"])),
              f"{fixed(runs['min_seconds'], 2)}, {fixed(runs['median_seconds'], 2)}, {fixed(max(runs['seconds']), 2)}",
              *((fixed(1e3 * runs["record_seconds_median"], 1),
                 percent(runs["record_seconds_median"] / runs["median_seconds"], 2))
                if runs["record_seconds_median"] else ("–", "–"))]
             for setting, runs in data["engine"].items()])]
    return lines


def real_engine_detection(root: Path) -> list[str]:
    """``real_engine_detection.py``: per source (vLLM CPU runs, numbered by seed; H200 rollouts, named by model and
    sampling) the strong rows caught, grey and clean rows flagged, the clean rows' largest disagreement, warm-up rows
    flagged, and the faults by kind."""
    data, path = results(root, "real_engine_detection")
    groups = {"vLLM CPU stale state": [c for c in data["cells"] if isinstance(c["seed"], int)],
              "H200 real faults": [c for c in data["cells"] if isinstance(c["seed"], str)]}
    classes = ("strong", "grey", "clean", "warmup")
    rows = []
    for name, cells in groups.items():
        if not cells:
            continue
        counts = {key for c in cells for key, value in c.items() if key != "seed" and isinstance(value, int)}
        total = {key: sum(c.get(key, 0) for c in cells) for key in counts}
        kinds = sorted({key.removesuffix("_flagged") for c in cells for key in c
                        if key.endswith("_flagged") and key.removesuffix("_flagged") not in classes})
        runs = len({(c["seed"], c["concurrency"]) for c in cells})
        rows.append([name, f"{runs} ({', '.join(sorted({c['start'] for c in cells}))})",
                     f"{thousands(total['strong_flagged'])} of {thousands(total['strong'])}",
                     f"{thousands(total['grey_flagged'])} of {thousands(total['grey'])}",
                     f"{thousands(total['clean_flagged'])} of {thousands(total['clean'])}",
                     span((c["clean_max"] for c in cells), 2), thousands(total["warmup_flagged"]),
                     ", ".join(f"{kind.replace('_', ' ')} {thousands(total[kind + '_flagged'])} of "
                               f"{thousands(total[kind])}" for kind in kinds) or "–"])
    missed = data.get("missed_strong", [])
    return [f"`{path}`; strong rows missed: {len(missed)}.", ""] + table(
        ["", "runs (streams)", "strong caught", "grey flagged", "clean flagged",
         "clean rows within (nats, largest by run)", "warm-up rows flagged", "by fault"], rows)


STALE = "real_stale_weights"


def _fidelity_group(condition: str) -> str:
    """A condition's group: the recorded sampling settings (real data), or the noise model pooled on top."""
    return "real data" if "/+" not in condition else code(condition.split("/+", 1)[1])


def fidelity_by_group(root: Path) -> list[str]:
    """``fidelity.py`` beside ``separability.py``, per group of conditions (real data; each noise model on top):
    clean rows, false quarantines, and the recall cells below the goal, split by whether the hindsight bound reaches
    the goal's recall; ``real_stale_weights`` has a table of its own."""
    fidelity, fidelity_path = results(root, "fidelity")
    separability, separability_path = results(root, "separability")
    goal_recall, goal_false = fidelity["goal"]["recall"], fidelity["goal"]["false_rate"]
    groups: dict[str, list[dict]] = {}
    for condition in fidelity["results"]:
        groups.setdefault(_fidelity_group(condition["condition"]), []).append(condition)
    rows = []
    for name, conditions in groups.items():
        clean = [c["figures"]["clean"] for c in conditions]
        false_cell = (f"{span((100 * f['false_rate'] for f in clean), 3)} %; pooled "
                      f"{thousands(sum(f['false'] for f in clean))} of {thousands(sum(f['rows'] for f in clean))}")
        below: dict[bool, dict[str, list[tuple[float, float]]]] = {True: {}, False: {}}
        for condition in conditions:
            bounds = separability["bound"][condition["condition"]]
            for kind, figures in sorted(condition["figures"].items()):
                if kind in ("clean", STALE) or figures["pass"]:
                    continue
                bound = bounds[kind]
                below[bound >= goal_recall].setdefault(kind, []).append((figures["recall"], bound))

        def cell(kinds: dict[str, list[tuple[float, float]]]) -> str:
            return "; ".join(
                f"{code(kind)}{f' ×{len(cells)}' if len(cells) > 1 else ''} {span((100 * r for r, _ in cells), 1)} % "
                f"(bound {span((100 * b for _, b in cells), 1)} %)" for kind, cells in kinds.items()) or "–"

        rows.append([f"{name} ({len(conditions)})", thousands(sum(f["rows"] for f in clean)), false_cell,
                     str(sum(map(len, below[True].values())) + sum(map(len, below[False].values()))),
                     cell(below[True]), cell(below[False])])
    return [f"`{fidelity_path}` and `{separability_path}`; the goal: recall ≥ {100 * goal_recall:g} % at ≤ "
            f"{100 * goal_false:g} % false quarantines.", ""] + table(
        ["conditions (count)", "clean rows", "false quarantines (range over conditions; pooled rows)",
         f"recall cells below the goal, `{STALE}` aside",
         f"of these, the bound reaches {100 * goal_recall:g} %: recall (bound)",
         f"the bound stays below {100 * goal_recall:g} %: recall (bound)"], rows)


def fidelity_stale_weights(root: Path) -> list[str]:
    """``real_stale_weights`` per condition that has them: rows, the guard's recall and the hindsight bound."""
    fidelity, _ = results(root, "fidelity")
    separability, _ = results(root, "separability")
    rows = [[code(c["condition"]), thousands(c["figures"][STALE]["rows"]),
             fixed(100 * c["figures"][STALE]["recall"], 1),
             fixed(100 * separability["bound"][c["condition"]][STALE], 1)]
            for c in fidelity["results"] if STALE in c["figures"]]
    return table(["condition", f"`{STALE}` rows", "guard's recall (%)", "hindsight bound (%)"], rows)


def fidelity_totals(root: Path) -> list[str]:
    """``fidelity.py``'s result summed over its conditions (``fidelity_summary.py``): cells at the goal, false
    quarantines of clean rows and flagged judgements of resampled clean rows, each with its worst condition."""
    data, path = results(root, "fidelity")
    s = fidelity_totals_of(data)
    return table(["results file", "seed", "faults per kind and condition", "conditions", "cells at the goal",
                  "false quarantines of clean rows (worst condition)",
                  "flagged judgements of resampled clean rows (worst condition)"],
                 [[code(path), str(s["seed"]), thousands(s["faults"]), str(len(data["results"])),
                   f"{s['cells']} of {s['of']}", f"{thousands(s['false'])} ({percent(s['worst_false'], 3)})",
                   f"{thousands(s['flagged'])} ({percent(s['worst_flagged'], 3)})"]])


def percent_range(bins: list[dict]) -> str:
    """The range of the bins' ``share`` values in per cent, e.g. ``7.4–8.1 %``."""
    low, high = min(b["share"] for b in bins), max(b["share"] for b in bins)
    return f"{fixed(100 * low, 1)}–{fixed(100 * high, 1)} %" if fixed(100 * low, 1) != fixed(100 * high, 1) \
        else f"{fixed(100 * low, 1)} %"


def soak(root: Path) -> list[str]:
    """``soak.py``: the checks of the long run with kills, resumes and the breaker's stop, as its results file
    holds them."""
    data, _ = results(root, "soak")
    settings = data["settings"]
    warmup = settings["warmup"]
    records, reruns, metrics = data["records"], data["reruns"], data["metrics_lines"]
    rss, guard, breaker = data["rss"], data["guard_seconds"], data["breaker"]
    share = data.get("guard_share")
    kills = data["kills"]
    again = reruns["steps_run_again"]
    same = ("corrupted the same rows" if reruns["same_rows_corrupted"] == again
            else f"{reruns['same_rows_corrupted']} of them corrupted the same rows")
    gaps = [f"{len(metrics[key])} steps {key.removesuffix('_steps')}" for key in ("missing_steps", "repeated_steps")
            if metrics[key]]

    def limit(relative: float, most: float) -> str:
        return f"{'within' if abs(relative) <= most else 'over'} the script's {100 * most:g} % limit"

    runs = rss.get("per_process_run", {})
    message = breaker.get("message", "")
    reason = message.split(": ", 1)[-1].split(": ", 1)[0]
    told = breaker.get("reason_lines_in_log")
    failures = data.get("failures", [])
    rows = [
        ["steps", f"{thousands(data['steps'])} ({thousands(data['optimizer_steps_run'])} optimizer steps run: "
                  f"{thousands(again)} run again after the kills)"],
        ["kills", f"{len(kills)}: " + " and ".join(
            f"after step {k['after_step']} (resumed from checkpoint {k['next_resumed_from']})" for k in kills)
         if kills else "0"],
        ["corrupted rollouts in the store",
         f"{records['found']} found of {records['expected']} expected; {len(records['lost'])} lost, "
         f"{len(records['duplicated'])} duplicated, {records['quarantined_not_corrupted']} quarantined rows not "
         f"corrupted; the {again} steps run again {same}"],
        ["`metrics.jsonl`", "; ".join(gaps) if gaps else f"one line per step, 1 to {data['steps']}"],
        [f"resident memory (training process and descendants, the first {warmup} steps of each process run left out)",
         f"mean {thousands(rss['mean_mib'])} MiB; slope {signed(rss['slope_kib_per_1000_steps'] / 1024)} MiB per 1,000 "
         f"steps ({signed(100 * rss['slope_relative_per_1000_steps'], 1)} % of the mean), per process run "
         + ", ".join(signed(run["slope_kib_per_1000_steps"] / 1024) for run in runs.values())
         + f" MiB per 1,000 steps: {limit(rss['slope_relative_per_1000_steps'], settings['max_rss_slope'])}"],
        *([[f"the guard's share of the step (median `guard_seconds` / step wall time per {data['settings']['bin_steps']} "
            f"steps, the first {warmup} steps of each process run left out)",
            f"{percent_range(share['bins'])} in every bin, mean {fixed(100 * share['mean'], 1)} %; slope "
            f"{signed(100 * share['slope_per_1000_steps'], 1)} percentage points per 1,000 steps "
            f"({signed(100 * share['slope_relative_per_1000_steps'], 1)} % of the mean): "
            f"{limit(share['slope_relative_per_1000_steps'], settings['max_guard_slope'])}"]] if share else []),
        [f"`guard_seconds` (steps 1–{warmup} left out)",
         f"mean {fixed(1e3 * guard['mean'], 1)} ms; least-squares slope "
         f"{signed(1e3 * guard['slope_per_1000_steps'], 1)} ms per 1,000 steps "
         f"({signed(100 * guard['slope_relative_per_1000_steps'])} % of the mean): "
         + ("reported, not judged (machine load moves it)" if share
            else limit(guard['slope_relative_per_1000_steps'], settings['max_guard_slope']))],
        ["breaker", f"at step {breaker['step']} of `max_steps` {breaker['max_steps']}: `trainer.train()` raised "
                    f"`{breaker['exception']}` (\"{reason} …\"), exit code {breaker['exit_code']}, the reason in the "
                    "log " + ("once" if told == 1 else f"{told} times")],
        ["the script's checks", "failed: " + "; ".join(failures) if failures else "all passed"],
    ]
    return table(["check", "measured"], rows)


TABLES: dict[str, Callable[[Path], list[str]]] = {
    "cost_summary": cost_summary,
    "statistics_speed": statistics_speed,
    "statistics_speed_parts": statistics_speed_parts,
    "engine_context": engine_context,
    "real_engine_detection": real_engine_detection,
    "fidelity_totals": fidelity_totals,
    "fidelity_by_group": fidelity_by_group,
    "fidelity_stale_weights": fidelity_stale_weights,
    "soak": soak,
}


# Finding and rewriting the marked regions.

def documents(root: Path) -> list[Path]:
    """The Markdown files that may hold generated tables."""
    return sorted({path for pattern in DOCS for path in root.glob(pattern)})


def rendered(root: Path, name: str) -> str:
    """The region's body for table ``name``: a blank line, the table's lines, a blank line.

    Raises ``ValueError`` naming the table where its results file lacks a field it reads.
    """
    try:
        lines = TABLES[name](root)
    except KeyError as error:
        raise ValueError(f"table {name}: its results file has no field {error}") from error
    return "\n" + "\n".join(lines) + "\n\n"


def regenerate(text: str, root: Path, where: str) -> tuple[str, list[str]]:
    """``text`` with every marked region rewritten, and the names of the regions whose text changed.

    Raises ``ValueError`` naming ``where`` for an unknown table name or an opening marker without its closing one.
    """
    opened = OPENING.findall(text)
    found = MARKED.findall(text)
    if len(opened) != len(found):
        raise ValueError(f"{where}: {len(opened)} '<!-- table: NAME -->' markers but {len(found)} closed by "
                         "'<!-- /table -->'")
    unknown = sorted({name for name, _ in found} - set(TABLES))
    if unknown:
        raise ValueError(f"{where}: unknown table(s) {unknown}; known: {sorted(TABLES)}")
    changed = []

    def replace(match: re.Match) -> str:
        body = rendered(root, match["name"])
        if body != match["body"]:
            changed.append(match["name"])
        return f"<!-- table: {match['name']} -->\n{body}<!-- /table -->"

    return MARKED.sub(replace, text), changed


def run(root: Path, check: bool) -> tuple[list[str], list[str]]:
    """Rewrite (or, with ``check``, only compare) every marked region of the documents under ``root``.

    Returns the regions whose text differed from the results files, ``FILE: table NAME``, and the names of
    :data:`TABLES` that no document holds.
    """
    differed, used = [], set()
    for path in documents(root):
        where = path.relative_to(root).as_posix()
        text = path.read_text()
        new, changed = regenerate(text, root, where)
        used.update(OPENING.findall(text))
        differed += [f"{where}: table {name}" for name in changed]
        if changed and not check:
            path.write_text(new)
    return differed, sorted(set(TABLES) - used)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming each file and table that differs from its results file")
    parser.add_argument("--root", type=Path, default=REPO, help="the repository root (default: this repository)")
    args = parser.parse_args(argv)
    try:
        differed, unused = run(args.root.resolve(), args.check)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for region in differed:
        print(f"{region} differs from its results file (python benchmarks/tables.py rewrites it)" if args.check
              else f"{region} rewritten", file=sys.stderr if args.check else sys.stdout)
    for name in unused:
        print(f"table {name} is in no document (add '<!-- table: {name} -->' and '<!-- /table -->' where it belongs)",
              file=sys.stderr)
    return 1 if unused or (args.check and differed) else 0


if __name__ == "__main__":
    sys.exit(main())
