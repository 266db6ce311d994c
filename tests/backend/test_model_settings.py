"""A model directory that carries `chunked_kv_serve.json` is served with its
settings by `--attention-backend chunked_kv` alone (`registration`,
`core/serve_file.py`): the startup log names the file and the settings it
gave, and the greedy tokens of a prompt far past the window equal those of
the explicit `--additional-config` form. An explicit section wins over the
file, and the log says the file was not read. The per-kind route
(``--attention-config '{"backend_per_kind": {"full_attention": "CHUNKED_KV"}}'``)
reads the file the same way and gives the same tokens. Served with no route
to CHUNKED_KV, the file is not read and the log says so in one line.
In-process engines, one per form."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.core.serve_file import SERVE_FILE, serve_settings, write_serve_file
from vllm_chunked_kv.models.tiny import vocabulary
from vllm_chunked_kv.runner.engine import generate

pytestmark = pytest.mark.engine

FILE_SETTINGS = ChunkedKVConfig(chunk_size=4, window=16, sink_tokens=2, mitigation="boundary")
EXPLICIT = {"chunked_kv": {"chunk_size": 2, "window": 8}}


@pytest.fixture(scope="module")
def carrying_model(tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("carrying") / "tiny-llama"
    shutil.copytree(tiny_llama, path)
    write_serve_file(path, FILE_SETTINGS)
    return path


@pytest.fixture(scope="module")
def prompt():
    rng = random.Random(7)
    vocab = vocabulary()
    words = [i for i, w in enumerate(vocab) if w.startswith("w")]
    return [vocab.index("<bos>")] + rng.choices(words, k=300)


@pytest.fixture(scope="module")
def alone(carrying_model, prompt):
    """The carrying directory served by `--attention-backend chunked_kv` alone."""
    return generate(str(carrying_model), {"attention_backend": "chunked_kv"}, [[prompt]])


def _logged_settings(log: str, source: str) -> dict:
    (line,) = [line for line in log.splitlines() if f"chunked_kv: {source}: " in line]
    return json.loads(line.split(f"chunked_kv: {source}: ", 1)[1])


def test_the_file_alone_serves_as_the_explicit_form(carrying_model, tiny_llama, prompt, alone):
    source = f'settings from {carrying_model / SERVE_FILE} (no "chunked_kv" section in --additional-config)'
    logged = ChunkedKVConfig(**{k: v for k, v in _logged_settings(alone["log"], source).items()
                                if k in ChunkedKVConfig.model_fields})
    assert serve_settings(logged) == serve_settings(FILE_SETTINGS)
    explicit = json.loads((carrying_model / SERVE_FILE).read_text())["additional_config"]
    spelled = generate(str(tiny_llama), {"attention_backend": "chunked_kv", "additional_config": explicit}, [[prompt]])
    assert "Using CHUNKED_KV attention backend" in alone["log"]
    assert alone["outputs"] == spelled["outputs"]


PER_KIND = {"attention_config": {"backend_per_kind": {"full_attention": "CHUNKED_KV"}}}


def test_the_per_kind_route_reads_the_file_too(carrying_model, prompt, alone):
    per_kind = generate(str(carrying_model), PER_KIND, [[prompt]])
    source = f'settings from {carrying_model / SERVE_FILE} (no "chunked_kv" section in --additional-config)'
    logged = ChunkedKVConfig(**{k: v for k, v in _logged_settings(per_kind["log"], source).items()
                                if k in ChunkedKVConfig.model_fields})
    assert serve_settings(logged) == serve_settings(FILE_SETTINGS)
    assert "Using CHUNKED_KV attention backend" in per_kind["log"]
    assert per_kind["outputs"] == alone["outputs"]


def test_an_explicit_section_wins_over_the_file(carrying_model, prompt):
    result = generate(str(carrying_model), {"attention_backend": "chunked_kv", "additional_config": EXPLICIT},
                      [[prompt]])
    source = f"settings from --additional-config ({carrying_model / SERVE_FILE} is not read: the explicit section wins)"
    logged = _logged_settings(result["log"], source)
    assert (logged["chunk_size"], logged["window"]) == (2, 8)


def test_a_file_no_route_honours_is_named(carrying_model, prompt):
    result = generate(str(carrying_model), {}, [[prompt]])
    lines = [line for line in result["log"].splitlines() if "is not read: no layer runs on CHUNKED_KV" in line]
    assert len(lines) == 1 and str(carrying_model / SERVE_FILE) in lines[0]
    assert "Using CHUNKED_KV attention backend" not in result["log"]
