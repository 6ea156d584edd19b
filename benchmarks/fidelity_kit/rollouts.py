"""Rollouts as padded tensors: what the benchmark, the noise models and the fault zoo work on.

The parquet files under ``benchmarks/fidelity_data/`` hold one row per rollout (see that folder's README): the
sampled token ids, the engine's logprob of each (as the engine returns it: processed, after top-k/top-p), the
trainer's logprob of the same token (temperature only), and metadata. Here they become right-padded (B, T)
tensors; no per-sample Python loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True)
class Rollouts:
    """A batch of rollouts, right-padded. Engine/trainer logprobs are 0.0 where ``mask`` is False."""

    mask: torch.Tensor  # (B, T) bool
    engine: torch.Tensor  # (B, T) float32, nats
    trainer: torch.Tensor  # (B, T) float32, nats
    truncated: torch.Tensor  # (B,) bool: no EOS, ran to the length limit
    step: torch.Tensor  # (B,) int64: the generation batch each row came from
    condition: str = ""
    setting: torch.Tensor | None = None  # (B,) int64: which sampling setting of a pooled stream (None: one setting)

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(dim=-1)

    def __len__(self) -> int:
        return self.mask.shape[0]

    def rows(self, index: torch.Tensor | slice) -> Rollouts:
        """A sub-batch (``index``: a LongTensor, a bool mask or a slice, which costs no copy), trimmed to its
        longest row."""
        mask = self.mask[index]
        width = max(int(mask.sum(dim=-1).max()) if len(mask) else 1, 1)
        return replace(self, mask=mask[:, :width], engine=self.engine[index][:, :width],
                       trainer=self.trainer[index][:, :width], truncated=self.truncated[index], step=self.step[index],
                       setting=self.setting[index] if self.setting is not None else None)

    def widened(self, width: int) -> Rollouts:
        """The same rows padded to ``width`` columns (never narrower)."""
        extra = max(width - self.mask.shape[1], 0)
        if extra == 0:
            return self
        pad = torch.nn.functional.pad
        return replace(self, mask=pad(self.mask, (0, extra)), engine=pad(self.engine, (0, extra)),
                       trainer=pad(self.trainer, (0, extra)))


def cat(parts: Sequence[Rollouts]) -> Rollouts:
    width = max(part.mask.shape[1] for part in parts)
    parts = [part.widened(width) for part in parts]
    return Rollouts(
        mask=torch.cat([p.mask for p in parts]), engine=torch.cat([p.engine for p in parts]),
        trainer=torch.cat([p.trainer for p in parts]), truncated=torch.cat([p.truncated for p in parts]),
        step=torch.cat([p.step for p in parts]), condition=parts[0].condition,
        setting=torch.cat([p.setting for p in parts]) if all(p.setting is not None for p in parts) else None,
    )


def pad_lists(offsets: np.ndarray, values: np.ndarray, fill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged values (CSR: ``values[offsets[i]:offsets[i+1]]`` is row i) → (B, T) padded tensor and (B, T) mask.

    >>> padded, mask = pad_lists(np.array([0, 2, 3]), np.array([1.0, 2.0, 3.0], dtype=np.float32))
    >>> padded.tolist(), mask.tolist()
    ([[1.0, 2.0], [3.0, 0.0]], [[True, True], [True, False]])
    """
    lengths = torch.from_numpy(np.diff(offsets).astype(np.int64))
    width = max(int(lengths.max()) if lengths.numel() else 1, 1)
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    padded = torch.full((len(lengths), width), fill, dtype=torch.float32)
    padded[mask] = torch.from_numpy(np.array(values, dtype=np.float32))
    return padded, mask


def _list_column(table, name: str) -> tuple[np.ndarray, np.ndarray]:
    import pyarrow as pa

    column = table.column(name).combine_chunks()
    if isinstance(column, pa.ChunkedArray):  # pyarrow < 15 returns a ChunkedArray
        column = pa.concat_arrays(column.chunks)
    offsets = column.offsets.to_numpy()
    values = column.values.to_numpy(zero_copy_only=False)
    return offsets - offsets[0], values[offsets[0] : offsets[-1]]


def padded_column(table, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One list column of a benchmark table (e.g. ``engine_raw_logprobs``) as a (B, T) padded float32 tensor and
    its (B, T) mask, rows aligned with :func:`from_table`'s."""
    return pad_lists(*_list_column(table, name))


def from_table(table, condition: str = "") -> Rollouts:
    """Padded rollouts from a pyarrow table in the benchmark's format."""
    offsets, engine_values = _list_column(table, "engine_logprobs")
    engine, mask = pad_lists(offsets, engine_values)
    trainer_offsets, trainer_values = _list_column(table, "trainer_logprobs")
    if not np.array_equal(trainer_offsets, offsets):
        raise ValueError("trainer_logprobs and engine_logprobs differ in length on some row")
    trainer, _ = pad_lists(offsets, trainer_values)
    truncated = torch.from_numpy(table.column("truncated").to_numpy(zero_copy_only=False).astype(bool))
    step = torch.from_numpy(table.column("step").to_numpy(zero_copy_only=False).astype(np.int64))
    return Rollouts(mask=mask, engine=engine, trainer=trainer, truncated=truncated, step=step, condition=condition)


def read_tables(paths: Sequence[str | Path]):
    """All parquet files concatenated (columns the benchmark needs, plus metadata), ``engine_raw_logprobs`` filled
    where the files store it compact."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from benchmarks.fidelity_data.rollout_schema import expand_raw

    tables = [pq.read_table(path) for path in paths]
    return expand_raw(pa.concat_tables(tables, promote_options="default") if len(tables) > 1 else tables[0])


def fixed_subset(table, clean_per_source: int, faulty_per_kind: int, seed: int = 0):
    """A small, fixed sample of a rollout table for the regression test: per source, ``clean_per_source`` clean
    rows spread over its sampling settings and ``faulty_per_kind`` rows of each model-generated fault."""
    import pyarrow as pa
    import pyarrow.compute as pc

    generator = np.random.default_rng(seed)
    parts = []
    for source in sorted(set(table.column("source").to_pylist())):
        of_source = table.filter(pc.equal(table.column("source"), source))
        for fault in sorted(set(of_source.column("fault").to_pylist())):
            rows = of_source.filter(pc.equal(of_source.column("fault"), fault))
            count = min(rows.num_rows, clean_per_source if fault == "none" else faulty_per_kind)
            parts.append(rows.take(np.sort(generator.choice(rows.num_rows, count, replace=False))))
    return pa.concat_tables(parts)


def stitched(rows: Rollouts, factor: int, generator: torch.Generator, prefix: Rollouts | None = None) -> Rollouts:
    """Rows ``factor`` times as long, made of the benchmark's own: each new row is ``factor`` rows of one sampling
    setting (``rows.setting``) end to end, drawn at random without replacement (a setting's remainder dropped).
    Every token keeps its real engine and trainer logprobs and their real mismatch; what changes is how many
    tokens one verdict covers, as in runs whose completions are thousands of tokens long. With ``prefix``, each
    of ``rows`` is kept whole and last, after ``factor − 1`` rows of ``prefix`` of its setting (drawn with
    replacement): a real fault that starts late in a long row. The new row's step is its first part's, its
    truncation its last part's.

    >>> mask = torch.tensor([[True, True], [True, False], [True, True], [True, False]])
    >>> rows = Rollouts(mask=mask, engine=torch.arange(8.0).view(4, 2) * mask, trainer=torch.zeros(4, 2),
    ...                 truncated=torch.tensor([False, False, False, True]), step=torch.arange(4))
    >>> long = stitched(rows, 2, torch.Generator().manual_seed(0))
    >>> long.lengths.tolist(), sorted(long.engine[long.mask].tolist())  # every token once, two rows of 3
    ([3, 3], [0.0, 1.0, 2.0, 4.0, 5.0, 6.0])
    """
    if factor <= 1:
        return rows
    setting = rows.setting if rows.setting is not None else torch.zeros(len(rows), dtype=torch.long)
    if prefix is None:
        order = torch.randperm(len(rows), generator=generator)
        order = order[torch.argsort(setting[order], stable=True)]  # grouped by setting, shuffled within
        ordered = setting[order]
        start = torch.searchsorted(ordered, ordered)  # each row's first position of its setting
        rank = torch.arange(len(order)) - start
        usable = (torch.bincount(ordered)[ordered] // factor) * factor
        order = order[rank < usable]
    else:
        prefix_setting = prefix.setting if prefix.setting is not None else torch.zeros(len(prefix), dtype=torch.long)
        by_setting = torch.argsort(prefix_setting, stable=True)
        start = torch.searchsorted(prefix_setting[by_setting], setting)
        count = torch.searchsorted(prefix_setting[by_setting], setting, right=True) - start
        if bool((count == 0).any()):
            raise ValueError("stitched: a row's sampling setting has no prefix rows")
        draws = (torch.rand(len(rows), factor - 1, generator=generator) * count.unsqueeze(1)).long()
        picked = by_setting[start.unsqueeze(1) + draws]  # (n, factor − 1) prefix rows before each row
        order = torch.cat([torch.arange(picked.numel()).view(-1, factor - 1),
                           picked.numel() + torch.arange(len(rows)).unsqueeze(1)], dim=1).flatten()
        rows = cat([prefix.rows(picked.flatten()), rows])
    parts = rows.rows(order)
    lengths = parts.lengths.view(-1, factor).sum(dim=1)
    width = max(int(lengths.max()) if len(lengths) else 1, 1)
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    engine, trainer = torch.zeros(mask.shape), torch.zeros(mask.shape)
    engine[mask], trainer[mask] = parts.engine[parts.mask], parts.trainer[parts.mask]
    first, last = slice(0, None, factor), slice(factor - 1, None, factor)
    setting_of = parts.setting[first] if rows.setting is not None else None
    return Rollouts(mask=mask, engine=engine, trainer=trainer, truncated=parts.truncated[last], step=parts.step[first],
                    condition=rows.condition, setting=setting_of)
