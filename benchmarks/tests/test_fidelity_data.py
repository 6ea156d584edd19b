"""The fidelity rollout data: its generator's sampling filter and SSD scan, the table helpers, and the committed files."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "fidelity_data"
sys.path.insert(0, str(DATA))

import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
from load import load_rollouts, to_padded  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from rollout_schema import SCHEMA, PartWriter, round_mantissa, rows_to_table  # noqa: E402


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.9), (20, 1.0), (5, 0.8), (1, 1.0), (0, 0.999)])
def test_top_k_top_p_matches_vllm(top_k, top_p):
    vllm_ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    from make_h200_rollouts import top_k_top_p

    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(top_k)) * 3
    ours = top_k_top_p(logits.clone(), top_k, top_p)
    k = torch.full((64,), top_k) if top_k else None
    p = torch.full((64,), top_p) if top_p < 1 else None
    theirs = vllm_ops.apply_top_k_top_p_pytorch(logits.clone(), k, p)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert torch.isinf(ours).any()  # the filter did something
    assert torch.equal(ours[~torch.isinf(ours)], logits[~torch.isinf(ours)])


def test_top_k_top_p_off_is_identity():
    from make_h200_rollouts import top_k_top_p

    logits = torch.randn(4, 50)
    assert top_k_top_p(logits, 0, 1.0) is logits


def test_ssd_chunk_scan_matches_transformers():
    from make_h200_rollouts import patch_falcon_h1_scan
    from transformers.models.falcon_h1 import modeling_falcon_h1 as m

    original = m.mamba2_chunk_scan
    try:
        assert patch_falcon_h1_scan("cpu") < 1e-4
    finally:
        m.mamba2_chunk_scan = original


def _columns(lengths, fault="none"):
    n = len(lengths)
    return {"source": ["s"] * n, "condition": ["c"] * n, "model": ["m"] * n, "engine": ["e"] * n, "trainer": ["t"] * n,
            "temperature": [1.0] * n, "top_p": [1.0] * n, "top_k": [0] * n, "step": [0] * n, "group": list(range(n)),
            "prompt_len": [3] * n, "completion_ids": [list(range(k)) for k in lengths],
            "engine_logprobs": [[-0.5 - i for i in range(k)] for k in lengths],
            "trainer_logprobs": [[-0.25 - i for i in range(k)] for k in lengths],
            "engine_raw_logprobs": [[-0.5 - i for i in range(k)] for k in lengths], "truncated": [False] * n,
            "eos": [2] * n, "fault": [fault] * n, "fault_start": [-1] * n}


def test_rows_to_table_and_padding():
    table = rows_to_table(_columns([3, 1, 4]))
    assert table.schema == SCHEMA
    batch = to_padded(table.slice(1, 2))  # a slice: list offsets must be respected
    assert batch["mask"].tolist() == [[1, 0, 0, 0], [1, 1, 1, 1]]
    assert batch["engine"][1].tolist() == [-0.5, -1.5, -2.5, -3.5]
    assert batch["trainer"][0].tolist() == [-0.25, 0.0, 0.0, 0.0]


def test_rows_to_table_rejects_bad_rows():
    bad = _columns([2, 2])
    bad["trainer_logprobs"][1] = [-1.0]
    with pytest.raises(ValueError, match="trainer_logprobs"):
        rows_to_table(bad)
    with pytest.raises(ValueError, match="fault"):
        rows_to_table(_columns([1], fault="typo"))


def test_raw_logprobs_equal_to_the_engines_are_stored_as_null_and_read_back_exactly(tmp_path):
    columns = _columns([3, 2, 4])
    columns["engine_logprobs"][0] = [-0.5, -math.inf, math.nan]
    columns["engine_raw_logprobs"][0] = [-0.5, -math.inf, math.nan]  # equal bit for bit, non-finite too
    columns["engine_raw_logprobs"][1] = [-0.75, -1.5]  # a filter moved the first token, not the second
    columns["engine_raw_logprobs"][2] = [-0.0, -1.5, -2.5, -3.5]  # -0.0 is not the engine's -0.5
    table = rows_to_table(columns)
    writer = PartWriter(tmp_path, "part", max_bytes=1 << 30)
    writer.write(table)
    path, = writer.close()
    stored = pq.read_table(path)["engine_raw_logprobs"].to_pylist()
    assert stored == [[None, None, None], [-0.75, None], [-0.0, None, None, None]]
    again = PartWriter(tmp_path, "again", max_bytes=1 << 30)  # a compact table written again stays compact
    again.write(pq.read_table(path))
    assert pq.read_table(again.close()[0])["engine_raw_logprobs"].to_pylist() == stored
    back = load_rollouts(path)
    assert back.schema == SCHEMA
    as_bits = [pa.compute.list_flatten(t["engine_raw_logprobs"]).to_numpy(zero_copy_only=False).view("uint32").tolist()
               for t in (back, table)]
    assert as_bits[0] == as_bits[1]  # NaN, -inf and -0.0 included
    padded, original = to_padded(pq.read_table(path)), to_padded(table)  # to_padded fills a table read directly
    assert torch.equal(padded["engine_raw"].nan_to_num(), original["engine_raw"].nan_to_num())


def test_schema_docstring_examples():
    import doctest

    import rollout_schema

    result = doctest.testmod(rollout_schema)
    assert result.attempted >= 4 and result.failed == 0


def test_round_mantissa_error_bound():
    values = torch.cat([-torch.rand(10_000) * 30, torch.tensor([-1e-7, 0.0])]).tolist()
    table = pa.table({"engine_logprobs": pa.array([values + [-math.inf]], pa.list_(pa.float32()))})
    rounded = round_mantissa(table, 16)["engine_logprobs"].to_pylist()[0]
    exact = pa.array(values, pa.float32()).to_pylist()
    assert rounded[-1] == -math.inf
    errors = [abs(r - e) / max(abs(e), 1e-30) for r, e in zip(rounded, exact, strict=False)]
    assert max(errors) <= 2.0**-17
    assert max(errors) > 2.0**-20  # it did round
    assert round_mantissa(table, 23) is table


def _committed():
    files = sorted(DATA.glob("*.parquet"))
    if not files:
        pytest.skip("no committed rollout files")
    return load_rollouts(files)


def test_committed_files_keep_the_contract():
    table = _committed()
    assert table.schema == SCHEMA
    lengths = pc.list_value_length(table["completion_ids"])
    for name in ("engine_logprobs", "trainer_logprobs", "engine_raw_logprobs"):
        assert pc.all(pc.equal(pc.list_value_length(table[name]), lengths)).as_py()
    clean = table.filter(pc.equal(table["fault"], "none"))
    assert pc.all(pc.equal(clean["fault_start"], -1)).as_py()
    for path in sorted(DATA.glob("*.parquet")):  # stored compact: a raw logprob equal to the engine's is null
        stored = pq.read_table(path, columns=["engine_logprobs", "engine_raw_logprobs"])
        raw = pc.list_flatten(stored["engine_raw_logprobs"])
        engine = pc.list_flatten(stored["engine_logprobs"]).to_numpy(zero_copy_only=False)
        kept = ~raw.is_null().to_numpy(zero_copy_only=False)
        assert raw.null_count > 0, path.name
        assert not (raw.to_numpy(zero_copy_only=False)[kept].view("uint32") == engine[kept].view("uint32")).any()
    faulty = table.filter(pc.not_equal(table["fault"], "none"))
    assert pc.all(pc.greater_equal(faulty["fault_start"], 0)).as_py()
    assert clean.num_rows >= 20_000 and pc.sum(pc.list_value_length(clean["completion_ids"])).as_py() >= 5_000_000


def test_committed_processed_logprobs_only_rise_under_filtering():
    """Renormalising over the kept support can only raise a sampled token's logprob; no filter: processed == raw."""
    table = _committed()
    h200 = table.filter(pc.starts_with(table["source"], "h200"))  # raw and processed from the same decode step there
    batch = to_padded(h200.slice(0, 4000))
    mask = batch["mask"].bool()
    top_p = torch.tensor(h200.slice(0, 4000)["top_p"].to_pylist())
    top_k = torch.tensor(h200.slice(0, 4000)["top_k"].to_pylist())
    unfiltered = ((top_p >= 1) & (top_k == 0))[:, None] & mask
    assert unfiltered.any() and (~unfiltered & mask).any()
    assert torch.equal(batch["engine"][unfiltered], batch["engine_raw"][unfiltered])
    assert (batch["engine"][mask] >= batch["engine_raw"][mask] - 1e-3).all()


def test_committed_raw_logprobs_come_from_the_engines_own_context():
    """Unfiltered at T=1, processed and raw are the same distribution: on faulty rows too (the engine's context)."""
    table = _committed()
    plain = table.filter(pc.and_(pc.and_(pc.equal(table["temperature"], 1.0), pc.equal(table["top_p"], 1.0)),
                                 pc.equal(table["top_k"], 0)))
    faulty = plain.filter(pc.not_equal(plain["fault"], "none"))
    assert faulty.num_rows > 0
    for part in (faulty, plain.slice(0, 3000)):
        batch = to_padded(part)
        mask = batch["mask"].bool()
        assert (batch["engine"][mask] - batch["engine_raw"][mask]).abs().max() < 1.0


def test_every_data_file_matches_the_manifest():
    """MANIFEST.json names every data file with its size, sha256 and how it was made; a changed or unlisted file
    fails here."""
    import hashlib
    import json

    root = Path(__file__).resolve().parents[1] / "fidelity_data"
    manifest = json.loads((root / "MANIFEST.json").read_text())
    present = {path.name for path in root.glob("*.parquet")} | {"stdlib_bpe8k.json"}
    assert set(manifest) == present
    for name, entry in manifest.items():
        data = (root / name).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (entry["bytes"], entry["sha256"]), name
        assert entry["made_by"], name
