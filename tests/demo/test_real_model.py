"""Contract of the real-model demo rows (`demo.real_model`, `demo --model NAME`).

- The rows are the default backend and every mitigation at chunk 4,
  window 128, 4 sinks (plus key_norm pooling), and, when an adapted
  directory is given, its default-backend row, the settings of its
  `chunked_kv_serve.json`, and `none`.
- A needle probe of the shipped prose task against a real `vllm serve`
  (tiny test model, CHUNKED_KV) gives a summary with every phase, and the
  table shows it with its intervals. Its needles are placed for the table's
  128-token window whatever the server reports, so every row scans the
  same prompts.
- With `--context N` the needles span position 16 to LONG_WINDOW + 32
  tokens before the end of ~N-token prompts, placed for a window of
  LONG_WINDOW (beyond a 512-token model sliding window); a context too
  short for that is refused.
- An unknown model name stops the demo with one line naming the known ones.
"""

from __future__ import annotations

import json

import pytest

from vllm_chunked_kv.demo import cli as demo_cli
from vllm_chunked_kv.demo import real_model
from vllm_chunked_kv.core.serve_file import SERVE_FILE
from vllm_chunked_kv.runner.server import ONE_PROCESS_ARGS


def test_modes_cover_every_mitigation_and_the_adapted_rows(tmp_path):
    names = [m[0] for m in real_model.modes_for(None)]
    assert names == list(real_model.MODES)
    settings = {"chunk_size": 4, "window": 128, "sink_tokens": 4, "stagger": "heads"}
    (tmp_path / SERVE_FILE).write_text(json.dumps({"attention_backend": "chunked_kv",
                                                   "additional_config": {"chunked_kv": settings}}))
    adapted = real_model.modes_for(tmp_path)[len(names):]
    assert [m[1] for m in adapted] == [tmp_path] * 3
    assert [m[2] for m in adapted] == [None, settings, {**real_model.CHUNKED, "mitigation": "none"}]
    assert all("," not in m[0] for m in real_model.modes_for(tmp_path))  # --modes splits on commas


@pytest.mark.slow
@pytest.mark.server
def test_scan_of_a_served_model(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setattr(real_model, "SERVE_DEFAULTS", ONE_PROCESS_ARGS)
    settings = {**real_model.CHUNKED, "window": 32}
    summary = real_model.scan_mode(tiny_llama, settings, 4, tmp_path / "scan")
    needle = summary["results"]["needle"]
    assert needle["probes"] == 16 and [p["phase"] for p in needle["by_phase"]] == [0, 1, 2, 3]
    # Placed for the table's window (not an assumed 512-token one), and judged by
    # the server's own, which its config route reported (the launcher allowlists
    # the project's endpoint plugin): every needle compressed, no filler added
    # after the record beyond the task's own.
    placed, judged = summary["settings"]["placement"], needle["window"]
    assert (placed["source"], placed["window"]) == ("--window", real_model.CHUNKED["window"])
    assert (judged["source"], judged["window"]) == ("server", settings["window"])
    assert judged["inside"]["n"] == 0 and placed["min_distance"] <= judged["distance_min"] < 400
    row = {"mode": "x", "rows_per_4": real_model.rows_per_4(settings), "accuracy_ci": [0.0, 0.2], "needle": needle}
    table = real_model.format_table([row])
    assert "| x | 1 |" in table and "[0.0, 20.0]" in table


def test_unknown_model_name_is_one_line(capsys):
    parser = __import__("argparse").ArgumentParser()
    demo_cli.add_arguments(parser)
    assert demo_cli.run(parser.parse_args(["--model", "no-such-model"])) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "smollm2-135m" in err[0]


def test_long_prompts_put_needles_beyond_a_model_sliding_window():
    assert real_model.placement(None) == (real_model.NEEDLE_RANGE, real_model.CHUNKED["window"])
    needles, window = real_model.placement(4096)
    lo, hi = map(int, needles.split(":"))
    assert (lo, window) == (16, real_model.LONG_WINDOW) and window > 512
    assert hi + window + 32 == 4096
    with pytest.raises(ValueError, match="too short"):
        real_model.placement(800)
