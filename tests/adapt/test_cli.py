"""Contract of `vllm-chunked-kv adapt` end to end, on the tiny test Llama for a few steps.

- The command writes a model directory that vLLM serves with CHUNKED_KV in
  the settings of its `chunked_kv_serve.json` (the backend is seen running),
  with the merged weights (attention projections changed, everything else
  identical to the base), the adapter alone, a checkpoint and ADAPT.md (with
  the time and the peak memory of the run); the
  last line of standard output is the directory.
- With `--learn-gains` the serve file says pooling "gated" with the gains
  the run learned (also in `adapter/adapter.json`), and vLLM serves that.
- Bad settings stop it before training with one line naming the problem.
- A hybrid model (tiny Gemma 3: sliding-window and global layers) is
  accepted: a short run lowers the loss, and the directory serves with
  CHUNKED_KV on its global layers and vLLM's default backend on its sliding
  ones.
"""

from __future__ import annotations

import json
import re

import pytest
from safetensors.torch import load_file

from vllm_chunked_kv.commands.main import main
from vllm_chunked_kv.core.serve_file import SERVE_FILE, read_serve_config
from vllm_chunked_kv.runner.engine import generate

pytestmark = [pytest.mark.slow, pytest.mark.engine]

SETTINGS = {"chunked_kv": {"chunk_size": 4, "window": 16, "sink_tokens": 4, "stagger": "layers"}}


@pytest.fixture(scope="module")
def adapted(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("adapted")
    argv = ["adapt", str(tiny_llama), "--out", str(out), "--steps", "3", "--length", "384", "--lr", "0.01",
            "--eval-every", "2", "--eval-prompts", "2", "--threads", "1", "--config", json.dumps(SETTINGS)]
    return out, argv


def test_adapt_writes_a_servable_directory(adapted, tiny_llama, capsys):
    out, argv = adapted
    assert main(argv) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out)
    for name in ("config.json", "model.safetensors", "tokenizer.json", SERVE_FILE, "ADAPT.md",
                 "adapter/adapter.safetensors", "adapter/adapter.json", "work/checkpoint.pt"):
        assert (out / name).is_file(), name
    assert read_serve_config(out).stagger == "layers" and read_serve_config(out).window == 16
    report = (out / "ADAPT.md").read_text()
    assert "probe" in report and re.search(r"peak resident memory \d+\.\d GiB", report)
    base, merged = load_file(str(tiny_llama / "model.safetensors")), load_file(str(out / "model.safetensors"))
    changed = {k for k in base if not base[k].float().equal(merged[k].float())}
    assert changed and all(k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")) for k in changed)

    serve = json.loads((out / SERVE_FILE).read_text())
    engine = {"attention_backend": serve["attention_backend"], "additional_config": serve["additional_config"]}
    result = generate(str(out), engine, [[[5 + i % 200 for i in range(60)]]], max_tokens=4)
    assert len(result["outputs"][0][0]) == 4
    assert "Using CHUNKED_KV attention backend" in result["log"]


def test_learned_gains_are_what_the_directory_is_served_with(tiny_llama, tmp_path, capsys):
    out = tmp_path / "gated"
    argv = ["adapt", str(tiny_llama), "--out", str(out), "--steps", "2", "--length", "384", "--lr", "0.01",
            "--threads", "1", "--learn-gains", "--config", json.dumps(SETTINGS)]
    assert main(argv) == 0
    gains = json.loads((out / "adapter" / "adapter.json").read_text())["slot_gains"]
    served = read_serve_config(out)
    assert served.pooling == "gated" and served.slot_gains == gains and len(gains) == 4
    assert served.stagger == "layers" and served.window == 16
    assert "gated" in (out / "ADAPT.md").read_text()
    serve = json.loads((out / SERVE_FILE).read_text())
    result = generate(str(out), {"attention_backend": serve["attention_backend"],
                                 "additional_config": serve["additional_config"]}, [[[7 + i % 200 for i in range(60)]]],
                      max_tokens=2)
    assert len(result["outputs"][0][0]) == 2 and "Using CHUNKED_KV attention backend" in result["log"]


def test_bad_settings_stop_before_training(tiny_llama, tmp_path, capsys):
    bad = ["adapt", str(tiny_llama), "--out", str(tmp_path / "x"), "--config", '{"chunk_size": 4}']
    assert main(bad) == 1
    assert "chunked_kv" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    worse = ["adapt", str(tiny_llama), "--out", str(tmp_path / "y"), "--config", '{"chunked_kv": {"window": 0}}']
    assert main(worse) == 1
    assert "window" in capsys.readouterr().err
    overlap = {"chunked_kv": {**SETTINGS["chunked_kv"], "mitigation": "overlap", "stagger": "none"}}
    gated = ["adapt", str(tiny_llama), "--out", str(tmp_path / "z"), "--learn-gains", "--config", json.dumps(overlap)]
    assert main(gated) == 1
    assert "learn_gains" in capsys.readouterr().err
    assert not (tmp_path / "z").exists()


def test_adapt_accepts_a_hybrid_model(tiny_gemma3, tmp_path, capsys):
    out = tmp_path / "adapted-gemma3"
    argv = ["adapt", str(tiny_gemma3), "--out", str(out), "--steps", "16", "--length", "384", "--lr", "0.01",
            "--threads", "1", "--config", json.dumps({"chunked_kv": {"chunk_size": 4, "window": 16}})]
    assert main(argv) == 0
    log = [json.loads(line) for line in (out / "work" / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 16
    first, last = (sum(r["loss"] for r in part) / len(part) for part in (log[:4], log[-4:]))
    assert last < first, (first, last)
    serve = json.loads((out / SERVE_FILE).read_text())
    engine = {"attention_backend": serve["attention_backend"], "additional_config": serve["additional_config"]}
    result = generate(str(out), engine, [[[5 + i % 200 for i in range(60)]]], max_tokens=4)
    assert len(result["outputs"][0][0]) == 4
    assert "Using CHUNKED_KV attention backend" in result["log"]
    assert "sliding-window layers keep their window uncompressed" in result["log"]

