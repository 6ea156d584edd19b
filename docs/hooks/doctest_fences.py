"""MkDocs hook: show docstring examples (``>>>`` lines and their output) as Python console code blocks.

The package's docstrings hold doctest examples as plain paragraphs, as ``doctest`` reads them; Markdown would read
``[1.0, 2.0]`` in their output as a link reference. This hook adds a Markdown preprocessor, to the pages and to
mkdocstrings' rendering of the docstrings, that fences each run of lines from a ``>>>`` line to the next blank line
as ``pycon``.
"""

from __future__ import annotations

import re

from markdown import Extension
from markdown.preprocessors import Preprocessor

PROMPT = re.compile(r"^(\s*)>>> ")
FENCE = re.compile(r"^\s*(```|~~~)")


class DoctestFences(Preprocessor):
    """Wrap each doctest block (a ``>>>`` line up to the next blank line) outside fenced code in a pycon fence."""

    def run(self, lines: list[str]) -> list[str]:
        out: list[str] = []
        fenced = False
        index = 0
        while index < len(lines):
            line = lines[index]
            if FENCE.match(line):
                fenced = not fenced
            match = None if fenced else PROMPT.match(line)
            if match is None:
                out.append(line)
                index += 1
                continue
            indent = match.group(1)
            block = []
            while index < len(lines) and lines[index].strip():
                block.append(lines[index][len(indent):] if lines[index].startswith(indent) else lines[index])
                index += 1
            if out and out[-1].strip():
                out.append("")
            out += [f"{indent}```pycon", *(indent + row for row in block), f"{indent}```", ""]
        return out


class DoctestFencesExtension(Extension):
    def extendMarkdown(self, md):  # noqa: N802 (Markdown's API)
        md.preprocessors.register(DoctestFences(md), "doctest_fences", 40)


def on_config(config):
    """Add the extension to the Markdown extensions that the pages and mkdocstrings use."""
    config.markdown_extensions.insert(0, DoctestFencesExtension())
    return config
