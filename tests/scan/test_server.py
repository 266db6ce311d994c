"""Contract of the scanner against a real `vllm serve` of the tiny test model on 127.0.0.1.

- All three probes run end to end in token units (vLLM's /tokenize, token-id
  prompts): every probe is answered and recorded, and with a word-level
  tokenizer every target lands at its planned phase (position accounting
  with the server's real <bos> is right).
- Resuming against the live server sends nothing twice.
- `--feedback` posts through the project's feedback route when the plugins
  are enabled, and every post is accepted.

The server runs the model in its engine's process (`ONE_PROCESS`: no worker
process, as its log shows), which starts faster; the layout users get is
served in tests/serving/test_serve.py.
"""

from __future__ import annotations

import json

import pytest

from vllm_chunked_kv.commands.main import main
from vllm_chunked_kv.runner.server import ONE_PROCESS_ARGS, VllmServer

pytestmark = [pytest.mark.server, pytest.mark.slow]

ARGS = ["--kv-haystack-len", "64", "--kv-records", "8", "--prompts", "4", "--per-phase", "8", "--max-tokens", "2",
        "--no-progress", "--json", "--retries", "1", "--backoff", "0.1"]


def test_all_probes_end_to_end(tiny_llama, tmp_path, capsys):
    out = str(tmp_path / "scan")
    with VllmServer(tiny_llama, defaults=ONE_PROCESS_ARGS) as server:
        code = main(["scan", "--base-url", f"{server.base_url}/v1", "--out", out, "--feedback", *ARGS])
        captured = capsys.readouterr()
        assert code == 0, captured.err + server.log_tail()
        summary = json.loads(captured.out)
        code = main(["scan", "--base-url", server.base_url, "--out", out, *ARGS])
        again = json.loads(capsys.readouterr().out)
    assert summary["units"] == "tokens"
    assert summary["model"] == str(tiny_llama)
    offset, needle = summary["results"]["offset"], summary["results"]["needle"]
    assert offset["probes"] == 4 * 2 * summary["hop"] and needle["probes"] == 4 * 8
    assert [row["offset"] for row in offset["by_offset"]] == list(range(2 * summary["hop"]))
    assert needle["off_plan"] == 0
    # Offset items put the value at the middle of the haystack: position 32, then 32 + k.
    hop = summary["hop"]
    assert summary["hop_source"] == "server"  # the project's config route reports it
    assert [row["phase"] for row in offset["by_offset"]] == [(32 + k) % hop for k in range(2 * hop)]
    length = summary["results"]["length"]
    assert length["probes"] == 4 * 2 * hop
    first = length["by_extra"][0]["length_phase"]  # one prompt length, grown one token per extra
    assert [row["length_phase"] for row in length["by_extra"]] == [(first + k) % hop for k in range(2 * hop)]
    total = offset["probes"] + needle["probes"] + length["probes"]
    assert summary["feedback"] == {"route": "present", "posted": total, "rejected": 0}
    assert code == 0 and (again["resumed"], again["sent"]) == (total, 0)
    assert again["results"] == summary["results"]
    log = server.log()
    assert "(EngineCore pid=" in log and "(Worker pid=" not in log  # the model ran in the engine's process
