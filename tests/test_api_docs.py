"""The README's API section lists every public name of the core, and every name it lists exists."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import rollout_guard

README = Path(__file__).resolve().parents[1] / "README.md"
CORE_MODULES = (
    "config", "errors", "evidence", "guard", "records", "store", "sinks", "console", "extras", "action", "statistics",
    "verdict", "alerts", "injection", "charts", "report", "selection", "writer", "packet", "engine_view", "support",
    "detector.detector", "detector.noise", "detector.score",
)


def listed_names() -> list[str]:
    text = README.read_text()
    section = text[text.index("\n## API\n"):]
    section = section[: section.find("\n## ", 1)] if "\n## " in section[1:] else section
    return re.findall(r"^- `([\w.]+)`", section, flags=re.MULTILINE)


def resolve(path: str) -> object:
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            target = getattr(target, attribute)
        return target
    raise ImportError(path)


def test_every_listed_name_exists():
    names = listed_names()
    assert len(names) > 60 and len(names) == len(set(names))
    for name in names:
        resolve(name)


def test_every_public_name_of_the_core_is_listed():
    listed = set(listed_names())
    assert {f"rollout_guard.{name}" for name in rollout_guard.__all__} <= listed
    missing = []
    for short in CORE_MODULES:
        module = importlib.import_module(f"rollout_guard.{short}")
        for name, value in vars(module).items():
            if name.startswith("_") or getattr(value, "__module__", None) != module.__name__:
                continue
            if not (inspect.isclass(value) or inspect.isfunction(value)):
                continue
            if f"{module.__name__}.{name}" not in listed and not (name in rollout_guard.__all__ and f"rollout_guard.{name}" in listed):
                missing.append(f"{module.__name__}.{name}")
    assert not missing, f"add to the README's API section: {missing}"
