"""`vllm-chunked-kv doctor` says, without a server, which implementation
would run and why the others cannot: on this CPU machine the C++ kernels
(with their instruction set, flags and library), with the reasons for CUDA
and Triton, and PyTorch when they are forbidden to build; a forced implementation that cannot run is a
non-zero exit naming it. A torchvision that cannot load next to this torch
(`vllm serve` would die importing it) is an `error:` line with the fix and a
non-zero exit. The vLLM line compares with the tested release.
For FP8 pages (`--kv-cache-dtype`) it names the dtype and the implementations
that cannot read them, and picks one that can."""

from __future__ import annotations

from vllm_chunked_kv.commands.main import main
from vllm_chunked_kv.backend import compat


def test_doctor_on_cpu(capsys):
    assert main(["doctor", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"vllm {compat.vllm_version()} (tested with {compat.TESTED_VLLM}")
    assert out[2] == "KV pages: auto"
    lines = {line.split()[0]: line for line in out[3:7]}
    assert lines["torch"].endswith("can run")
    assert "cannot run" in lines["cuda"] and "CUDA device" in lines["cuda"]
    assert "cannot run" in lines["triton"]
    assert lines["cpp"].startswith("cpp     can run (") and "-fopenmp" in lines["cpp"] and ".so" in lines["cpp"]
    assert out[-1] == "chosen on cpu: cpp"


def test_a_torchvision_that_cannot_load_is_named_with_the_fix(capsys, broken_torchvision):
    from vllm_chunked_kv.runner import companions

    line = (f"error: torchvision 0.28.0 does not load: RuntimeError: {broken_torchvision}: "
            f"vLLM and transformers cannot start next to it; {companions.FIX}")
    assert main(["doctor", "--device", "cpu"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == [line, "chosen on cpu: cpp"]


def test_doctor_without_the_cpp_kernels(capsys, monkeypatch):
    from vllm_chunked_kv.ops import dispatch
    from vllm_chunked_kv.ops.kernels import cpu_ext

    saved = dict(cpu_ext._state)
    monkeypatch.setenv(cpu_ext.BUILD_ENV, "0")
    cpu_ext._reset_for_tests()
    dispatch.clear_choices()
    try:
        assert main(["doctor", "--device", "cpu"]) == 0
    finally:
        cpu_ext._state.update(saved)
        dispatch.clear_choices()
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("cpp ")] == [f"cpp     cannot run: {cpu_ext.BUILD_ENV}=0 forbids "
                                                                  "building the C++ kernels"]
    assert out[-1] == "chosen on cpu: torch"


def test_doctor_reports_a_forced_implementation_that_cannot_run(capsys, monkeypatch):
    monkeypatch.setenv("CHUNKED_KV_IMPL", "cuda")
    assert main(["doctor", "--device", "cpu"]) == 1
    assert "cuda" in capsys.readouterr().out.splitlines()[-1]


def test_doctor_for_fp8_pages_names_their_readers(capsys):
    from vllm_chunked_kv.ops import dispatch

    assert main(["doctor", "--device", "cpu", "--kv-cache-dtype", "fp8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "KV pages: fp8 (FP8, one byte per element)"
    for impl in ("cpp", "triton", "cuda"):
        line = next(line for line in out if line.split()[0] == impl)
        assert (impl in dispatch.FP8_READERS) or "do not read FP8 pages (--kv-cache-dtype fp8)" in line
    assert out[-1].split(": ")[1] in dispatch.FP8_READERS


def test_version_warning_names_both_versions():
    assert compat.version_warning(compat.TESTED_VLLM) is None
    assert compat.version_warning(compat.TESTED_VLLM + "+cpu") is None
    warning = compat.version_warning("0.33.1")
    assert "0.33.1" in warning and compat.TESTED_VLLM in warning
