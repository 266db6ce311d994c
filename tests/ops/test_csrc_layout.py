"""The layout of csrc/, read as text (nothing is built):

- every file lives in a family folder (``common/``: what both kernel families
  include; ``cpu/``: the C++ CPU kernels and their binding; ``cuda/``: the
  CUDA kernels, their binding and the CPU emulation), is named by the
  extension that builds it (`cpu_ext` / `cuda_ext` SOURCES and HEADERS, whose
  digests rebuild it) and is installed by pyproject's data-files, one line per
  folder;
- every quoted ``#include`` resolves from the including file's folder (the
  builds and nvcc need no include path of ours);
- the kernels' argument structs `WriteArgs`, `AttendArgs` and `MergeArgs` are
  defined once, in ``common/``, and filled from tensors once, in
  ``common/chunked_kv_binding.h`` (no binding declares one of its own);
- every Python file a comment names exists (``vllm_chunked_kv/...``, or a path
  relative to the package such as ``ops/kernels/compressed.py``).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from vllm_chunked_kv.ops.kernels import cpu_ext, cuda_ext, jit

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
FAMILIES = ("common", "cpu", "cuda")
ARG_STRUCTS = ("WriteArgs", "AttendArgs", "MergeArgs")


def _files() -> list[Path]:
    return sorted(p for p in CSRC.rglob("*") if p.is_file())


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def test_sources_dir_is_the_csrc_root():
    assert jit.SOURCES_DIR == CSRC == cpu_ext.SOURCES_DIR == cuda_ext.SOURCES_DIR


def test_every_file_lives_in_a_family_folder():
    misplaced = [str(p.relative_to(CSRC)) for p in _files()
                 if len(p.relative_to(CSRC).parts) != 2 or p.relative_to(CSRC).parts[0] not in FAMILIES]
    assert not misplaced, f"csrc files outside {FAMILIES}: {misplaced}"
    assert sorted(p.name for p in CSRC.iterdir() if p.is_dir()) == sorted(FAMILIES)


def test_every_file_is_named_by_its_build():
    cpu = set(cpu_ext.SOURCES + cpu_ext.HEADERS)
    cuda = set(cuda_ext.SOURCES + cuda_ext.HEADERS)
    on_disk = {p.relative_to(CSRC).as_posix() for p in _files()}
    assert on_disk == cpu | cuda, f"not named by a build: {on_disk - cpu - cuda}; missing: {(cpu | cuda) - on_disk}"
    assert all(name.startswith(("cpu/", "common/")) for name in cpu), sorted(cpu)
    assert all(name.startswith(("cuda/", "common/")) for name in cuda), sorted(cuda)
    common = {p.relative_to(CSRC).as_posix() for p in (CSRC / "common").iterdir()}
    assert common <= cpu and common <= cuda, "a common/ header that one family's build does not hash"


def test_every_folder_is_installed():
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib

    data_files = tomllib.loads(_text(ROOT / "pyproject.toml"))["tool"]["setuptools"]["data-files"]
    installed = {target: patterns for target, patterns in data_files.items() if "csrc" in target}
    want = {(jit.INSTALLED_SOURCES / family).as_posix(): [f"csrc/{family}/*"] for family in FAMILIES}
    assert installed == want


def test_quoted_includes_resolve_from_the_including_file():
    unresolved = []
    for path in _files():
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', _text(path), flags=re.M):
            if not (path.parent / name).is_file():
                unresolved.append(f"{path.relative_to(CSRC)}: {name}")
    assert not unresolved


def test_argument_structs_are_defined_once_in_common():
    for struct in ARG_STRUCTS:
        where = [(p.relative_to(CSRC).as_posix(), n) for p in _files()
                 if (n := len(re.findall(rf"\bstruct\s+{struct}\s*\{{", _text(p))))]
        assert where == [("common/chunked_kv_args.h", 1)], f"struct {struct} defined in {where}"
    for family_header in ("cpu/chunked_kv_cpu.h", "cuda/chunked_kv.h"):
        assert '#include "../common/chunked_kv_args.h"' in _text(CSRC / family_header)


def test_argument_structs_are_filled_once_in_common():
    """Declaring a struct's variable (``WriteArgs a{};``) is where it is filled:
    only the shared helpers of common/chunked_kv_binding.h do."""
    pattern = re.compile(rf"\b({'|'.join(ARG_STRUCTS)})\s+\w+\s*(\{{\s*\}}|;)")
    where = {}
    for path in _files():
        for match in pattern.finditer(_text(path)):
            where.setdefault(match.group(1), []).append(path.relative_to(CSRC).as_posix())
    assert where == {struct: ["common/chunked_kv_binding.h"] for struct in ARG_STRUCTS}


def _exists(name: str) -> bool:
    if "/" not in name:  # a bare file name: somewhere in the package, the tests or the benchmarks
        return any(any(top.rglob(name)) for top in (ROOT / "vllm_chunked_kv", ROOT / "tests", ROOT / "benchmarks"))
    return (ROOT / name).is_file() or (ROOT / "vllm_chunked_kv" / name).is_file()


def test_named_python_files_exist():
    named = {(p.relative_to(CSRC).as_posix(), name) for p in _files()
             for name in re.findall(r"[\w./-]*\w\.py\b", _text(p))}
    assert named, "no Python file named in csrc/ (the pattern is broken)"
    stale = sorted(f"{where}: {name}" for where, name in named if not _exists(name))
    assert not stale, stale
