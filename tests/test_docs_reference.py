"""The API reference (``docs/reference/*.md``, rendered by mkdocstrings) has a block for every public module of the
core and of the integrations."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def reference_blocks() -> set[str]:
    """The identifiers of the ``::: identifier`` blocks of the reference pages."""
    text = "\n".join(page.read_text() for page in sorted((REPO / "docs" / "reference").glob("*.md")))
    return set(re.findall(r"^::: ([\w.]+)\s*$", text, flags=re.MULTILINE))


def public_modules(package: str) -> set[str]:
    """Dotted names of the package's modules (``__init__`` as the package itself), private ones left out."""
    root = REPO.joinpath(*package.split("."))
    names = set()
    for path in root.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(part.startswith("_") for part in parts):
            names.add(".".join(parts))
    return names


def test_every_public_module_has_a_reference_block():
    blocks = reference_blocks()
    missing = sorted((public_modules("rollout_guard") - {"rollout_guard"} | public_modules("integrations") - {"integrations"})
                     - blocks)
    assert not missing, f"add a '::: NAME' block to a page of docs/reference/: {missing}"


def test_every_reference_block_names_a_module_that_exists():
    known = public_modules("rollout_guard") | public_modules("integrations")
    assert reference_blocks() <= known, sorted(reference_blocks() - known)
