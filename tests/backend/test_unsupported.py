"""Combinations CHUNKED_KV cannot serve stop `vllm serve` at startup: non-zero
exit, no traceback, and one `error:` line that says what is unsupported and
why. Covered: a block size that cannot hold whole chunks, a window smaller
than a chunk, a model with its own sliding window on every layer, KV connectors, the
hybrid KV cache manager turned off, and
speculative decoding, and settings outside their "chunked_kv" wrapper
(which would otherwise run the defaults silently); speculative decoding
again with CHUNKED_KV chosen through `backend_per_kind`, refused with the
same line. A server selecting
chunked_kv with no "chunked_kv" section logs the defaults it runs with,
once."""

from __future__ import annotations

import json
import shutil

import pytest

from vllm_chunked_kv.runner.server import run_serve_expecting_failure

pytestmark = [pytest.mark.server, pytest.mark.slow]

CHUNKED = ["--attention-backend", "chunked_kv"]
CASES = {
    "block size": (
        ["--block-size", "16", "--additional-config", json.dumps({"chunked_kv": {"chunk_size": 6}})],
        "--block-size 16 must be a multiple of hop 6",
    ),
    "window below chunk": (
        ["--additional-config", json.dumps({"chunked_kv": {"chunk_size": 8, "window": 4}})],
        "chunked_kv.window: must be >= chunk_size 8",
    ),
    "kv connector": (
        ["--kv-transfer-config", json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both"})],
        "KV connectors (--kv-transfer-config) are not supported",
    ),
    "no hybrid manager": (["--disable-hybrid-kv-cache-manager"], "--disable-hybrid-kv-cache-manager is not supported"),
    "speculative decoding": (
        ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})],
        "speculative decoding (--speculative-config) is not supported",
    ),
    "model sliding window": ([], "every layer of the model keeps its own sliding window (32 tokens)"),
    "settings without their wrapper": (
        ["--additional-config", json.dumps({"chunk_size": 5})],
        "'chunk_size' is at the top level of --additional-config; it belongs under \"chunked_kv\"",
    ),
}


@pytest.fixture(scope="module")
def sliding_window_model(tiny_qwen, tmp_path_factory):
    """tiny-qwen with Qwen2's own sliding window switched on, on every layer."""
    path = tmp_path_factory.mktemp("sliding") / "tiny-qwen-sliding"
    shutil.copytree(tiny_qwen, path)
    config = json.loads((path / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=32, max_window_layers=0,
                  layer_types=["sliding_attention"] * config["num_hidden_layers"])
    (path / "config.json").write_text(json.dumps(config))
    return path


PER_KIND = ["--attention-config", json.dumps({"backend_per_kind": {"full_attention": "CHUNKED_KV"}})]
PER_KIND_SPECULATIVE = "speculative decoding, CHUNKED_KV per kind"


@pytest.fixture(scope="module")
def failures(tiny_llama, sliding_window_model):
    def run(case):
        if case == PER_KIND_SPECULATIVE:
            return run_serve_expecting_failure(tiny_llama, PER_KIND + CASES["speculative decoding"][0])
        model = sliding_window_model if case == "model sliding window" else tiny_llama
        return run_serve_expecting_failure(model, CHUNKED + CASES[case][0])

    return {case: run(case) for case in [*CASES, PER_KIND_SPECULATIVE]}


@pytest.mark.parametrize("case", list(CASES))
def test_unsupported_combination_is_one_line(case, failures):
    proc = failures[case]
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Traceback" not in output, output[-3000:]
    error_lines = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1, output[-3000:]
    assert CASES[case][1] in error_lines[0]


def _errors(proc) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error: ")]


def test_the_per_kind_route_gets_the_same_checks(failures):
    """CHUNKED_KV chosen per KV-cache group kind, not by --attention-backend:
    speculative decoding is refused with the very line of the other route."""
    proc = failures[PER_KIND_SPECULATIVE]
    assert proc.returncode != 0 and "Traceback" not in proc.stdout + proc.stderr
    assert _errors(proc) == _errors(failures["speculative decoding"]) and len(_errors(proc)) == 1


@pytest.mark.parametrize("case", [case for case, (args, _) in CASES.items() if "--additional-config" not in args])
def test_defaults_are_logged_once_without_settings(case, failures):
    output = failures[case].stdout + failures[case].stderr
    assert output.count('no "chunked_kv" section in --additional-config; running with the defaults') == 1, output[-3000:]
