"""Reading a benchmark's results JSON, stored plain or gzipped.

The results folder (``benchmarks/results/<benchmark>/``) keeps its JSON gzipped, ``NAME.json.gz`` (``gzip -9n``),
so that the working tree stays small enough for the device machine (64 MiB with the wheels it carries). A document
may name a file as the benchmark wrote it, ``NAME.json``; :func:`read_results` takes that name and reads the gzipped
copy where only it exists, so the commands quoted there run as written.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path


def read_results(path: str | Path) -> dict:
    """The JSON at ``path``: plain, gzipped (a name ending in ``.gz``), or, where ``path`` does not exist,
    ``path`` + ``.gz``.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / "run.json.gz").write_bytes(gzip.compress(b'{"seed": 3}'))
    >>> read_results(folder / "run.json"), read_results(folder / "run.json.gz")
    ({'seed': 3}, {'seed': 3})
    """
    path = stored(path) or Path(path)
    if path.suffix == ".gz":
        return json.loads(gzip.decompress(path.read_bytes()))
    return json.loads(path.read_text())


def stored(path: str | Path) -> Path | None:
    """The file :func:`read_results` reads for ``path``: ``path`` itself, else ``path`` + ``.gz``; ``None`` where
    neither exists."""
    path = Path(path)
    if path.exists():
        return path
    gzipped = path.with_name(path.name + ".gz")
    return gzipped if path.suffix != ".gz" and gzipped.exists() else None
