"""`chunked_kv_serve.json` (`core/serve_file.py`): what `write_serve_file`
writes, `read_serve_config` reads back as the same attention (`serve_settings`:
the preset is written as the values it sets), and
`settings_source` decides where a server's settings come from: an explicit
"chunked_kv" section of --additional-config wins over the model directory's
file (and says the file is not read), the file is taken when there is no
section (and named again when a process reads the config it was put into),
and with neither the defaults run; each case says so in one line.
A file that cannot be read stops startup with a one-line error naming it."""

from __future__ import annotations

import json

import pytest

from vllm_chunked_kv.core.config import ChunkedKVConfig, ChunkedKVConfigError
from vllm_chunked_kv.core.serve_file import (SERVE_FILE, TAKEN_FROM, read_serve_config, serve_settings,
                                             settings_source, write_serve_file)

SETTINGS = dict(chunk_size=4, window=24, sink_tokens=2, mitigation="boundary")


@pytest.fixture
def model_dir(tmp_path):
    write_serve_file(tmp_path, ChunkedKVConfig(**SETTINGS))
    return tmp_path


def test_written_file_reads_back_as_the_same_settings(model_dir):
    assert serve_settings(read_serve_config(model_dir)) == serve_settings(ChunkedKVConfig(**SETTINGS))
    assert json.loads((model_dir / SERVE_FILE).read_text())["attention_backend"] == "chunked_kv"


def test_the_file_is_taken_without_a_section(model_dir):
    from_file = f'settings from {model_dir / SERVE_FILE} (no "chunked_kv" section in --additional-config)'
    for additional in (None, {}, {"other_plugin": 1}):
        additions, source = settings_source(additional, str(model_dir))
        assert serve_settings(ChunkedKVConfig(**additions["chunked_kv"])) == serve_settings(ChunkedKVConfig(**SETTINGS))
        assert additions[TAKEN_FROM] == str(model_dir / SERVE_FILE) and source == from_file
        # a process that reads the config again (vLLM's engine core) still names the file
        assert settings_source({**(additional or {}), **additions}, str(model_dir)) == (None, from_file)


def test_an_explicit_section_wins(model_dir):
    section, source = settings_source({"chunked_kv": {"chunk_size": 2}}, str(model_dir))
    assert section is None
    assert source == f"settings from --additional-config ({model_dir / SERVE_FILE} is not read: the explicit section wins)"


def test_defaults_without_either(tmp_path):
    for model in (str(tmp_path), "HuggingFaceTB/SmolLM2-135M", None):
        assert settings_source({}, model) == (
            None, 'no "chunked_kv" section in --additional-config; running with the defaults')
    assert settings_source({"chunked_kv": {}}, str(tmp_path)) == (None, "settings from --additional-config")


def test_an_unreadable_file_is_one_error(tmp_path):
    (tmp_path / SERVE_FILE).write_text('{"attention_backend": "chunked_kv"}')
    with pytest.raises(ChunkedKVConfigError, match=f"cannot read {tmp_path / SERVE_FILE}"):
        settings_source(None, str(tmp_path))
