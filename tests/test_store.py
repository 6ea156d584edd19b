import json

import pytest

from rollout_guard.outputs.records import QuarantineRecord
from rollout_guard.outputs.store import QuarantineStore, read_records, store_files


def record(step: int, row: int = 0) -> QuarantineRecord:
    return QuarantineRecord(
        step=step, process_index=0, row=row, global_row=row, group_size=4, action="quarantined", rules=["score"],
        stats={"max_abs_delta": 12.5, "kl_k3": float("nan")}, prompt_ids=[1, 2], completion_ids=[3, 4],
        prompt_text="ab=", completion_text="xy", completion_tokens=["x", "y"], engine_logprobs=[-0.1, float("nan")], trainer_logprobs=[-9.0, -8.0],
        reward=0.25, rewards_per_func={"copy": 0.25}, advantage_before=-1.0, advantage_after=0.0,
        sampling={"temperature": 1.0}, model="tiny", engine={"name": "vllm"}, injected=True, created_unix=1.0,
    )


def test_round_trip_keeps_every_field_and_maps_nan_to_null(tmp_path):
    store = QuarantineStore(tmp_path)
    assert store.append([record(1), record(1, row=3)]) == 2
    assert store.append([record(2)]) == 1
    store.close()
    back = list(read_records(tmp_path))
    assert [(r.step, r.row) for r in back] == [(1, 0), (1, 3), (2, 0)]
    assert back[0].engine_logprobs == [-0.1, None] and back[0].stats["kl_k3"] is None
    assert back[0].prompt_text == "ab=" and back[0].injected is True
    raw = (tmp_path / "quarantine-00000.jsonl").read_text().splitlines()
    assert all(json.loads(line)["schema_version"] == 1 for line in raw)


def test_reader_skips_a_torn_last_line_and_writer_cuts_it(tmp_path):
    store = QuarantineStore(tmp_path)
    store.append([record(1)])
    store.close()
    path = tmp_path / "quarantine-00000.jsonl"
    with path.open("ab") as handle:
        handle.write(b'{"step": 2, "process_in')  # a writer killed mid-line
    with pytest.warns(UserWarning, match="torn last line"):
        assert [r.step for r in read_records(tmp_path)] == [1]
    reopened = QuarantineStore(tmp_path)
    assert reopened.torn_bytes_cut == len(b'{"step": 2, "process_in')
    reopened.append([record(3)])
    reopened.close()
    assert [r.step for r in read_records(tmp_path)] == [1, 3]


def test_corrupt_middle_lines_are_skipped_counted_and_located(tmp_path):
    path = tmp_path / "quarantine-00000.jsonl"
    good = json.dumps(record(1).to_json_dict())
    path.write_bytes((good + "\nnot json\n" + good + "\n\xff\xfe{\n" + json.dumps({"step": 3}) + "\n" + good + "\n").encode("latin-1"))
    problems: list[str] = []
    assert [r.step for r in read_records(tmp_path, problems)] == [1, 1, 1]
    assert [p.split(": ")[0] for p in problems] == [f"{path}:2", f"{path}:4", f"{path}:5"]
    assert "lacks" in problems[2]  # a JSON object that is not a record
    with pytest.warns(UserWarning, match=r"skipped 3 unreadable line\(s\) \(line 2, 4, 5\)"):
        assert len(list(read_records(path))) == 3  # one file given directly


def test_a_clean_store_reports_no_problem(tmp_path):
    store = QuarantineStore(tmp_path)
    store.append([record(1)])
    store.close()
    problems: list[str] = []
    assert len(list(read_records(tmp_path, problems))) == 1 and problems == []


def test_rotation_starts_a_new_file_past_the_size_cap(tmp_path):
    store = QuarantineStore(tmp_path, max_file_bytes=1)
    for step in range(3):
        store.append([record(step)])
    store.close()
    assert [p.name for p in store_files(tmp_path)] == ["quarantine-00000.jsonl", "quarantine-00001.jsonl", "quarantine-00002.jsonl"]
    assert [r.step for r in read_records(tmp_path)] == [0, 1, 2]
    again = QuarantineStore(tmp_path, max_file_bytes=1)
    again.append([record(3)])
    again.close()
    assert again.path.name == "quarantine-00003.jsonl"
    assert [r.step for r in read_records(tmp_path)] == [0, 1, 2, 3]


def test_records_with_nan_anywhere_are_stored_as_null(tmp_path):
    """TRL turns a reward function's None into NaN; every float of a record, at any depth, must still store."""
    nan, inf = float("nan"), float("inf")
    odd = record(5)
    odd.reward, odd.rewards_per_func = nan, {"copy": nan, "length": 0.5}
    odd.advantage_before, odd.advantage_after = nan, -inf
    odd.sampling = {"temperature": 1.0, "top_p": inf}
    odd.extra = {"nested": [nan, 1.0, {"deep": -inf}], "pair": (nan, 2.0)}
    odd.stats = {"max_abs_delta": inf, "tokens": 3.0}
    store = QuarantineStore(tmp_path)
    assert store.append([odd, record(6)]) == 2
    store.close()
    back = list(read_records(tmp_path))
    assert [r.step for r in back] == [5, 6]
    assert back[0].reward is None and back[0].rewards_per_func == {"copy": None, "length": 0.5}
    assert back[0].advantage_before is None and back[0].advantage_after is None
    assert back[0].sampling["top_p"] is None and back[0].extra == {"nested": [None, 1.0, {"deep": None}], "pair": [None, 2.0]}
    assert back[0].stats == {"max_abs_delta": None, "tokens": 3.0}
    assert back[1].reward == 0.25 and back[1].rewards_per_func == {"copy": 0.25}  # finite values untouched
