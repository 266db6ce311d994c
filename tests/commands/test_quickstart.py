"""`vllm-chunked-kv quickstart` is the product working on a shipped default:

- it finds the shipped demo model inside the installed package
  (`vllm_chunked_kv.demo.DEFAULT_MODEL_DIR`, the one definition the demo
  uses too), wherever the command is run from;
- it serves that model with a real `vllm serve` subprocess and
  `--attention-backend chunked_kv`, asks it one key-value lookup whose record
  lies in a pooled chunk, prints the answer, and exits 0 only when the answer
  is the expected one and the server's log shows CHUNKED_KV running;
- without the model's `config.json` it exits 1 with an `error:` line naming
  the directory, before starting any server (never a stand-in model); with a
  torchvision that cannot load next to this torch (`vllm serve` would die
  importing it) it exits 1 with the fix in one `error:` line, no server;
- the README's first code block sends the same question with `curl` and shows
  the same answer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_chunked_kv
from vllm_chunked_kv import demo
from vllm_chunked_kv.commands import quickstart
from vllm_chunked_kv.commands.main import main

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_model_is_found_inside_the_package():
    path = demo.shipped_model()
    assert path == demo.DEFAULT_MODEL_DIR
    assert (path / "config.json").is_file()
    assert path.resolve().parent.parent == Path(vllm_chunked_kv.__file__).resolve().parent
    from vllm_chunked_kv.demo import cli, evaluate

    assert cli.DEFAULT_MODEL_DIR is demo.DEFAULT_MODEL_DIR is evaluate.DEFAULT_MODEL_DIR


def test_missing_model_fails_loudly(monkeypatch, tmp_path, capsys):
    missing = tmp_path / "model"
    missing.mkdir()
    monkeypatch.setattr(demo, "DEFAULT_MODEL_DIR", missing)
    with pytest.raises(FileNotFoundError, match="config.json"):
        demo.shipped_model()
    assert main(["quickstart"]) == 1  # no server started: conftest refuses `vllm serve` in an unmarked test
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(missing) in err and "config.json" in err


def test_a_torchvision_that_cannot_load_stops_it_with_the_fix(capsys, broken_torchvision):
    from vllm_chunked_kv.runner import companions

    assert main(["quickstart"]) == 1  # no server started: conftest refuses `vllm serve` in an unmarked test
    assert capsys.readouterr().err.splitlines() == [
        f"error: torchvision 0.28.0 does not load: RuntimeError: {broken_torchvision}: "
        f"vLLM and transformers cannot start next to it; {companions.FIX}"]


def test_the_question_lies_in_a_pooled_chunk():
    text, answer = quickstart.demo_question()
    words = text.split()
    target = quickstart.QUESTION_SPEC["target_position"]  # position of the value; <bos> is position 0
    assert words[-2:] == ["?", words[target - 2]] and words[target - 1] == answer
    settings, last = quickstart.DEMO_SETTINGS, len(words)  # the last prompt token's position
    chunk = (target - 1) // settings["chunk_size"]  # the key and its value share one chunk
    assert chunk == target // settings["chunk_size"]
    assert (chunk + 1) * settings["chunk_size"] - 1 <= last - settings["window"]  # sealed
    assert chunk * settings["chunk_size"] >= settings["sink_tokens"]  # not a sink


def test_readme_sends_the_same_question():
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    text, answer = quickstart.demo_question()
    assert f'"prompt": {json.dumps(text)}' in first_block
    assert f'# "text":" {answer}"' in first_block
    assert json.dumps(quickstart.DEMO_SETTINGS) in first_block


@pytest.mark.server
@pytest.mark.slow
def test_quickstart_end_to_end(tmp_path):
    script = Path(sys.executable).with_name("vllm-chunked-kv")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "vllm_chunked_kv.commands.main"]
    done = subprocess.run([*command, "quickstart"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    text, answer = quickstart.demo_question()
    lines = done.stdout.splitlines()
    assert lines == [f"question: {text}", f"answer:   {answer}   (expected {answer})", "backend:  CHUNKED_KV"]
