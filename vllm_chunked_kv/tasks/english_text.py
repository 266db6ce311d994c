"""Ordinary English text that ships with Python: the standard library's docstrings.

Used to train (`adapt`) and to measure perplexity, so the two must never
share a passage. The split is by source file: a file whose path (relative to
the standard library) hashes to 0 mod 10 is held out for evaluation, every
other file is training text. Docstrings are read with `ast`, without
importing anything; doctest examples and short fragments are dropped.

The text depends on the Python version (its docstrings change between
releases): reports name the version they measured.
"""

from __future__ import annotations

import ast
import re
import sys
import sysconfig
import zlib
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

HELD_OUT_BUCKET = 0  # crc32(path) % 10 == HELD_OUT_BUCKET: evaluation text
MIN_CHARS = 200  # shorter docstrings are mostly signatures and one-liners


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str) -> bool:
    return zlib.crc32(relative_path.encode()) % 10 == HELD_OUT_BUCKET


def _clean(doc: str) -> str | None:
    """Paragraphs of prose with whitespace collapsed; None for code-heavy text."""
    if ">>>" in doc or doc.count("{") + doc.count("=") > 6:
        return None
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", doc)]
    text = "\n\n".join(p for p in paragraphs if p)
    letters = sum(c.isalpha() or c.isspace() for c in text)
    return text if len(text) >= MIN_CHARS and letters > 0.85 * len(text) else None


def _docstrings(path: Path) -> Iterator[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and (text := _clean(doc)):
                yield text


@lru_cache(maxsize=2)
def passages(held_out: bool) -> tuple[str, ...]:
    """Every docstring passage of the training split (False) or the held-out split (True), in path order."""
    root = stdlib_dir()
    out: list[str] = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if "site-packages" in relative or "/test" in f"/{relative}" or "idlelib" in relative:
            continue
        if is_held_out(relative) == held_out:
            out.extend(_docstrings(path))
    return tuple(out)


def held_out_text(min_chars: int = 12_000) -> str:
    """The first held-out passages, joined by blank lines, at least `min_chars` long
    (about 3k tokens of a 49k-vocabulary tokenizer at the default)."""
    chosen, size = [], 0
    for passage in passages(True):
        chosen.append(passage)
        size += len(passage) + 2
        if size >= min_chars:
            return "\n\n".join(chosen)
    raise RuntimeError(f"only {size} characters of held-out text in {stdlib_dir()} (Python {sys.version.split()[0]})")
