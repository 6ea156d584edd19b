"""`benchmarks/tables.py`: the docs' result tables agree with the committed results files, and the check fails
when a table's text does not."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import tables  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def copy_of_the_repository(folder: Path) -> Path:
    """The documents and the results folder, copied under ``folder``."""
    for path in tables.documents(REPO):
        target = folder / path.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    shutil.copytree(REPO / "benchmarks" / "results", folder / "benchmarks" / "results")
    return folder


def holder(root: Path, name: str) -> Path:
    """The document that holds table ``name``."""
    return next(path for path in tables.documents(root) if f"<!-- table: {name} -->" in path.read_text())


def first_data_row(body: str) -> str:
    """The first row below a table's separator line (``| --- |``) that holds a digit."""
    lines = body.splitlines()
    separator = next(index for index, line in enumerate(lines) if line.startswith("| ---"))
    return next(line for line in lines[separator + 1:] if line.startswith("| ") and re.search(r"\d", line))


def test_every_table_in_the_docs_agrees_with_its_results_file():
    """What CI runs: ``python benchmarks/tables.py --check`` exits 0, and every table the script knows is in a doc."""
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "tables.py"), "--check"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", sorted(tables.TABLES))
def test_an_edited_table_cell_fails_the_check_naming_its_file_and_table(name, tmp_path, capsys):
    """One digit of the table's first data row changed: the check exits 1 naming the document and the table (and no
    other), writes nothing, and a rewrite restores the document as it was."""
    root = copy_of_the_repository(tmp_path)
    path = holder(root, name)
    original = path.read_text()
    region = next(match for match in tables.MARKED.finditer(original) if match["name"] == name)
    row = first_data_row(region["body"])
    digit = re.search(r"\d", row)
    edited_row = row[:digit.start()] + str((int(digit.group()) + 1) % 10) + row[digit.end():]
    body = region["body"].replace(row, edited_row, 1)
    edited = original[:region.start("body")] + body + original[region.end("body"):]
    path.write_text(edited)

    assert tables.main(["--check", "--root", str(root)]) == 1
    reported = capsys.readouterr().err.splitlines()
    where = path.relative_to(root).as_posix()
    assert [line for line in reported if "differs" in line] == [
        f"{where}: table {name} differs from its results file (python benchmarks/tables.py rewrites it)"]
    assert path.read_text() == edited

    assert tables.main(["--root", str(root)]) == 0
    assert path.read_text() == original
    assert tables.main(["--check", "--root", str(root)]) == 0


def test_a_marker_naming_no_table_or_left_open_is_an_error_naming_the_file(tmp_path, capsys):
    root = copy_of_the_repository(tmp_path)
    page = root / "docs" / "fidelity.md"
    text = page.read_text()
    page.write_text(text + "\n<!-- table: no_such_table -->\n<!-- /table -->\n")
    assert tables.main(["--check", "--root", str(root)]) == 2
    assert "docs/fidelity.md: unknown table(s) ['no_such_table']" in capsys.readouterr().err
    page.write_text(text + "\n<!-- table: soak -->\n")
    assert tables.main(["--root", str(root)]) == 2
    assert "docs/fidelity.md: 2 '<!-- table: NAME -->' markers but 1 closed" in capsys.readouterr().err


def test_a_table_in_no_document_fails_the_check(tmp_path, capsys):
    root = copy_of_the_repository(tmp_path)
    page = holder(root, "soak")
    page.write_text(re.sub(r"<!-- table: soak -->\n.*?<!-- /table -->\n", "", page.read_text(), flags=re.DOTALL))
    assert tables.main(["--check", "--root", str(root)]) == 1
    assert "table soak is in no document" in capsys.readouterr().err


def test_spans_read_one_figure_where_both_ends_round_alike():
    assert tables.span([2.456, 2.495], 2) == "2.46–2.50"
    assert tables.span([2.456, 2.495], 1) == "2.5"
    assert [tables.mib(x) for x in (0.043, 1.386, 22.9, 180.86)] == ["0.04", "1.4", "23", "181"]
    assert (tables.seconds(0.1975), tables.seconds(0.00102)) == ("0.20 s", "0.001 s")
