"""Contract of vllm_chunked_kv.ops.cuda_ext and the CUDA sources in csrc/.

On any machine:
- without a CUDA device and without CHUNKED_KV_BUILD_CUDA=1 nothing is
  compiled and no warning is given; the reason names both conditions;
- a forced build that fails is exactly one warning naming the cause, after
  which the extension is unavailable with that cause as its reason;
- where nvcc is installed, the kernels compile for sm_80 and sm_90;
- where a C++ compiler and the CUDA headers are installed, the torch binding
  compiles against this torch's headers (syntax only: a CPU build of torch
  lacks one generated CUDA header, stubbed here, and the CUDA libraries).

On a GPU (skipped, with the reason, elsewhere): the extension builds, and its
`pool_chunk` and `attend` equal the reference and the PyTorch paged path for
every mitigation, GQA 1 and 4, mixed batches, one and several splits, fp32
and bf16.
"""

import shutil
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

import pytest
import torch

from vllm_chunked_kv.config import ChunkedKVConfig
from vllm_chunked_kv.ops import cuda_ext, paged, reference

CSRC = Path(cuda_ext.SOURCES_DIR)
NO_GPU = "no CUDA device (torch.cuda.is_available() is False)"


@pytest.fixture(autouse=True)
def _fresh_state():
    cuda_ext._reset_for_tests()
    yield
    cuda_ext._reset_for_tests()


def test_cpu_only_compiles_nothing(monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(cuda_ext.BUILD_ENV, raising=False)
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("compiled on a CPU-only machine"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cuda_ext.load() is None
        reasons = cuda_ext.unavailable_reasons()
    assert caught == []
    assert len(reasons) == 1 and "CUDA device" in reasons[0] and cuda_ext.BUILD_ENV in reasons[0]


def test_failed_forced_build_is_one_warning(monkeypatch):
    from torch.utils import cpp_extension

    def broken(*args, **kwargs):
        raise RuntimeError("Error building extension 'chunked_kv_cuda'\nnvcc fatal   : Unsupported gpu architecture")

    monkeypatch.setenv(cuda_ext.BUILD_ENV, "1")
    monkeypatch.setattr(cpp_extension, "load", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cuda_ext.load() is None
        assert cuda_ext.load() is None
        reasons = cuda_ext.unavailable_reasons()
    assert len(caught) == 1 and issubclass(caught[0].category, RuntimeWarning)
    assert "Unsupported gpu architecture" in str(caught[0].message)
    assert "Unsupported gpu architecture" in reasons[0]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_kernels_compile_with_nvcc(tmp_path):
    cmd = ["nvcc", "-c", str(CSRC / "chunked_kv_kernels.cu"), "-o", str(tmp_path / "kernels.o"), "-std=c++17",
           "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warning" not in done.stderr.lower(), done.stderr[-3000:]


def _cuda_include() -> Path | None:
    nvcc = shutil.which("nvcc")
    candidates = [Path("/usr/local/cuda/include")]
    if nvcc:
        candidates.append(Path(nvcc).resolve().parents[1] / "include")
    return next((p for p in candidates if (p / "cuda_runtime_api.h").is_file()), None)


@pytest.mark.skipif(shutil.which("g++") is None or _cuda_include() is None, reason="needs g++ and the CUDA headers")
def test_binding_compiles_against_torch_headers(tmp_path):
    torch_include = Path(torch.__file__).parent / "include"
    stub = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"  # generated only in CUDA builds of torch
    stub.parent.mkdir(parents=True)
    stub.write_text("#pragma once\n")
    cmd = ["g++", "-fsyntax-only", "-std=c++17", f"-I{tmp_path}", f"-I{torch_include}",
           f"-I{torch_include / 'torch/csrc/api/include'}", f"-I{_cuda_include()}",
           f"-I{sysconfig.get_paths()['include']}", f"-I{CSRC}", "-DTORCH_EXTENSION_NAME=chunked_kv_cuda",
           str(CSRC / "chunked_kv_ext.cpp")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


# ------------------------------------------------------------------ on a GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)

MITIGATIONS = {
    "none": dict(chunk_size=4, window=16, sink_tokens=3),
    "boundary": dict(chunk_size=4, window=16, sink_tokens=5, mitigation="boundary", pooling="key_norm"),
    "overlap": dict(chunk_size=4, window=16, mitigation="overlap", pooling="gated", slot_gains=[1.0, 2.0, 3.0, 4.0]),
    "stride2": dict(window=16, sink_tokens=1, mitigation="stride2"),
    "stagger": dict(chunk_size=4, window=16, sink_tokens=2, mitigation="stagger"),
}


@gpu
def test_extension_builds_on_a_gpu():
    assert cuda_ext.unavailable_reasons() == []


@gpu
@pytest.mark.parametrize("name", list(MITIGATIONS))
def test_pool_chunk_equals_reference(name):
    cfg = ChunkedKVConfig(**MITIGATIONS[name])
    keys = torch.randn(9, 3, cfg.chunk_size, 64, device="cuda")
    values = torch.randn(9, 3, cfg.chunk_size, 48, device="cuda")
    for got, want in zip(cuda_ext.pool_chunk(keys, values, cfg), reference.pool_chunk(keys, values, cfg)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _paged(requests, num_kv_heads, group, head_d, dtype, block_size=16):
    pages = [-(-s // block_size) for s, _ in requests]
    order = torch.randperm(sum(pages) + 2)
    table = torch.zeros(len(requests), max(pages), dtype=torch.int32)
    used = 0
    for r, count in enumerate(pages):
        table[r, :count] = order[used : used + count]
        used += count
    kv_cache = torch.randn(sum(pages) + 2, num_kv_heads, block_size, 2 * head_d, device="cuda").to(dtype)
    batch = paged.PagedBatch.from_vllm(
        query_start_loc=torch.tensor([0] + [q for _, q in requests]).cumsum(0),
        seq_lens=torch.tensor([s for s, _ in requests]),
        block_table=table.cuda(),
        block_size=block_size,
    )
    query = torch.randn(batch.query_start[-1], num_kv_heads * group, head_d, device="cuda").to(dtype)
    return query, kv_cache, batch


@gpu
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("name", list(MITIGATIONS))
def test_attend_equals_paged_path(name, group, splits):
    cfg = ChunkedKVConfig(**MITIGATIONS[name])
    query, kv_cache, batch = _paged([(300, 300), (257, 1), (1, 1), (411, 37)], 2, group, 64, torch.float32)
    origins = torch.tensor(cfg.origins(0, 2), device="cuda")
    got = cuda_ext.attend(query, kv_cache, batch, 0.125, cfg, origins, num_splits=splits)
    want = paged.attend(query, kv_cache, batch, 0.125, cfg, origins)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@gpu
def test_attend_bf16_and_exact():
    query, kv_cache, batch = _paged([(1000, 1), (200, 64)], 4, 2, 128, torch.bfloat16)
    got = cuda_ext.attend(query, kv_cache, batch, 0.1)
    want = paged.attend(query, kv_cache, batch, 0.1)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)

