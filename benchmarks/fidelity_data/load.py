"""Read the rollout files (see README.md): ``load_rollouts(paths)`` -> one table, ``to_padded(table)`` -> B×T tensors.

    >>> from pathlib import Path
    >>> here = Path(__file__).resolve().parent
    >>> table = load_rollouts(sorted(here.glob("*.parquet"))[:1])  # doctest: +SKIP
    >>> batch = to_padded(table.slice(0, 4))  # doctest: +SKIP
    >>> batch["mask"].shape == batch["engine"].shape  # doctest: +SKIP
    True
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

try:
    from rollout_schema import expand_raw
except ImportError:  # imported as benchmarks.fidelity_data.load
    from benchmarks.fidelity_data.rollout_schema import expand_raw


def load_rollouts(paths: str | Path | Iterable[str | Path]) -> pa.Table:
    """Concatenate rollout parquet files (a path, a folder of ``*.parquet``, or a list of either) into one table,
    ``engine_raw_logprobs`` filled where the files store it compact (``rollout_schema.expand_raw``)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files: list[Path] = []
    for path in map(Path, paths):
        files += sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"load_rollouts: no parquet files in {paths!r}; pass files or a folder holding *.parquet")
    return expand_raw(pa.concat_tables([pq.read_table(f) for f in files]))


def to_padded(table: pa.Table, width: int | None = None) -> dict:
    """Right-padded B×T tensors of a rollout table (T = longest completion, or ``width``).

    Returns ``mask`` (long, 1 on completion tokens), ``engine`` (processed engine logprobs), ``trainer``,
    ``engine_raw`` (float32, 0 on padding), ``completion_ids`` (long, 0 on padding), and per row ``fault_start``
    (long, -1 clean) and ``truncated`` (bool).
    """
    import numpy as np
    import torch

    table = expand_raw(table)  # a table read straight from a file
    lengths = pc.list_value_length(table["completion_ids"]).to_numpy(zero_copy_only=False).astype(np.int64)
    rows = len(lengths)
    width = int(width if width is not None else (lengths.max() if rows else 0))
    if rows and lengths.max() > width:
        raise ValueError(f"to_padded: width={width} is shorter than the longest completion ({lengths.max()})")
    mask = np.arange(width)[None, :] < lengths[:, None]

    def pad(name: str, dtype) -> torch.Tensor:
        values = pc.list_flatten(table[name]).to_numpy(zero_copy_only=False)
        out = np.zeros((rows, width), dtype=dtype)
        out[mask] = values  # row-major boolean assignment: row i's tokens fill its first lengths[i] slots
        return torch.from_numpy(out)

    return {
        "mask": torch.from_numpy(mask.astype(np.int64)),
        "engine": pad("engine_logprobs", np.float32),
        "trainer": pad("trainer_logprobs", np.float32),
        "engine_raw": pad("engine_raw_logprobs", np.float32),
        "completion_ids": pad("completion_ids", np.int64),
        "fault_start": torch.from_numpy(table["fault_start"].to_numpy(zero_copy_only=False).astype(np.int64)),
        "truncated": torch.from_numpy(table["truncated"].to_numpy(zero_copy_only=False).astype(bool)),
    }
