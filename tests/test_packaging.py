"""A wheel built from this checkout carries what a non-editable install needs:
the three shipped demo models (weights, tokenizer, configs), every file of
every adapter that `models fetch --adapted` merges (with the terms of a base
model whose derivative it is), the prose-codes scanner task and
the scanner's example task,
and the CUDA and C++ CPU sources and headers, every file of every csrc/ folder
(``common/``, ``cpu/``, ``cuda/``), installed where `ops/kernels/cuda_ext.py`
and `ops/kernels/cpu_ext.py` look for them without a checkout
(``<prefix>/share/vllm-chunked-kv/csrc``, folders kept)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from vllm_chunked_kv.ops.kernels import cpu_ext, cuda_ext, jit

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_carries_models_and_cuda_sources(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(ROOT),
                    "-w", str(tmp_path)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("vllm_chunked_kv-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for model in ("model", "model_gated", "model_stagger"):
        for name in ("model.safetensors", "config.json", "tokenizer.json"):
            assert f"vllm_chunked_kv/demo/{model}/{name}" in names
    from vllm_chunked_kv.models.fetcher import ADAPTER_FILES

    adapters = sorted(p.parent for p in (ROOT / "vllm_chunked_kv" / "models" / "adapters").glob("*/adapter.json"))
    assert adapters
    for adapter in adapters:  # each with all its files: the adapter, its card, and a base model's terms it carries
        shipped = {p.name for p in adapter.iterdir() if p.is_file()}
        assert set(ADAPTER_FILES) <= shipped
        for name in shipped:
            assert f"vllm_chunked_kv/models/adapters/{adapter.name}/{name}" in names, name
    assert "vllm_chunked_kv/tasks/data/prose_codes.jsonl" in names
    assert "vllm_chunked_kv/scan/examples/secret_codes.jsonl" in names
    data = [n.split(".data/data/", 1)[1] for n in names if ".data/data/" in n]
    for name in cuda_ext.SOURCES + cuda_ext.HEADERS + cpu_ext.SOURCES + cpu_ext.HEADERS:
        assert (jit.INSTALLED_SOURCES / name).as_posix() in data
    csrc = ROOT / "csrc"
    shipped = sorted((jit.INSTALLED_SOURCES / p.relative_to(csrc)).as_posix() for p in csrc.rglob("*")
                     if p.is_file())
    assert {"common", "cpu", "cuda"} <= {p.name for p in csrc.iterdir() if p.is_dir()}
    assert [name for name in shipped if name not in data] == []
