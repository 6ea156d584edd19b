"""The background writer: the sinks' work (store writes and fsync, metrics lines, chart redraws, tracker logging)
runs on one thread of its own, off the training thread, in the order it was submitted.

* Bounded: at most ``max_pending`` tasks wait; :meth:`BackgroundWriter.submit` then blocks until one is done. It
  never drops a task, so a record handed to the writer is written (or its failure reported), never lost silently.
* Flushed: :meth:`BackgroundWriter.flush` returns once every task submitted before it has run (the adapter calls it
  before saving a checkpoint's guard state and at the end of training); :meth:`BackgroundWriter.close` flushes and
  stops the thread.
* Errors surface: a task that raises does not stop the writer (the next tasks run, as each sink call stood alone
  when the sinks ran inline); the error is kept, with what failed, until the training thread collects it with
  :meth:`BackgroundWriter.take_errors` (the adapter does at the next step and after each flush) and reports it as
  any other guard failure.
"""

from __future__ import annotations

import contextvars
import copy
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from rollout_guard.guard import RolloutGuard

DEFAULT_MAX_PENDING = 8
"""tasks. The adapter submits two per step with suspect samples (records, then the step), one otherwise, so 8 lets
the writer fall ~4 steps behind before training waits; each waiting step holds at most
``evidence_samples_per_step`` full records (~1 MB each at 16k tokens)."""

_STOP = object()


class BackgroundWriter:
    """Runs submitted callables on one daemon thread, in order. ``max_pending``: tasks that may wait (≥ 1).

    What is still queued when the interpreter exits without :meth:`close` (training died of an exception) is run
    then: the thread is stopped and drained by a ``weakref.finalize`` hook, which also runs when the writer is
    garbage collected."""

    def __init__(self, max_pending: int = DEFAULT_MAX_PENDING, name: str = "rollout_guard-writer") -> None:
        if not (isinstance(max_pending, int) and not isinstance(max_pending, bool) and max_pending >= 1):
            raise ValueError(f"max_pending={max_pending!r}: use a whole number of tasks ≥ 1")
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._errors: list[tuple[str, BaseException]] = []
        self._lock = threading.Lock()
        # the thread's function holds no reference to self, so that the finalizer can run when self is collected
        self._thread = threading.Thread(target=_work, args=(self._queue, self._errors, self._lock), name=name,
                                        daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop, self._queue, self._thread)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def submit(self, what: str, function: Callable[..., Any], *args: Any) -> None:
        """Queue ``function(*args)``; blocks while ``max_pending`` tasks wait (never drops one). ``what`` names
        the task in errors. The task runs in a copy of the caller's ``contextvars`` context, so that what the
        training thread sees there (e.g. trackio's current run) the task sees too."""
        if self.closed:
            raise RuntimeError("the background writer is closed")
        self._queue.put((what, function, args, contextvars.copy_context()))

    def flush(self) -> None:
        """Wait until every task submitted so far has run (successfully or not)."""
        if not self.closed:
            self._queue.join()

    def take_errors(self) -> list[tuple[str, BaseException]]:
        """The failures since the last call, oldest first, as (what failed, the exception)."""
        with self._lock:
            errors = list(self._errors)
            self._errors.clear()
        return errors

    def close(self) -> None:
        """Run everything still queued, then stop the thread. Idempotent."""
        self._finalizer()


def _work(tasks: queue.Queue, errors: list, lock: threading.Lock) -> None:
    while True:
        what, function, args, context = tasks.get()
        try:
            if function is _STOP:
                return
            context.run(function, *args)
        except BaseException as error:  # noqa: BLE001 - kept for the training thread to report
            with lock:
                errors.append((what, error))
        finally:
            tasks.task_done()


def _stop(tasks: queue.Queue, thread: threading.Thread) -> None:
    tasks.put((None, _STOP, (), None))
    thread.join()


def guard_snapshot(guard: RolloutGuard) -> RolloutGuard:
    """A view of ``guard`` for sinks that run on the writer thread: a shallow copy whose totals (counters, rule
    counts, the history list) are copied as they stand now, so that a chart or summary drawn later shows this
    step, while the training thread goes on updating the guard. Costs a list copy of the history (one pointer
    per row, at most ``HISTORY_ROWS``: flat over the run)."""
    view = copy.copy(guard)
    totals = copy.copy(guard.totals)
    totals.history = list(guard.totals.history)
    totals.rule_counts = dict(guard.totals.rule_counts)
    totals.outcomes = dict(guard.totals.outcomes)
    view.totals = totals
    return view
