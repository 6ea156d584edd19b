"""Soak run: a long GRPO run in quarantine mode, killed with SIGKILL twice and resumed, then stopped by the breaker.

Method. The parent process runs the training in a child process (this script with ``--child``): real TRL, the
real vLLM CPU build in colocate mode and the tiny copy model, as ``examples/demo.py`` builds them, with the guard
attached (quarantine mode, default configuration) and checkpoints every ``--save-steps`` steps. A fault injector
(``StaleContextInjector``, here on a schedule) corrupts rollouts the way stale engine state does: each rollout with
probability ``--rate``, and exactly ``--burst-rows`` rows on each ``--bursts`` step (under the breaker's
``max_quarantine_share``). Which rows a step corrupts depends on ``--seed`` and the step only, so a step that runs
again after a resume corrupts the same rows. The child appends the rows it corrupted per generation call
(``injected.jsonl``) and, after every step, the resident memory of the training process and its descendants
(``VmRSS`` from ``/proc``, KiB) to ``progress.jsonl``. When the child reports a step ≥ a ``--kills`` step, the parent
sends it SIGKILL (the kill lands in a later step, wherever it is) and starts it again with
``trainer.train(resume_from_checkpoint=True)``, which resumes from the last checkpoint. At step ``--steps`` more than
``max_quarantine_share`` of the rows are corrupted (``--final-burst-rows``): the breaker must end the run there,
``trainer.train()`` raising ``CircuitBreakerTripped`` (``max_steps`` is ``--steps`` + 10, so a normal end is visible).

Checks (printed, and written as JSON with ``--out``; exit code 1 when one fails):

* records: the corrupted rollouts of the steps that count (a step that ran again after a resume counts in its last
  run only), identified by (step, global_row), against the quarantine store (``rollout_guard.outputs.store.read_records``):
  expected, found, lost (not in the store), duplicated (in the store more than once), quarantined rows that were
  not corrupted, and records whose ``injected`` flag disagrees;
* metrics: ``metrics.jsonl`` has one line per step, 1 to the last;
* memory: least-squares slope of RSS over steps (KiB per 1,000 steps), one line per process run with its own
  intercept (a common slope), the first ``--warmup`` steps of each run left out; also relative to the mean RSS;
* guard time: the guard's share of the step per bin of ``--bin-steps`` steps (the median over the bin of
  ``guard_seconds`` from ``metrics.jsonl`` over the step's wall time, the time between the step's and the previous
  step's lines in ``progress.jsonl``), and the least-squares slope of that share over the bins, per 1,000 steps and
  relative to its mean: machine load slows the guard and the rest of the step alike, so the share moves only when
  the guard's own cost does. Also reported, not judged: the least-squares slope of ``guard_seconds`` itself per
  1,000 steps and relative to its mean. The share leaves out the first ``--warmup`` steps of each process run, the
  slope of ``guard_seconds`` the run's first ``--warmup`` steps;
* breaker: the last child's exit code, the exception's class and message, the step it ended at, and how many
  times its reason was logged.

A slope counts as flat when its size per 1,000 steps is at most ``--max-rss-slope`` (default 0.05) of the mean RSS,
or ``--max-guard-slope`` (default 0.25) of the guard's mean share.

``--no-guard`` trains the same way without the guard (the faults still injected): only the kills and the memory are
checked, for comparing the resident memory with and without the guard. ``--memory-probes`` (steps) runs
tracemalloc in the child from the start of training and appends, at each of those steps, the resident memory
before and after ``malloc_trim``, the traced Python memory and, from the second probe on, the allocation sites and
object types that grew since the first probe, to ``memory.jsonl`` in the run's folder (:class:`MemoryProbe`;
tracemalloc slows the run severalfold, so its step times are not the guard's).

    python benchmarks/soak.py --out benchmarks/results/soak/cpu.json.gz

Options: ``--steps`` step at which the over-ceiling burst ends the run (default 3000); ``--batch`` rollouts per
step (default 8); ``--group`` GRPO group size (default 4); ``--rate`` share of rollouts corrupted outside bursts
(default 0.001); ``--bursts`` steps with ``--burst-rows`` corrupted rows (default 150,1020,2130 and 3);
``--kills`` steps after which the child is killed (default 1030,2140); ``--save-steps`` checkpoint interval
(default 50); ``--warmup`` steps left out of each slope (default 50); ``--bin-steps`` steps per bin of the
guard's share (default 250); ``--output-dir`` the run's folder (default runs/soak, cleared first); ``--out`` the JSON
result (``.gz``: gzipped).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TAIL_STEPS = 10  # max_steps is --steps + this: the breaker, not the schedule, must end the run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000, help="step of the over-ceiling burst (default 3000)")
    parser.add_argument("--batch", type=int, default=8, help="rollouts per step (default 8)")
    parser.add_argument("--group", type=int, default=4, help="rollouts per prompt, GRPO group size (default 4)")
    parser.add_argument("--rate", type=float, default=0.001, help="share of rollouts corrupted (default 0.001)")
    parser.add_argument("--bursts", default="150,1020,2130", help="steps with --burst-rows corrupted rows")
    parser.add_argument("--burst-rows", type=int, default=3, help="corrupted rows of a burst step (default 3)")
    parser.add_argument("--final-burst-rows", type=int, default=None,
                        help="corrupted rows at --steps (default: 3/4 of the batch, rounded up)")
    parser.add_argument("--kills", default="1030,2140", help="steps after which the child gets SIGKILL")
    parser.add_argument("--save-steps", type=int, default=50, help="checkpoint every this many steps (default 50)")
    parser.add_argument("--warmup", type=int, default=50, help="steps of each process run left out of slopes")
    parser.add_argument("--max-rss-slope", type=float, default=0.05,
                        help="largest RSS slope per 1,000 steps relative to the mean RSS that counts as flat")
    parser.add_argument("--max-guard-slope", type=float, default=0.25,
                        help="largest slope per 1,000 steps of the guard's share of the step (per bin) relative to "
                             "its mean that counts as flat")
    parser.add_argument("--bin-steps", type=int, default=250,
                        help="steps per bin of the guard's share of the step (default 250)")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=REPO / "runs" / "soak")
    parser.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("ROLLOUT_GUARD_CACHE", REPO / ".cache")))
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here (.gz: gzipped)")
    parser.add_argument("--no-guard", action="store_true",
                        help="train without the guard (same model, schedule and faults): only the memory checks run")
    parser.add_argument("--memory-probes", default="",
                        help="steps at which the child probes its memory (tracemalloc from the start of training; "
                             "memory.jsonl)")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)  # the attempt number
    args = parser.parse_args(argv)
    args.bursts = [int(step) for step in args.bursts.split(",") if step]
    args.kills = [int(step) for step in args.kills.split(",") if step]
    args.memory_probes = [int(step) for step in args.memory_probes.split(",") if step]
    if args.final_burst_rows is None:
        args.final_burst_rows = -(-3 * args.batch // 4)
    return args


def _steps_arg(steps: list[int]) -> str:
    return ",".join(map(str, steps))


# -- the schedule of corrupted rows ----------------------------------------------------------------------------------

def corrupted_rows(args: argparse.Namespace, step: int, rows: int) -> list[int]:
    """The rows that ``step`` corrupts: a function of (seed, step) only, so a step run again corrupts the same."""
    rng = random.Random(args.seed * 1_000_003 + step)
    if step == args.steps:
        return sorted(rng.sample(range(rows), min(args.final_burst_rows, rows)))
    if step in args.bursts:
        return sorted(rng.sample(range(rows), min(args.burst_rows, rows)))
    return [row for row in range(rows) if rng.random() < args.rate]


# -- the child: one training process -------------------------------------------------------------------------------

def _rss_kib(pid: int | str = "self") -> int:
    """Resident memory of a process and its descendants, KiB (``VmRSS`` in ``/proc/<pid>/status``)."""
    total = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                total += _rss_kib(child)
    except (FileNotFoundError, ProcessLookupError):
        pass
    return total


class MemoryProbe:
    """Where the child's memory goes, for ``--memory-probes``: tracemalloc runs from :meth:`start` (at the start of
    training; ``frames`` frames per allocation); each :meth:`probe` appends one line to ``path``: the step, the
    resident memory (KiB) before and after ``malloc_trim(0)`` (glibc giving freed heap back to the system), the
    Python memory tracemalloc traces (KiB) and its peak since the previous probe, the count of live gc-tracked
    objects, and from the second probe on the growth since the first probe: the ``top`` allocation sites (file:line
    of the allocating frame) and allocation tracebacks by traced KiB gained, and the object types by count gained."""

    def __init__(self, path: Path, frames: int = 8, top: int = 25) -> None:
        self.path, self.frames, self.top = path, frames, top
        self.first: tuple | None = None

    def start(self) -> None:
        import tracemalloc

        if not tracemalloc.is_tracing():
            tracemalloc.start(self.frames)

    def probe(self, step: int) -> None:
        import ctypes
        import gc
        import tracemalloc

        gc.collect()
        rss_before = _rss_kib()
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__)])
        traced, peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        types = Counter(type(item).__qualname__ for item in gc.get_objects())
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
        line = {"step": step, "rss_kib": rss_before, "rss_after_trim_kib": _rss_kib(), "traced_kib": traced // 1024,
                "traced_peak_kib": peak // 1024, "gc_objects": sum(types.values())}
        if self.first is None:
            self.first = (snapshot, types)
        else:
            first, first_types = self.first
            line["top_sites"] = [
                {"site": f"{stat.traceback[0].filename}:{stat.traceback[0].lineno}",
                 "kib_gained": round(stat.size_diff / 1024, 1), "kib": round(stat.size / 1024, 1),
                 "blocks_gained": stat.count_diff}
                for stat in snapshot.compare_to(first, "lineno")[:self.top]]
            line["top_tracebacks"] = [
                {"kib_gained": round(stat.size_diff / 1024, 1), "blocks_gained": stat.count_diff,
                 "traceback": [f"{frame.filename}:{frame.lineno}" for frame in stat.traceback]}
                for stat in snapshot.compare_to(first, "traceback")[:8]]
            line["types_gained"] = (types - first_types).most_common(self.top)
        with self.path.open("a") as handle:
            handle.write(json.dumps(line) + "\n")


def child(args: argparse.Namespace) -> None:
    probe = MemoryProbe(args.output_dir / "memory.jsonl") if args.memory_probes else None
    os.environ.setdefault("VLLM_CACHE_ROOT", str(args.cache_dir / "vllm"))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rollout_guard import GuardConfig
    from rollout_guard.errors import CircuitBreakerTripped
    from rollout_guard.injection import plan_injection
    from rollout_guard.testing.tiny_model import (TinyModelRecipe, build_tiny_model, copy_prompt, copy_reward,
                                                       random_letters)
    from rollout_guard.integrations.trl import attach_guard
    from rollout_guard.integrations.trl.fault_injection import StaleContextInjector
    from rollout_guard.integrations.vllm_cpu import enable_trl_colocate_on_vllm_cpu

    attempt = args.child
    out = args.output_dir
    recipe = TinyModelRecipe()
    model_dir = build_tiny_model(args.cache_dir / "models", recipe)
    rng = random.Random(args.seed)
    prompts = [copy_prompt(random_letters(rng, recipe))
               for _ in range((args.steps + TAIL_STEPS) * args.batch // args.group + args.group)]
    dataset = Dataset.from_list([{"prompt": prompt} for prompt in prompts])

    def copy_accuracy(prompts, completions, **_):  # noqa: ANN001
        return [copy_reward(prompt, completion) for prompt, completion in zip(prompts, completions, strict=True)]

    enable_trl_colocate_on_vllm_cpu()
    training = GRPOConfig(
        output_dir=str(out / "trainer"), max_steps=args.steps + TAIL_STEPS, per_device_train_batch_size=args.batch,
        num_generations=args.group, max_completion_length=12, learning_rate=args.learning_rate, use_vllm=True,
        vllm_mode="colocate", vllm_max_model_length=64, bf16=False, use_cpu=True, logging_steps=100,
        save_strategy="steps", save_steps=args.save_steps, save_total_limit=3, report_to="none", seed=args.seed,
        disable_tqdm=True, log_completions=False,
    )
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=copy_accuracy, args=training, train_dataset=dataset)
    if not args.no_guard:
        attach_guard(trainer, GuardConfig(mode="quarantine", output_dir=str(out / "rollout_guard")))

    truth = (out / "injected.jsonl").open("a")
    progress = (out / "progress.jsonl").open("a")

    class ScheduledInjector(StaleContextInjector):
        """The stale-context fault on the rows :func:`corrupted_rows` names for the step being generated."""

        def _generate(self, prompts, images=None, num_generations=1, profiler=None):  # noqa: ANN001
            step = self.trainer.state.global_step + 1
            selected = torch.zeros(len(prompts), dtype=torch.bool)
            selected[corrupted_rows(args, step, len(prompts))] = True
            plan = plan_injection(prompts, selected, group_size=num_generations, pool=self.pool)
            self.last_selected = plan.selected
            self.total_injected += int(plan.selected.sum())
            truth.write(json.dumps({"attempt": attempt, "step": step, "rows": len(prompts),
                                    "injected": plan.selected.nonzero().flatten().tolist()}) + "\n")
            truth.flush()
            prompt_ids, completion_ids, logprobs, logprob_token_ids = self._original_generate(
                prompts=plan.contexts, images=images, num_generations=1, profiler=profiler)
            return [list(p) for p in prompts], completion_ids, logprobs, logprob_token_ids

    ScheduledInjector(trainer, rate=0.0, seed=args.seed)

    def report(**fields) -> None:  # noqa: ANN003
        progress.write(json.dumps({"attempt": attempt, "time": time.time(), **fields}) + "\n")
        progress.flush()

    class Progress(TrainerCallback):
        def on_train_begin(self, a, state, control, **kwargs):  # noqa: ANN001
            report(event="begin", step=state.global_step, rss_kib=_rss_kib())
            if probe is not None:
                probe.start()

        def on_step_end(self, a, state, control, **kwargs):  # noqa: ANN001
            report(event="step", step=state.global_step, rss_kib=_rss_kib())
            if probe is not None and state.global_step in args.memory_probes:
                probe.probe(state.global_step)

    trainer.add_callback(Progress())
    ended: dict = {"attempt": attempt}
    try:
        trainer.train(resume_from_checkpoint=attempt > 0)
        ended.update(exception=None, step=trainer.state.global_step)
    except CircuitBreakerTripped as error:
        ended.update(exception=type(error).__name__, message=str(error), step=trainer.state.global_step)
        raise
    finally:
        (out / f"ended-{attempt}.json").write_text(json.dumps(ended))


# -- the parent: runs, kills, resumes, checks ------------------------------------------------------------------------

def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line torn by the kill
            pass
    return rows


def _last_step(path: Path, attempt: int) -> int:
    steps = [row["step"] for row in _read_jsonl(path) if row["attempt"] == attempt and row["event"] == "step"]
    return max(steps, default=-1)


class _StepWatch:
    """The last step an attempt reported in ``progress.jsonl``, reading only what was appended since the last call."""

    def __init__(self, path: Path, attempt: int) -> None:
        self.path, self.attempt, self.offset, self.step, self.partial = path, attempt, 0, -1, b""

    def last_step(self) -> int:
        if self.path.is_file():
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
            self.offset += len(chunk)
            lines = (self.partial + chunk).split(b"\n")
            self.partial = lines.pop()
            for line in lines:
                row = json.loads(line)
                if row["attempt"] == self.attempt and row["event"] == "step":
                    self.step = max(self.step, row["step"])
        return self.step


def run_child(args: argparse.Namespace, attempt: int, kill_after: int | None, argv: list[str]) -> dict:
    """Run one training process; SIGKILL it once it reports a step ≥ ``kill_after``. Its outcome."""
    log = args.output_dir / f"child-{attempt}.log"
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", str(attempt)]
    started = time.perf_counter()
    with log.open("w") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO)
        killed_at = None
        watch = _StepWatch(args.output_dir / "progress.jsonl", attempt)
        while process.poll() is None:
            if kill_after is not None and watch.last_step() >= kill_after:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()
                killed_at = watch.last_step()
                break
            time.sleep(0.1)
    text = log.read_text()
    outcome = {"attempt": attempt, "exit_code": process.returncode, "killed": killed_at is not None,
               "last_step_reported": _last_step(args.output_dir / "progress.jsonl", attempt),
               "seconds": round(time.perf_counter() - started, 1)}
    begins = [row["step"] for row in _read_jsonl(args.output_dir / "progress.jsonl")
              if row["attempt"] == attempt and row["event"] == "begin"]
    outcome["resumed_from_step"] = begins[0] if begins else None
    ended = args.output_dir / f"ended-{attempt}.json"
    if ended.is_file():
        outcome["ended"] = json.loads(ended.read_text())
    reason = outcome.get("ended", {}).get("message") or None
    # lines that give the breaker's reason (the exception's first words): it must be said once
    outcome["reason_lines"] = sum(reason[:60] in line for line in text.splitlines()) if reason else 0
    outcome["log_tail"] = text.splitlines()[-3:]
    return outcome


def slope(points: list[tuple[float, float, int]]) -> tuple[float, float]:
    """Least-squares slope of y over x with one intercept per group (points: x, y, group); and the mean of y."""
    groups: dict[int, list[tuple[float, float]]] = {}
    for x, y, group in points:
        groups.setdefault(group, []).append((x, y))
    sxy = sxx = 0.0
    for members in groups.values():
        mx = sum(x for x, _ in members) / len(members)
        my = sum(y for _, y in members) / len(members)
        sxy += sum((x - mx) * (y - my) for x, y in members)
        sxx += sum((x - mx) ** 2 for x, _ in members)
    mean = sum(y for _, y, _ in points) / len(points)
    return (sxy / sxx if sxx else float("nan")), mean


def step_seconds(progress: list[dict], first_step: dict[int, int], warmup: int) -> dict[int, float]:
    """Wall time of each step (s) from ``progress.jsonl``'s step rows: the time since the same process run's
    previous step row; a step run again after a resume counts in its last run; each run's first ``warmup`` steps
    after the step it resumed from are left out.

    >>> rows = [{"attempt": 0, "event": "step", "step": s, "time": 10.0 + 0.5 * s} for s in range(1, 5)]
    >>> rows += [{"attempt": 1, "event": "step", "step": s, "time": 100.0 + s} for s in range(3, 6)]
    >>> step_seconds(rows, {0: 0, 1: 2}, warmup=1)
    {2: 0.5, 4: 1.0, 5: 1.0}
    """
    last: dict[int, tuple[int, float]] = {}
    seconds: dict[int, float] = {}
    for row in sorted((r for r in progress if r["event"] == "step"), key=lambda r: (r["attempt"], r["time"])):
        attempt, step = row["attempt"], row["step"]
        previous = last.get(attempt)
        last[attempt] = (step, row["time"])
        if step > first_step[attempt] + warmup and previous is not None and previous[0] == step - 1:
            seconds[step] = row["time"] - previous[1]
        else:
            seconds.pop(step, None)  # run again: the earlier run's time no longer counts
    return dict(sorted(seconds.items()))


def guard_share_bins(guard_seconds: dict[int, float], seconds: dict[int, float], bin_steps: int) -> list[dict]:
    """The guard's share of the step per bin of ``bin_steps`` steps: the median over the bin's steps of
    ``guard_seconds / step seconds`` (steps with both values), with the bin's median guard and step times (ms).
    Machine load slows the guard and the rest of the step alike, so a share that stays level says the guard's
    cost does not grow with the step count, where an absolute time may follow the load.

    >>> guard = {step: 0.005 * (2 if step > 4 else 1) for step in range(1, 9)}
    >>> step = {step: 0.1 * (2 if step > 4 else 1) for step in range(1, 9)}
    >>> [(b["steps"], b["share"], b["guard_ms"], b["step_ms"]) for b in guard_share_bins(guard, step, 4)]
    [([1, 4], 0.05, 5.0, 100.0), ([5, 8], 0.05, 10.0, 200.0)]
    """
    from statistics import median

    bins: dict[int, list[int]] = {}
    for step in sorted(set(guard_seconds) & set(seconds)):
        if seconds[step] > 0:
            bins.setdefault((step - 1) // bin_steps, []).append(step)
    return [{"steps": [index * bin_steps + 1, (index + 1) * bin_steps], "n": len(steps),
             "share": round(median(guard_seconds[s] / seconds[s] for s in steps), 4),
             "guard_ms": round(1000 * median(guard_seconds[s] for s in steps), 2),
             "step_ms": round(1000 * median(seconds[s] for s in steps), 1)}
            for index, steps in sorted(bins.items())]


def guard_share(guard_seconds: dict[int, float], seconds: dict[int, float], bin_steps: int) -> dict:
    """The guard's share of the step over the run: the bins (:func:`guard_share_bins`), the mean of their shares,
    and the least-squares slope of the share over the bins' middle steps, per 1,000 steps and relative to the mean
    (NaN with fewer than two bins).

    >>> guard = {step: 0.001 * (1 + step / 1000) for step in range(1, 2001)}  # grows while the step time does not
    >>> guard_share(guard, dict.fromkeys(guard, 0.05), 500)["slope_relative_per_1000_steps"]
    0.5
    >>> load = {step: 0.05 * (1 + step / 1000) for step in guard}  # the whole step slows down alike: load
    >>> guard_share(guard, load, 500)["slope_relative_per_1000_steps"]
    0.0
    """
    bins = guard_share_bins(guard_seconds, seconds, bin_steps)
    share_slope, share_mean = (slope([(sum(b["steps"]) / 2, b["share"], 0) for b in bins]) if len(bins) > 1
                               else (float("nan"), float("nan")))
    return {"bins": bins, "mean": round(share_mean, 4), "slope_per_1000_steps": round(1000 * share_slope, 5),
            "slope_relative_per_1000_steps": round(1000 * share_slope / share_mean, 4)}


def check(args: argparse.Namespace, runs: list[dict]) -> dict:
    """The run's checks (module docstring) from its folder; ``failures`` names those that failed."""
    out = args.output_dir
    progress = [row for row in _read_jsonl(out / "progress.jsonl") if row["event"] == "step"]
    first_step = {run["attempt"]: run["resumed_from_step"] or 0 for run in runs}
    rss_points = [(float(row["step"]), float(row["rss_kib"]), row["attempt"]) for row in progress
                  if row["step"] > first_step[row["attempt"]] + args.warmup]
    rss_slope, rss_mean = slope(rss_points)
    per_run_rss = {}
    for attempt in first_step:
        points = [p for p in rss_points if p[2] == attempt]
        if len(points) > 2:
            s, m = slope(points)
            per_run_rss[attempt] = {"steps": [int(points[0][0]), int(points[-1][0])],
                                    "slope_kib_per_1000_steps": round(1000 * s, 1), "mean_mib": round(m / 1024, 1),
                                    "first_mib": round(points[0][1] / 1024, 1),
                                    "last_mib": round(points[-1][1] / 1024, 1)}
    rss = {"slope_kib_per_1000_steps": round(1000 * rss_slope, 1), "mean_mib": round(rss_mean / 1024, 1),
           "slope_relative_per_1000_steps": round(1000 * rss_slope / rss_mean, 5), "per_process_run": per_run_rss,
           "samples": len(rss_points)}
    kills = [{"after_step": run["last_step_reported"], "next_resumed_from": nxt["resumed_from_step"]}
             for run, nxt in zip(runs, runs[1:], strict=False) if run["killed"]]
    failures = []
    if len(kills) != len(args.kills):
        failures.append("kills")
    if not abs(1000 * rss_slope / rss_mean) <= args.max_rss_slope:
        failures.append("RSS not flat")
    if args.no_guard:
        result = {"guard": False, "steps": max((row["step"] for row in progress), default=0),
                  "rollouts_per_step": args.batch, "kills": kills, "rss": rss, "failures": failures}
        return result

    from rollout_guard.outputs.store import read_records

    # the steps that count: an attempt's steps up to the checkpoint the next attempts resumed from
    truth = _read_jsonl(out / "injected.jsonl")
    kept: dict[int, dict] = {}
    for row in truth:
        later = [begin for attempt, begin in first_step.items() if attempt > row["attempt"]]
        if all(row["step"] <= begin for begin in later):
            kept[row["step"]] = row
    rerun_steps = [row for row in truth if kept.get(row["step"]) is not row]
    rerun_same = sum(row["injected"] == kept[row["step"]]["injected"] for row in rerun_steps if row["step"] in kept)
    expected = {(step, index) for step, row in kept.items() for index in row["injected"]}

    problems: list[str] = []
    records = list(read_records(out / "rollout_guard" / "quarantine", problems))
    counts = Counter((record.step, record.global_row) for record in records)
    found = expected & set(counts)
    duplicates = sorted(key for key, count in counts.items() if count > 1)
    not_corrupted = sorted(set(counts) - expected)
    flag_mismatch = [(r.step, r.global_row) for r in records
                     if bool(r.injected) != ((r.step, r.global_row) in expected)]
    last_step = max(kept, default=0)

    metrics = _read_jsonl(out / "rollout_guard" / "metrics.jsonl")
    metric_steps = Counter(int(row["step"]) for row in metrics)
    missing_lines = [step for step in range(1, last_step + 1) if metric_steps[step] == 0]
    repeated_lines = sorted(step for step, count in metric_steps.items() if count > 1)
    guard_points = [(float(row["step"]), float(row["guard_seconds"]), 0) for row in metrics
                    if row.get("guard_seconds") is not None and int(row["step"]) > args.warmup]
    guard_slope, guard_mean = slope(guard_points)
    share = guard_share({int(step): value for step, value, _ in guard_points},
                        step_seconds(progress, first_step, args.warmup), args.bin_steps)

    final = runs[-1]
    ended = final.get("ended", {})
    breaker = {
        "exit_code": final["exit_code"], "exception": ended.get("exception"), "message": ended.get("message"),
        "step": ended.get("step"), "max_steps": args.steps + TAIL_STEPS,
        "reason_lines_in_log": final["reason_lines"],
    }
    result = {
        "guard": True,
        "steps": last_step,
        "optimizer_steps_run": len(truth),
        "rollouts_per_step": args.batch,
        "kills": kills,
        "records": {"expected": len(expected), "found": len(found), "lost": sorted(expected - set(counts)),
                    "duplicated": duplicates, "quarantined_not_corrupted": len(not_corrupted),
                    "injected_flag_mismatch": flag_mismatch, "records_in_store": len(records),
                    "unreadable_lines": problems},
        "reruns": {"steps_run_again": len(rerun_steps), "same_rows_corrupted": rerun_same},
        "metrics_lines": {"missing_steps": missing_lines, "repeated_steps": repeated_lines},
        "rss": rss,
        "guard_seconds": {"slope_per_1000_steps": round(1000 * guard_slope, 6), "mean": round(guard_mean, 5),
                          "slope_relative_per_1000_steps": round(1000 * guard_slope / guard_mean, 4),
                          "samples": len(guard_points)},
        "guard_share": share,
        "breaker": breaker,
    }
    if expected - set(counts):
        failures.append("lost records")
    if duplicates:
        failures.append("duplicated records")
    if flag_mismatch:
        failures.append("injected flags disagree")
    if missing_lines or repeated_lines:
        failures.append("metrics.jsonl not one line per step")
    if not (final["exit_code"] != 0 and ended.get("exception") == "CircuitBreakerTripped"
            and ended.get("step") == args.steps):
        failures.append("breaker did not end the run at the burst")
    if final["reason_lines"] != 1:
        failures.append("the breaker's reason not said once")
    if not abs(share["slope_relative_per_1000_steps"]) <= args.max_guard_slope:
        failures.append("guard's share of the step not flat")
    result["failures"] = failures
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child is not None:
        child(args)
        return 0
    if args.output_dir.exists():
        shutil.rmtree(args.output_dir)
    args.output_dir.mkdir(parents=True)
    child_argv = [item for item in argv]  # the children get the same options
    started = time.perf_counter()
    runs = []
    for attempt, kill_after in enumerate([*args.kills, None]):
        runs.append(run_child(args, attempt, kill_after, child_argv))
        print(json.dumps({key: value for key, value in runs[-1].items() if key != "log_tail"}), flush=True)
        if not runs[-1]["killed"] and attempt < len(args.kills):
            print("\n".join(runs[-1]["log_tail"]), file=sys.stderr)
            break
    result = check(args, runs)
    result["wall_seconds"] = round(time.perf_counter() - started, 1)
    result["runs"] = [{key: value for key, value in run.items() if key != "log_tail"} for run in runs]
    result["settings"] = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()
                          if key not in ("child", "out", "output_dir", "cache_dir")}
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(result, indent=2) + "\n"
        if args.out.suffix == ".gz":
            with args.out.open("wb") as raw, gzip.GzipFile("", "wb", compresslevel=9, fileobj=raw, mtime=0) as handle:
                handle.write(text.encode())  # as gzip -9n: no name, no time
        else:
            args.out.write_text(text)
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
