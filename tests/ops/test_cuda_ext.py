"""Contract of vllm_chunked_kv.ops.kernels.cuda_ext and the CUDA sources in csrc/.

On any machine:
- without a CUDA device and without CHUNKED_KV_BUILD_CUDA=1 nothing is
  compiled and no warning is given; the reason names both conditions;
- a forced build that fails is exactly one warning naming the cause, after
  which the extension is unavailable with that cause as its reason; missing
  sources are a reason without a build; the build flags change with the
  headers (the JIT build hashes only the sources); the static limits (GQA
  group, head sizes) are reasons without a build;
- where nvcc is installed, the kernels compile for sm_80 and sm_90 without
  warnings (the registers and spills of every kernel are printed);
- where g++ and the CUDA headers are installed, the torch binding compiles
  against this torch's headers (syntax only: a CPU build of torch lacks one
  generated CUDA header, stubbed here, and the CUDA libraries).

In the CPU emulation (csrc/cuda/cpu_emulation.h: the kernels' very source built
with g++, each block's threads run as fibers in a shuffled order between
barriers, shared memory starting as NaN), through `schedule.run_schedule`
with ``impl="cuda"``: every step's compressed rows equal
`compressed.write_chunks` (target slots NaN before the call) and every
query's output equals `reference_chunked_attention` (output NaN before the
call), for every setting of `schedule.CONFIGS` with GQA 1 and 4 and lengths
63 and 100 among the requests; for GQA 3, values wider than keys, heads wider
than a block's threads, several query tiles per request, split contexts,
decode-only batches, bf16 and fp16, fp32 queries over bf16 caches, and
caches with head-major strides and padded rows; a model's logit cap and
learned sink logits (`LOGIT_OPTIONS`) with split contexts, query tiles and
bf16; bf16 queries with fp32 step rows into an fp16 ``out`` equal
`compressed.attend`. The emulation fails
the schedule when a barrier of the attention kernel is removed (a race).
The binding rejects rows that are not contiguous; `unsupported` reports a
decode tile beyond the device's shared memory, and multi-token tiles shrink
to fit it.

On a GPU (skipped, with the reason, elsewhere): the extension builds, and
the same schedules equal the reference for every setting of
`schedule.CONFIGS`, GQA 1 and 4, fp32 and bf16, and the shapes and logit
options above.
"""

import re
import shutil
import subprocess
import sysconfig
import warnings
from pathlib import Path

import pytest
import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops import dispatch
from vllm_chunked_kv.ops.kernels import cuda_ext

from . import kernel_checks
from .cuda_build import CSRC, compile_emulated, cuda_include, link_emulated, object_name, run_all
from .kernel_checks import CACHE_LAYOUTS, KERNEL_SHAPES, LOGIT_SHAPES, run_cache_layout, run_logit_shape, run_shape
from .schedule import CONFIGS, LOGIT_OPTIONS, kernel_lengths, run_schedule

KERNEL_SOURCES = [name for name in cuda_ext.SOURCES if name.endswith(".cu")]
NO_GPU = "no CUDA device (torch.cuda.is_available() is False)"
# one pytest-xdist group with test_cuda_fp8.py: one worker builds the emulation once for both
pytestmark = pytest.mark.xdist_group("cuda-emulation")


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
        assert cuda_ext.unsupported(128, 128, 8) == []  # nothing loaded: the reason above says why
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


def test_missing_sources_are_a_reason_without_a_build(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    monkeypatch.setenv(cuda_ext.BUILD_ENV, "1")
    monkeypatch.setattr(cuda_ext, "SOURCES_DIR", tmp_path)
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("built without sources"))
    reasons = cuda_ext.unavailable_reasons()
    assert len(reasons) == 1 and "not found" in reasons[0] and "chunked_kv_attention.cu" in reasons[0]


def test_build_flags_follow_the_headers(monkeypatch, tmp_path):
    for name in cuda_ext.HEADERS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(CSRC / name, tmp_path / name)
    monkeypatch.setattr(cuda_ext, "SOURCES_DIR", tmp_path)
    before = cuda_ext.headers_digest()
    (tmp_path / cuda_ext.HEADERS[0]).write_text((CSRC / cuda_ext.HEADERS[0]).read_text() + "\n// changed\n")
    assert cuda_ext.headers_digest() != before


def test_limits_are_reasons_without_a_build(monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("unsupported() compiled"))
    assert len(cuda_ext.unsupported(512, 512, cuda_ext.MAX_GROUP + 1)) == 2
    assert len(cuda_ext.unsupported(128, cuda_ext.MAX_HEAD_SIZE + 1, 4)) == 1
    assert cuda_ext.unsupported(cuda_ext.MAX_HEAD_SIZE, cuda_ext.MAX_HEAD_SIZE, cuda_ext.MAX_GROUP) == []


# ------------------------------------------------------------ compile checks


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_kernels_compile_with_nvcc(tmp_path):
    from torch.utils import cpp_extension

    commands = [["nvcc", "-c", str(CSRC / name), "-o", str(tmp_path / object_name(name)), "-std=c++20", "-O3",
                 *cpp_extension.COMMON_NVCC_FLAGS, "-Xcompiler", "-fPIC",  # as the JIT build compiles them
                 "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90", "-Xptxas", "-v"]
                for name in KERNEL_SOURCES]
    for done in run_all(commands):
        assert done.returncode == 0, done.stderr[-3000:]
        assert "warning" not in done.stderr.lower(), done.stderr[-3000:]
        # ptxas -v: per kernel and arch, "Compiling entry function 'NAME' for 'sm_XX'", then its
        # stack/spills and registers.
        pattern = r"entry function '(\S+)' for '(sm_\d+)'\s+.*?(\d+) bytes spill stores.*?Used (\d+) registers"
        entries = re.findall(pattern, done.stderr, flags=re.S)
        assert entries, done.stderr[-3000:]
        names = [name for name, *_ in entries]
        if shutil.which("c++filt"):
            demangled = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
            names = demangled.stdout.split("\n")
        for name, (_, arch, spills, registers) in zip(names, entries):
            print(f"{arch} {name.replace('chunked_kv::(anonymous namespace)::', '')}: {registers} registers, "
                  f"{spills} bytes spilled")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None or cuda_include() is None, reason="needs g++ and the CUDA headers")
def test_binding_compiles_against_torch_headers(tmp_path):
    torch_include = Path(torch.__file__).parent / "include"
    stub = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"  # generated only in CUDA builds of torch
    stub.parent.mkdir(parents=True)
    stub.write_text("#pragma once\n")
    cmd = ["g++", "-fsyntax-only", "-std=c++20", f"-I{tmp_path}", f"-I{torch_include}",
           f"-I{torch_include / 'torch/csrc/api/include'}", f"-I{cuda_include()}",
           f"-I{sysconfig.get_paths()['include']}", f"-I{CSRC}", "-DTORCH_EXTENSION_NAME=chunked_kv_cuda",
           str(CSRC / "cuda" / "chunked_kv_ext.cpp")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


# -------------------------------------------------------------- CPU emulation


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_emulated_steps_equal_reference(emulated, name, group):
    cfg = ChunkedKVConfig(**CONFIGS[name])
    assert run_schedule(cfg, kernel_lengths(cfg, group), seed=group, impl="cuda", group=group, tol=1e-4) > 4


def test_emulated_decode_step_waits_for_nothing(emulated, load_benchmark):
    """The decode step of `benchmarks/graph_check.py` through the CUDA wrappers
    (plan on the device, write_raw, write_chunks, attend): after a warm-up
    step nothing reads a tensor on the host or copies host data, and every
    step across chunk boundaries equals the PyTorch path."""
    graph_check = load_benchmark("graph_check")
    args = graph_check.parse_args(["--cases", "3x150", "--steps", "9", "--layers", "2",
                                   "--num-heads", "8", "--num-kv-heads", "2", "--head-size", "32",
                                   "--mitigations", "boundary", "--dtype", "float32"])
    stack = graph_check.make_stack(args, torch.device("cpu"))
    ops = dispatch.ops("cuda")
    assert graph_check.check_sync(stack, ops, torch.device("cpu")) == {"check": "sync", "ok": True}
    eager, pages = graph_check.eager_run(stack, ops, bias=False)
    assert graph_check.check_reference(stack, ops, eager, pages, 1e-4)["ok"]


@pytest.mark.parametrize("name, options", KERNEL_SHAPES)
def test_emulated_shapes_tiles_splits_and_dtypes(emulated, name, options):
    assert run_shape(name, options, "cuda") > 4


@pytest.mark.parametrize("options", list(LOGIT_OPTIONS))
@pytest.mark.parametrize("name", list(LOGIT_SHAPES))
def test_emulated_logit_cap_and_sinks_equal_reference(emulated, name, options):
    assert run_logit_shape(name, options, "cuda") > 4


@pytest.mark.parametrize("layout", list(CACHE_LAYOUTS))
def test_emulated_cache_layouts(emulated, monkeypatch, layout):
    """Strided (head-major, NaN-padded) caches; fp32 queries over bf16 caches."""
    assert run_cache_layout(monkeypatch, layout, "cuda") > 4


@pytest.mark.slow
def test_emulation_catches_a_missing_barrier(emulated_objects, tmp_path):
    """The emulation is strict enough to fail a race: the attention kernel
    without the barrier between its logits and its softmax fails the schedule."""
    sources = tmp_path / "csrc"
    shutil.copytree(CSRC, sources)
    source = sources / "cuda" / "chunked_kv_attention.cu"
    text = source.read_text()
    barrier = "      sh.p[r * kProbStride + n] = logit;\n    }\n    __syncthreads();\n"
    assert text.count(barrier) == 1
    source.write_text(text.replace(barrier, barrier.removesuffix("    __syncthreads();\n")))
    rebuilt = ["cuda/chunked_kv_attention.cu", "cuda/chunked_kv_ext.cpp"]  # an extension of another name: Python
    compile_emulated(sources, tmp_path, rebuilt, module="chunked_kv_racy")  # imports one name once
    objects = [(tmp_path if name in rebuilt else emulated_objects) / object_name(name) for name in cuda_ext.SOURCES]
    racy = link_emulated(objects, tmp_path / "chunked_kv_racy.so")
    cuda_ext._state.update(tried=True, module=racy, reason=None)
    cfg = ChunkedKVConfig(**CONFIGS["none"])
    with pytest.raises(AssertionError, match="not close"):
        run_schedule(cfg, [63, 100], seed=1, impl="cuda", group=4, tol=1e-4)


def test_emulated_mixed_query_step_and_out_dtypes(emulated):
    """bf16 queries with fp32 step rows (computed in fp32) written into an fp16 out."""
    out, want = kernel_checks.mixed_dtypes_step(cuda_ext.attend)
    torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=2e-3)


def test_emulated_binding_rejects_strided_rows(emulated):
    cache = torch.zeros(4, 2, 8, 16).transpose(2, 3)  # last-dim stride 16
    step = torch.zeros(3, 2, 8)
    index = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        emulated.write_chunks(cache, cache, step, torch.zeros(4), index[0, :1], index, index, index,
                              index[:, :1], index[:, :1], 4, 0, 4, False, "", 1.0, 1.0)


def test_unsupported_reports_shared_memory_beyond_the_device(emulated, monkeypatch):
    assert cuda_ext.unsupported(256, 256, cuda_ext.MAX_GROUP) == []  # fits the emulated H100
    monkeypatch.setattr(emulated, "device_limits", lambda device: (4, 99 * 1024))  # an sm_86's limit
    assert cuda_ext.unsupported(128, 128, 8) == []
    reasons = cuda_ext.unsupported(256, 256, cuda_ext.MAX_GROUP)
    assert len(reasons) == 1 and "shared memory" in reasons[0]


def test_tiles_shrink_to_the_shared_memory(emulated):
    limit = emulated.attend_shared_bytes(8, 256, 256)  # 8 query rows fit, 16 do not
    assert cuda_ext._tile_queries(emulated, 1, 256, 256, None) == cuda_ext.MAX_TILE_ROWS == emulated.MAX_TILE_ROWS
    assert cuda_ext._tile_queries(emulated, 1, 256, 256, limit) == 8
    assert cuda_ext._tile_queries(emulated, 4, 256, 256, limit) == 2  # tiles of whole GQA groups


# ------------------------------------------------------------------ on a GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)


@gpu
def test_extension_builds_on_a_gpu():
    assert cuda_ext.unavailable_reasons() == []


@gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_steps_equal_reference(name, group, dtype, tol):
    cfg = ChunkedKVConfig(**CONFIGS[name])
    assert run_schedule(cfg, kernel_lengths(cfg, group), seed=group, impl="cuda", device="cuda", group=group,
                        dtype=dtype, tol=tol) > 4


@gpu
@pytest.mark.parametrize("name, options", KERNEL_SHAPES)
def test_gpu_shapes_tiles_splits_and_dtypes(name, options):
    assert run_shape(name, options, "cuda", "cuda") > 4


@gpu
@pytest.mark.parametrize("options", list(LOGIT_OPTIONS))
@pytest.mark.parametrize("name", list(LOGIT_SHAPES))
def test_gpu_logit_cap_and_sinks_equal_reference(name, options):
    assert run_logit_shape(name, options, "cuda", "cuda") > 4
