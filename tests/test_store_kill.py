"""A writer SIGKILLed mid-stream loses no acknowledged record and leaves no torn one behind."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import warnings

from rollout_guard.outputs.store import QuarantineStore, read_records, store_files

WRITER = r"""
import os, sys, time
from rollout_guard.outputs.records import QuarantineRecord

# A slow disk: every write() moves at most 4 KiB and takes 5 ms, as short writes on a slow disk may. The store must
# loop over short writes; writing then dominates the cycle and most kills land mid-record, which is what this test
# is about.
_write = os.write
os.write = lambda fd, data: (time.sleep(0.005), _write(fd, bytes(data[:4096])))[1]
from rollout_guard.outputs.store import QuarantineStore

directory, start = sys.argv[1], int(sys.argv[2])
store = QuarantineStore(directory, max_file_bytes=400_000)
print("torn", store.torn_bytes_cut, flush=True)
serial = start
while True:
    batch = []
    for _ in range(1 + serial % 4):
        batch.append(QuarantineRecord(
            step=serial, process_index=0, row=0, global_row=0, group_size=1, action="quarantined", rules=["score"],
            stats={"serial": serial}, prompt_ids=[1] * 200, completion_ids=[2] * 400, prompt_text="p" * 200,
            completion_text="c" * 400, completion_tokens=["c"] * 400, engine_logprobs=[-0.125] * 400,
            trainer_logprobs=[-9.5] * 400, reward=0.0, rewards_per_func={}, advantage_before=0.0, advantage_after=0.0,
            sampling={}, model="m", engine={}))
        serial += 1
    store.append(batch)
    print("ack", serial, flush=True)
"""


def test_sigkill_loses_no_acknowledged_record_and_leaves_no_torn_one(tmp_path):
    rng = random.Random(0)
    acknowledged = 0
    torn_cut_total = 0
    for _ in range(20):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(acknowledged)],
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        torn_cut_total += int(writer.stdout.readline().split()[1])
        target = acknowledged + rng.randint(2, 12)
        for line in writer.stdout:
            acknowledged = max(acknowledged, int(line.split()[1]))
            if acknowledged >= target:
                break
        time.sleep(rng.random() * 0.05)  # land the kill anywhere, mid-write included
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
        for line in writer.stdout.read().splitlines():  # acks printed between our last read and the kill
            acknowledged = max(acknowledged, int(line.split()[1]))
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            serials = [record.stats["serial"] for record in read_records(tmp_path)]
        assert serials == list(range(len(serials))), "records are complete, in order, without gaps or duplicates"
        assert len(serials) >= acknowledged, f"lost acknowledged records: {len(serials)} < {acknowledged}"
        acknowledged = len(serials)  # the next writer continues after what survived
    final = QuarantineStore(tmp_path)
    torn_cut_total += final.torn_bytes_cut
    final.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # after a writer reopened the store, nothing torn is left
        serials = [record.stats["serial"] for record in read_records(tmp_path)]
    assert serials == list(range(acknowledged))
    assert len(store_files(tmp_path)) > 1, "the size cap rotated files during the test"
    assert torn_cut_total > 0, "no kill landed mid-write: the test did not exercise a torn record"
    print(f"kill test: {acknowledged} records survived 20 SIGKILLs; torn bytes cut by reopening writers: {torn_cut_total}")
