"""The quarantine store: append-only JSON Lines, durable once ``append`` returns.

One complete record per line. Each ``append`` writes all its lines with one ``write`` on an ``O_APPEND`` file
descriptor, then ``fsync``s: a record is *acknowledged* when ``append`` returns. A writer killed mid-write can
leave at most one torn line at the end of the newest file; the next writer cuts it off before appending, and
readers skip it, as they skip (count and locate) a line corrupted on disk. Files rotate at ``max_file_bytes``:
``quarantine-00000.jsonl``, ``quarantine-00001.jsonl``, …
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

from rollout_guard.outputs.records import QuarantineRecord

FILE_PATTERN = re.compile(r"quarantine-(\d{5})\.jsonl$")
DEFAULT_MAX_FILE_BYTES = 256 * 1024 * 1024


def store_files(directory: str | Path) -> list[Path]:
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(path for path in directory.iterdir() if FILE_PATTERN.search(path.name))


def _cut_torn_tail(path: Path) -> int:
    """Truncate bytes after the last newline (a line a killed writer never finished); returns bytes cut."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with path.open("rb+") as handle:
        window = min(size, 1 << 20)
        while True:
            handle.seek(size - window)
            chunk = handle.read(window)
            cut = chunk.rfind(b"\n")
            if cut >= 0 or window == size:
                keep = (size - window + cut + 1) if cut >= 0 else 0
                break
            window = min(size, window * 2)
        if keep < size:
            handle.truncate(keep)
            handle.flush()
            os.fsync(handle.fileno())
    return size - keep


def fsync_directory(directory: str | Path) -> None:
    """Make a file created, renamed or removed in ``directory`` durable (its entry lives in the directory)."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_records_after(directory: str | Path, step: int) -> int:
    """Remove the records of steps after ``step`` from a store folder (a run resumed from the checkpoint of
    ``step`` writes them again); each changed file is rewritten durably. Returns how many records were dropped."""
    dropped = 0
    for path in store_files(directory):
        kept, removed = [], 0
        for line in path.read_bytes().split(b"\n"):
            try:
                late = int(json.loads(line)["step"]) > step
            except (ValueError, TypeError, KeyError):
                late = False  # blank, torn or unreadable lines stay as they are
            removed += late
            if not late:
                kept.append(line)
        if removed:
            partial = path.with_name(path.name + ".partial")
            with partial.open("wb") as handle:
                handle.write(b"\n".join(kept))
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(partial, path)
            fsync_directory(path.parent)
            dropped += removed
    return dropped


class QuarantineStore:
    """Writer. ``max_file_bytes``: bytes; a new file starts once the current one reaches it (default 256 MiB)."""

    def __init__(self, directory: str | Path, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> None:
        if max_file_bytes <= 0:
            raise ValueError(f"max_file_bytes={max_file_bytes}: use a positive number of bytes")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_file_bytes = max_file_bytes
        existing = store_files(self.directory)
        self._index = int(FILE_PATTERN.search(existing[-1].name).group(1)) if existing else 0
        self.torn_bytes_cut = _cut_torn_tail(existing[-1]) if existing else 0
        self._fd: int | None = None

    @property
    def path(self) -> Path:
        return self.directory / f"quarantine-{self._index:05d}.jsonl"

    def _descriptor(self) -> int:
        if self._fd is None:
            created = not self.path.exists()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            if created:  # the new file's directory entry must survive a crash too
                fsync_directory(self.directory)
        return self._fd

    def append(self, records: Iterable[QuarantineRecord]) -> int:
        """Write the records durably; returns how many were written."""
        lines = [json.dumps(record.to_json_dict(), allow_nan=False, separators=(",", ":")) for record in records]
        if not lines:
            return 0
        payload = ("\n".join(lines) + "\n").encode()
        if self.path.exists() and self.path.stat().st_size >= self.max_file_bytes:
            self.close()
            self._index += 1
        fd = self._descriptor()
        view = memoryview(payload)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
        return len(lines)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_records(location: str | Path, problems: list[str] | None = None) -> Iterator[QuarantineRecord]:
    """All readable records of a store folder (or one file), oldest first.

    A line that is not a record (a torn last line left by an interrupted writer, or a line corrupted on disk) is
    skipped and reading goes on. Each skipped line is described as ``"<file>:<line>: <why>"`` and appended to
    ``problems`` when given; otherwise one warning per file says how many lines were skipped and where.
    """
    location = Path(location)
    paths = [location] if location.is_file() else store_files(location)
    for path in paths:
        skipped: list[tuple[int, str]] = []  # (line number, why)
        lines = path.read_bytes().split(b"\n")
        torn = lines.pop()  # after the final newline: b"" unless the last line is torn
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                yield QuarantineRecord.from_json_dict(json.loads(line))
            except (ValueError, TypeError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                skipped.append((number, f"not a quarantine record ({str(error)[:120]})"))
        if torn.strip():
            skipped.append((len(lines) + 1, f"torn last line ({len(torn)} bytes) left by an interrupted writer"))
        if not skipped:
            continue
        if problems is not None:
            problems.extend(f"{path}:{number}: {why}" for number, why in skipped)
        else:
            what = "a torn last line" if len(skipped) == 1 and torn.strip() else f"{len(skipped)} unreadable line(s)"
            where = ", ".join(str(number) for number, _ in skipped)
            warnings.warn(f"{path}: skipped {what} (line {where}); the other records were read", stacklevel=2)
