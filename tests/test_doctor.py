"""`vllm-chunked-kv doctor` says, without a server, which implementation
would run and why the others cannot: on this CPU machine PyTorch, with the
reasons for CUDA and Triton; a forced implementation that cannot run is a
non-zero exit naming it. The vLLM line compares with the tested release."""

from __future__ import annotations

from vllm_chunked_kv.cli import main
from vllm_chunked_kv.integration import compat


def test_doctor_on_cpu(capsys):
    assert main(["doctor", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"vllm {compat.vllm_version()} (tested with {compat.TESTED_VLLM}")
    lines = {line.split()[0]: line for line in out[2:5]}
    assert lines["torch"].endswith("can run")
    assert "cannot run" in lines["cuda"] and "CUDA device" in lines["cuda"]
    assert "cannot run" in lines["triton"]
    assert out[-1] == "chosen on cpu: torch"


def test_doctor_reports_a_forced_implementation_that_cannot_run(capsys, monkeypatch):
    monkeypatch.setenv("CHUNKED_KV_IMPL", "cuda")
    assert main(["doctor", "--device", "cpu"]) == 1
    assert "cuda" in capsys.readouterr().out.splitlines()[-1]


def test_version_warning_names_both_versions():
    assert compat.version_warning(compat.TESTED_VLLM) is None
    assert compat.version_warning(compat.TESTED_VLLM + "+cpu") is None
    warning = compat.version_warning("0.33.1")
    assert "0.33.1" in warning and compat.TESTED_VLLM in warning
