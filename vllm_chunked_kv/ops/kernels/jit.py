"""Build an optional extension once per process, falling back loudly once.

The CUDA extension (`cuda_ext.py`) and the C++ CPU kernels (`cpu_ext.py`)
are JIT-built with ``torch.utils.cpp_extension.load`` on first use. Each
keeps a state dict ``{"tried", "module", "reason"}``; `load_once` fills it:
a reason not to build (the blocker) is recorded without building, a failed
build or import is one ``RuntimeWarning`` naming the cause (its last line),
and either way the module stays None for the rest of the process.
"""

from __future__ import annotations

import sysconfig
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

INSTALLED_SOURCES = Path("share", "vllm-chunked-kv", "csrc")  # under the environment's prefix (pyproject data-files)


def _sources_dir() -> Path:
    """``csrc/`` of a source checkout, else the copy a wheel installs under
    the environment's prefix."""
    checkout = Path(__file__).resolve().parents[3] / "csrc"
    if checkout.is_dir():
        return checkout
    return Path(sysconfig.get_path("data")) / INSTALLED_SOURCES


SOURCES_DIR = _sources_dir()  # both extensions' sources: csrc/ of a checkout, or the copy a wheel installs


def load_once(state: dict, blocker: Callable[[], str | None], build: Callable[[], ModuleType], what: str,
              fallback: str) -> ModuleType | None:
    """``state["module"]`` after the first call's attempt: `build()` unless
    `blocker()` names a reason; `what` names the build in the reason, and
    `fallback` what runs instead in the warning."""
    if state["tried"]:
        return state["module"]
    state["tried"] = True
    reason = blocker()
    if reason is not None:
        state["reason"] = reason
        return None
    try:
        state["module"] = build()
    except Exception as exc:  # any build or import failure: fall back, once, loudly
        cause = (str(exc).strip().splitlines() or [""])[-1][:300]
        state["reason"] = f"building {what} failed: {type(exc).__name__}: {cause}"
        warnings.warn(f"vllm-chunked-kv: {state['reason']}; {fallback}", RuntimeWarning, stacklevel=3)
    return state["module"]


def require(state: dict, load: Callable[[], ModuleType | None], what: str) -> ModuleType:
    """The loaded module, or a RuntimeError with the reason it is unavailable."""
    module = load()
    if module is None:
        raise RuntimeError(f"{what} unavailable: {state['reason']}")
    return module
