"""The background writer: order, backpressure without drops, errors kept for the training
thread, close drains; and the worst-K choice of full evidence."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rollout_guard.selection import severity_rank, worst_suspects
from rollout_guard.statistics import COLUMN, SAMPLE_COLUMNS
from rollout_guard.verdict import RULE_BIT, RULES
from rollout_guard.outputs.writer import BackgroundWriter


def test_tasks_run_in_the_order_submitted():
    done: list[int] = []
    writer = BackgroundWriter(max_pending=3)
    for index in range(300):
        writer.submit("append", done.append, index)
    writer.flush()
    assert done == list(range(300))
    writer.close()


def test_a_full_queue_blocks_the_producer_and_drops_nothing():
    """max_pending=1, the borderline: one task runs (held), one waits, the third submit must block until the
    held one finishes; then all three run."""
    release, running = threading.Event(), threading.Event()
    done: list[str] = []

    def held():
        running.set()
        release.wait(10)
        done.append("held")

    writer = BackgroundWriter(max_pending=1)
    writer.submit("held", held)
    assert running.wait(5)
    writer.submit("second", done.append, "second")  # fills the one waiting place
    third_returned = threading.Event()

    def producer():
        writer.submit("third", done.append, "third")
        third_returned.set()

    thread = threading.Thread(target=producer)
    thread.start()
    assert not third_returned.wait(0.3), "submit returned while the queue was full: it must block"
    release.set()
    assert third_returned.wait(5)
    thread.join()
    writer.flush()
    assert done == ["held", "second", "third"]
    writer.close()


def test_an_error_is_kept_for_the_training_thread_and_later_tasks_still_run():
    done: list[int] = []

    def broken():
        raise OSError("disk full")

    writer = BackgroundWriter()
    writer.submit("LocalFilesSink.on_records", broken)
    writer.submit("append", done.append, 1)
    writer.flush()
    errors = writer.take_errors()
    assert [(what, type(error), str(error)) for what, error in errors] == [("LocalFilesSink.on_records", OSError, "disk full")]
    assert done == [1] and writer.take_errors() == []  # reported once
    writer.close()


def test_close_runs_everything_queued_then_refuses_more():
    done: list[int] = []

    def slow(index):
        time.sleep(0.02)
        done.append(index)

    writer = BackgroundWriter(max_pending=16)
    for index in range(10):
        writer.submit("slow", slow, index)
    writer.close()
    assert done == list(range(10))
    writer.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit("late", done.append, 99)


def test_a_writer_that_is_dropped_unclosed_still_drains():
    done: list[int] = []
    writer = BackgroundWriter()
    for index in range(5):
        writer.submit("slow", lambda i: (time.sleep(0.01), done.append(i)), index)
    thread = writer._thread
    del writer  # the finalizer stops the thread after the queued tasks
    thread.join(5)
    assert not thread.is_alive() and done == list(range(5))


def test_a_task_sees_the_context_variables_of_the_thread_that_submitted_it():
    """trackio keeps its current run in a ContextVar: the TrackioSink on the writer thread must see it."""
    import contextvars

    run = contextvars.ContextVar("run", default=None)
    seen: list = []
    writer = BackgroundWriter()
    run.set("the training run")
    writer.submit("read", lambda: seen.append(run.get()))
    writer.flush()
    writer.close()
    assert seen == ["the training run"]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_queue_size_is_checked(bad):
    with pytest.raises(ValueError, match="max_pending"):
        BackgroundWriter(max_pending=bad)


def _samples(score: list[float]) -> torch.Tensor:
    samples = torch.zeros(len(score), len(SAMPLE_COLUMNS), dtype=torch.float64)
    samples[:, COLUMN["score"]] = torch.tensor(score, dtype=torch.float64)
    return samples


def test_worst_suspects_order_severity_then_score_then_row():
    bit = RULE_BIT
    reasons = torch.tensor([bit["score"], bit["ceiling"] | bit["score"], 0, bit["nonfinite_trainer"], bit["score"],
                            bit["score"], bit["ceiling"]], dtype=torch.int32)
    samples = _samples([9.0, 30.0, 100.0, float("nan"), 12.0, 12.0, 5.0])
    assert severity_rank(reasons).tolist() == [RULES.index("score"), RULES.index("ceiling"), len(RULES),
                                               RULES.index("nonfinite_trainer"), 3, 3, RULES.index("ceiling")]
    # nonfinite first (a NaN score does not matter), then the ceiling by score, then the score, ties by row
    assert worst_suspects(samples, reasons, 10).tolist() == [3, 1, 6, 4, 5, 0]
    assert worst_suspects(samples, reasons, 3).tolist() == [3, 1, 6]
    assert worst_suspects(samples, reasons, 0).tolist() == []
    assert worst_suspects(samples, torch.zeros(7, dtype=torch.int32), 5).tolist() == []  # clean step


def test_worst_suspects_is_the_same_whatever_the_rows_order_of_arrival():
    generator = torch.Generator().manual_seed(0)
    reasons = (torch.randint(0, 1 << len(RULES), (500,), generator=generator) * (torch.rand(500, generator=generator) < 0.3)).int()
    samples = _samples((torch.rand(500, generator=generator) * 20).round().tolist())  # many ties in the score
    chosen = worst_suspects(samples, reasons, 40)
    rank, delta = severity_rank(reasons), samples[:, COLUMN["score"]]
    keys = sorted((int(rank[row]), -float(delta[row]), row) for row in torch.nonzero(reasons).flatten().tolist())
    assert chosen.tolist() == [row for _, _, row in keys[:40]]
