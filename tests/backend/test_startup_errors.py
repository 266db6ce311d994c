"""A bad `--additional-config '{"chunked_kv": ...}'` stops `vllm serve` before
it loads the model: non-zero exit, no traceback, and one `error:` line that
names the offending field. (vLLM's command line runs in a forked process that
imported vLLM once: `runner.server.run_serve_expecting_failure`.)"""

from __future__ import annotations

import json

import pytest

from vllm_chunked_kv.runner.server import run_serve_expecting_failure

pytestmark = [pytest.mark.server, pytest.mark.slow]

BAD = {
    "unknown key": ({"chunk_sizes": 4}, "unknown key 'chunk_sizes'"),
    "chunk_size 0": ({"chunk_size": 0}, "chunked_kv.chunk_size"),
    "hop > chunk_size": ({"chunk_size": 4, "hop": 8}, "chunked_kv.hop"),
    "slot_gains length": ({"pooling": "gated", "slot_gains": [1.0, 2.0]}, "chunked_kv.slot_gains"),
    "unknown preset": ({"mitigation": "halve"}, "chunked_kv.mitigation"),
    "per-layer gains for 1 of 2 layers": ({"pooling": "gated", "slot_gains": [[1.0, 1.0, 1.0, 1.0]]},
                                          "chunked_kv.slot_gains: needs one list per layer"),
    "stagger for 3 of 2 layers": ({"stagger": [[0], [1], [2]]}, "chunked_kv.stagger: needs one list per layer"),
}


@pytest.fixture(scope="module")
def failures(tiny_llama):
    def run(settings):
        args = ["--attention-backend", "chunked_kv", "--additional-config", json.dumps({"chunked_kv": settings})]
        return run_serve_expecting_failure(tiny_llama, args)

    return {case: run(settings) for case, (settings, _) in BAD.items()}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_value_is_one_line(case, failures):
    proc = failures[case]
    expected = BAD[case][1]
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Traceback" not in output
    error_lines = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1, output[-2000:]
    assert expected in error_lines[0]
