"""benchmarks/README.md is an index:

- at most 400 lines;
- after its title and at most one short paragraph, it opens with the index
  table, one row per script;
- every script in benchmarks/ (`*.py`, `*.sh`) has a row, and every row
  names a script that exists;
- the result files the table names exist, and its links to sections of the
  page land on a heading.
"""

from __future__ import annotations

import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
README = BENCHMARKS / "README.md"
LINES = README.read_text().splitlines()


def index_table() -> list[str]:
    """The table the page opens with: its lines, header and separator included."""
    rest = LINES[1:]
    assert LINES[0].startswith("# "), "the page starts with its title"
    while rest and not rest[0].strip():
        rest = rest[1:]
    paragraph = 0
    while rest and rest[0].strip() and not rest[0].startswith("|"):
        paragraph, rest = paragraph + 1, rest[1:]
    assert paragraph <= 6, "at most a short paragraph before the index table"
    while rest and not rest[0].strip():
        rest = rest[1:]
    table = []
    while rest and rest[0].startswith("|"):
        table, rest = table + [rest[0]], rest[1:]
    assert len(table) > 2, "the index table follows the title and its paragraph"
    return table


def script_of(row: str) -> str:
    first = row.strip("|").split("|")[0]
    names = re.findall(r"`([^`]+\.(?:py|sh))`", first)
    assert len(names) == 1, f"the first cell names one script: {row}"
    return names[0]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_the_page_is_at_most_400_lines():
    assert len(LINES) <= 400, len(LINES)


def test_the_index_table_has_one_row_per_script():
    rows = index_table()[2:]
    listed = [script_of(row) for row in rows]
    assert len(listed) == len(set(listed)), "one row per script"
    scripts = sorted(p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh"))
    assert sorted(listed) == scripts


def test_named_result_files_exist_and_section_links_land():
    table = "\n".join(index_table())
    for name in re.findall(r"`(results/[^`*]+)`", table):
        assert (BENCHMARKS / name).exists(), name
    for pattern in re.findall(r"`(results/[^`]*\*[^`]*)`", table):
        assert list(BENCHMARKS.glob(pattern)), pattern
    headings = {slug(line) for line in LINES if line.startswith("#")}
    for anchor in re.findall(r"\]\(#([^)]+)\)", README.read_text()):
        assert anchor in headings, anchor
