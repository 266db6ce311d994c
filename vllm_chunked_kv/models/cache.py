"""Where fetched models live, and how a directory appears there atomically.

    <cache>/models/<name>            a complete model directory, or nothing
    <cache>/models/.<name>.*.partial a fetch in progress (never accepted)
    <cache>/models/.<name>.lock      held while a fetch checks and builds <name>

`<cache>` is `$CHUNKED_KV_CACHE`, else `~/.cache/vllm-chunked-kv`
(`$VLLM_CHUNKED_KV_CACHE`, its former name, is still read, but vLLM warns
about every `VLLM_*` variable it does not know, at every start). A
fetch builds everything inside its own `.partial` sibling and renames the
finished directory into place, so an interrupted run leaves no directory a
later call would accept (a killed one may leave a `.partial` behind, which
is safe to delete). Two fetches of one model at once (two servers starting,
two test workers) take turns on its lock: the second finds the first's
directory instead of downloading and converting it again.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

ENV_CACHE = "CHUNKED_KV_CACHE"
FORMER_ENV_CACHE = "VLLM_CHUNKED_KV_CACHE"
DEFAULT_CACHE = Path("~/.cache/vllm-chunked-kv")
COMPLETE_MARKER = "config.json"  # every published model directory has one


def configured() -> str | None:
    """The cache directory the environment names ($CHUNKED_KV_CACHE, else its former name), or None."""
    return os.environ.get(ENV_CACHE) or os.environ.get(FORMER_ENV_CACHE) or None


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache directory: the argument, else the environment's (`configured`), else the default."""
    if cache_dir is None:
        cache_dir = configured() or DEFAULT_CACHE
    return Path(cache_dir).expanduser()


def model_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    return cache_root(cache_dir) / "models" / name


def is_complete(path: Path) -> bool:
    """A published directory (only complete ones are ever renamed into place)."""
    return (path / COMPLETE_MARKER).is_file()


@contextlib.contextmanager
def exclusive(target: Path) -> Iterator[None]:
    """Hold `target`'s lock file (`.<name>.lock` beside it) for the block; a process
    holding it already makes this wait. The file stays: removing it would let a third
    fetch lock a new file while a second still waits on the old one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def staging(target: Path) -> Iterator[Path]:
    """A fresh work directory next to `target`, removed on exit whatever happens.

    Build the model in `<work>/out`, then call `publish(<work>/out, target)`
    inside the block; everything else under `<work>` (downloads, scratch)
    goes away with it.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def publish(built: Path, target: Path, *, replace: bool = False) -> Path:
    """Rename the finished directory `built` to `target` (same file system).

    If another fetch published `target` first, its copy wins and ours is
    dropped with the staging directory. With `replace`, an existing `target`
    is moved aside first and deleted after the swap.
    """
    old = None
    if target.exists() and (replace or not is_complete(target)):
        old = built.parent / "replaced"
        os.rename(target, old)
    try:
        os.rename(built, target)
    except OSError:
        if old is not None:
            os.rename(old, target)  # put the replaced copy back
            raise
        if not is_complete(target):
            raise
        # else another fetch published a complete copy first: keep that one
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target
