"""The rollout table: one row per rollout, per-token engine and trainer logprobs (the contract with fidelity.py).

Columns (see README.md for their exact meaning):

* ``source``, ``condition``, ``model``, ``engine``, ``trainer``: strings; ``condition`` names everything that varies.
* ``temperature``, ``top_p`` (float32), ``top_k`` (int32, 0 = off).
* ``step`` (int32, the generation batch = one training step), ``group`` (int32, prompt index), ``prompt_len`` (int32).
* ``completion_ids`` list<int32>; ``engine_logprobs`` (processed: log_softmax of logits/T after top-k/top-p,
  renormalised over the kept support, as vLLM's ``processed_logprobs``), ``trainer_logprobs`` (log_softmax(logits/T)
  of a full forward, no filtering, as TRL), ``engine_raw_logprobs`` (log_softmax(logits/T) of the engine's own forward,
  no filtering): list<float32>, one value per completion token.
* ``truncated`` (bool, no EOS before max_tokens), ``eos`` (int32), ``fault`` (``none``, ``context_swap``,
  ``late_onset``, ``stale_weights``), ``fault_start`` (int32 token index, -1 when clean).

Files are written with zstd and byte-stream-split floats (about 11 bytes per completion token lossless, about 8.5 with
the logprobs rounded to 16 mantissa bits: ``round_mantissa``). On disk an ``engine_raw_logprobs`` element is null
where it equals ``engine_logprobs`` bit for bit (no filter changed that token's logprob: about half the tokens;
``compact_raw``, in ``PartWriter``); the readers fill those back (``expand_raw``), so no reader ever sees a null.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute  # noqa: F401  (makes pa.compute available)
import pyarrow.parquet as pq

SCHEMA = pa.schema([
    ("source", pa.string()),
    ("condition", pa.string()),
    ("model", pa.string()),
    ("engine", pa.string()),
    ("trainer", pa.string()),
    ("temperature", pa.float32()),
    ("top_p", pa.float32()),
    ("top_k", pa.int32()),
    ("step", pa.int32()),
    ("group", pa.int32()),
    ("prompt_len", pa.int32()),
    ("completion_ids", pa.list_(pa.int32())),
    ("engine_logprobs", pa.list_(pa.float32())),
    ("trainer_logprobs", pa.list_(pa.float32())),
    ("engine_raw_logprobs", pa.list_(pa.float32())),
    ("truncated", pa.bool_()),
    ("eos", pa.int32()),
    ("fault", pa.string()),
    ("fault_start", pa.int32()),
])

FAULTS = ("none", "context_swap", "late_onset", "stale_weights")
LIST_COLUMNS = ("completion_ids", "engine_logprobs", "trainer_logprobs", "engine_raw_logprobs")
DICTIONARY_COLUMNS = ["source", "condition", "model", "engine", "trainer", "fault"]
SPLIT_COLUMNS = [f"{name}.list.element" for name in LIST_COLUMNS]  # byte-stream split: ~25 % smaller floats under zstd


def rows_to_table(columns: dict[str, Sequence]) -> pa.Table:
    """Column dict (one entry per SCHEMA field, equal lengths) -> table; checks per-row list lengths agree."""
    missing = [name for name in SCHEMA.names if name not in columns]
    if missing:
        raise ValueError(f"rollout columns {missing} are missing: give every field of rollout_schema.SCHEMA")
    table = pa.table({name: columns[name] for name in SCHEMA.names}, schema=SCHEMA)
    lengths = [pa.compute.list_value_length(table[name]) for name in LIST_COLUMNS]
    for name, length in zip(LIST_COLUMNS[1:], lengths[1:], strict=True):
        if not pa.compute.all(pa.compute.equal(length, lengths[0])).as_py():
            raise ValueError(f"rollout column {name!r}: one value per completion token, as completion_ids")
    bad = set(pa.compute.unique(table["fault"]).to_pylist()) - set(FAULTS)
    if bad:
        raise ValueError(f"rollout column 'fault' has {sorted(bad)}: use one of {FAULTS}")
    return table


def _flat_float32(column) -> tuple:
    """(values, offsets) of a list<float32> column: a float32 numpy array (NaN at a null element) and int32 offsets."""
    import numpy as np

    values = pa.compute.list_flatten(column).to_numpy(zero_copy_only=False).astype(np.float32)
    lengths = pa.compute.list_value_length(column).to_numpy(zero_copy_only=False)
    return values, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def round_mantissa(table: pa.Table, bits: int) -> pa.Table:
    """Round the per-token float32 logprobs to ``bits`` explicit mantissa bits (23 = unchanged), nearest, ties away.

    Relative error <= 2**-(bits + 1); non-finite values are kept as they are. With 16 bits the error is <= 7.6e-6
    relative (<= 1.5e-4 nats at logprob -20), far below bf16's own resolution (2**-9 relative), and zstd then
    stores the zeroed low byte almost for free.

    >>> t = pa.table({"engine_logprobs": pa.array([[-1.2345678, float("-inf")]], pa.list_(pa.float32()))})
    >>> round_mantissa(t, 16)["engine_logprobs"].to_pylist()[0]
    [-1.2345733642578125, -inf]
    """
    import numpy as np

    if bits >= 23:
        return table
    drop = 23 - bits
    for name in ("engine_logprobs", "trainer_logprobs", "engine_raw_logprobs"):
        if name not in table.column_names:
            continue
        values, offsets = _flat_float32(table[name])
        as_int = values.view(np.uint32)
        rounded = ((as_int + np.uint32(1 << (drop - 1))) & np.uint32(~((1 << drop) - 1) & 0xFFFFFFFF)).view(np.float32)
        values = np.where(np.isfinite(values), rounded, values)
        array = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.float32()))
        table = table.set_column(table.column_names.index(name), name, array)
    return table


RAW = "engine_raw_logprobs"


def compact_raw(table: pa.Table) -> pa.Table:
    """``engine_raw_logprobs`` with a null element wherever it equals ``engine_logprobs`` bit for bit (±inf and NaN
    included), which parquet stores in a bit instead of four bytes; exactly undone by :func:`expand_raw`. A table
    that is compact already stays as it is (its nulls are filled first, never turned into NaN values).

    >>> t = pa.table({"engine_logprobs": pa.array([[-1.0, -2.0], [-3.0]], pa.list_(pa.float32())),
    ...               "engine_raw_logprobs": pa.array([[-1.0, -2.5], [-3.0]], pa.list_(pa.float32()))})
    >>> compact_raw(t)["engine_raw_logprobs"].to_pylist()
    [[None, -2.5], [None]]
    >>> expand_raw(compact_raw(t)).equals(t), compact_raw(compact_raw(t)).equals(compact_raw(t))
    (True, True)
    """
    import numpy as np

    if RAW not in table.column_names:
        return table
    table = expand_raw(table)
    raw, offsets = _flat_float32(table[RAW])
    engine, _ = _flat_float32(table["engine_logprobs"])
    same = raw.view(np.uint32) == engine.view(np.uint32)
    array = pa.ListArray.from_arrays(pa.array(offsets), pa.array(raw, pa.float32(), mask=same))
    return table.set_column(table.column_names.index(RAW), RAW, array)


def expand_raw(table: pa.Table) -> pa.Table:
    """The table with every null ``engine_raw_logprobs`` element filled from ``engine_logprobs`` (what
    :func:`compact_raw` left out); the table itself where there is none."""
    import numpy as np

    if RAW not in table.column_names:
        return table
    missing = pa.compute.list_flatten(table[RAW]).is_null()
    if not pa.compute.any(missing).as_py():
        return table
    raw, offsets = _flat_float32(table[RAW])
    engine, _ = _flat_float32(table["engine_logprobs"])
    values = np.where(missing.to_numpy(zero_copy_only=False), engine, raw)
    array = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.float32()))
    return table.set_column(table.column_names.index(RAW), RAW, array)


class PartWriter:
    """Appends tables to ``{stem}_{k}.parquet``, opening a new part once a file passes ``max_bytes``.

    Each ``write`` is one row group, flushed to disk at once, so a part's size on disk is known after each call;
    ``engine_raw_logprobs`` is stored compact (:func:`compact_raw`).
    ``max_parts`` bounds the number of files; ``full`` says when the last part is full and no more fits.
    """

    def __init__(self, folder: str | Path, stem: str, max_bytes: int, max_parts: int = 1) -> None:
        self.folder, self.stem, self.max_bytes, self.max_parts = Path(folder), stem, max_bytes, max_parts
        self.folder.mkdir(parents=True, exist_ok=True)
        self.paths: list[Path] = []
        self.writer: pq.ParquetWriter | None = None
        self.rows = 0
        self.tokens = 0

    def _open(self) -> None:
        path = self.folder / (f"{self.stem}_{len(self.paths)}.parquet" if self.max_parts > 1 else f"{self.stem}.parquet")
        self.paths.append(path)
        self.writer = pq.ParquetWriter(path, SCHEMA, compression="zstd", compression_level=9, use_dictionary=DICTIONARY_COLUMNS,
                                       use_byte_stream_split=SPLIT_COLUMNS)

    @property
    def current_bytes(self) -> int:
        return os.path.getsize(self.paths[-1]) if self.paths else 0

    @property
    def full(self) -> bool:
        return len(self.paths) >= self.max_parts and self.current_bytes >= self.max_bytes

    def write(self, table: pa.Table) -> None:
        if self.writer is None:
            self._open()
        elif self.current_bytes >= self.max_bytes:
            if len(self.paths) >= self.max_parts:
                raise RuntimeError(f"{self.stem}: all {self.max_parts} parts are full; check PartWriter.full first")
            self.writer.close()
            self._open()
        self.writer.write_table(compact_raw(table))
        self.rows += table.num_rows
        self.tokens += int(pa.compute.sum(pa.compute.list_value_length(table["completion_ids"])).as_py() or 0)

    def close(self) -> list[Path]:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        return self.paths
