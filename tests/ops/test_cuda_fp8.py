"""Contract of the CUDA kernels on FP8 pages (csrc/cuda/, `cuda_ext` with ``fmt=``).

In the CPU emulation (csrc/cuda/cpu_emulation.h: the kernels' very source
built with g++, as in test_cuda_ext.py), the kernels behave as the C++ CPU
kernels do (test_cpu_fp8.py):

- Conversion (csrc/cuda/chunked_kv_fp8.cuh, the one conversion nvcc and the
  emulation compile): the kernels store a value as torch's cast stores it
  (rounded to nearest even, saturated at the format's largest, NaN kept),
  and read every one of the 256 codes of both formats as torch reads it: a
  chunk of one row pooled with gain 1 gives back its own value; the mean of
  two rows (where ties to even are common) gives the bytes `fp8.quantise`
  gives.
- On the schedule harness (`schedule.run_schedule`, pages of bytes poisoned
  with a NaN byte, random power-of-two scales), at every step the pages the
  kernels write equal the PyTorch path's (`schedule._check_fp8_pages`: one
  code apart at most, where a pooled sum rounds differently) and every
  output equals the reference read through the same pages, for every
  setting (`schedule.FP8_SCHEDULES`) with GQA 2 and 4; for the model's logit
  options (softcap with sinks, a sliding window with sinks) with split
  contexts and query tiles on both formats; for bf16 and fp16 queries and
  outputs over FP8 pages.
- The kernels ran: with PyTorch's attention disabled, the extension's
  attend ran once per step at least and its write_chunks ran. The binding
  refuses fp32 step rows over FP8 pages (it takes the stored bytes), in
  write_chunks and in attend, with one message; pages in the model's dtype
  take format "" (test_cuda_ext.py).

On a GPU (skipped, with the reason, elsewhere): the same conversions and
schedules on the device (the kernels compiled by nvcc), GQA 2 and 4, fp32 and
bf16 queries, and the logit options.
"""

import collections
import types

import pytest
import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops import dispatch, fp8
from vllm_chunked_kv.ops.kernels import compressed, cuda_ext

from .fp8_checks import check_every_code, check_mean_rounding, pooling_step
from .schedule import CONFIGS, FP8_SCHEDULES, LOGIT_OPTIONS, kernel_lengths, run_schedule
# test_cuda_ext.py's autouse reset of cuda_ext's state (the emulated extension: conftest.py, one build a session)
from .test_cuda_ext import NO_GPU, _fresh_state  # noqa: F401

pytestmark = pytest.mark.xdist_group("cuda-emulation")  # with test_cuda_ext.py: one build of the emulation

torch.set_num_threads(1)  # the reference's small tensors: two threads on a busy 2-core machine wait on each other


def _pool(rows: torch.Tensor, chunk: int, fmt: fp8.PageFormat) -> torch.Tensor:
    """What `cuda_ext.write_chunks` stores (`fp8_checks.Pool`)."""
    raw, comp, step_rows, writes, cfg = pooling_step(rows, chunk)
    cuda_ext.write_chunks(comp, raw, step_rows, writes, cfg, fmt.head_size, fmt=fmt)
    return comp[:, 0, 0].cpu()


def run_fp8_schedule(name: str, cache_dtype: str, group: int, device: str = "cpu", **options) -> int:
    """One of the FP8_SCHEDULES through the CUDA kernels (fp32 queries unless `options` say)."""
    cfg = ChunkedKVConfig(**CONFIGS[name])
    options = {"tol": 1e-4, **options}
    return run_schedule(cfg, kernel_lengths(cfg, group), seed=group, impl="cuda", device=device, group=group,
                        cache_dtype=cache_dtype, **options)


LOGIT_CASES = [("softcap-sinks", "fp8"), ("window-sinks", "fp8"), ("softcap-sinks", "fp8_e5m2"),
               ("window-sinks", "fp8_e5m2")]
QUERY_DTYPES = [(torch.bfloat16, "fp8", 3e-2), (torch.float16, "fp8_e5m2", 1e-2)]


def run_logit_case(options: str, cache_dtype: str, device: str = "cpu") -> int:
    """A logit option with split contexts (the sinks in split 0 only) and query tiles."""
    return run_fp8_schedule("boundary-gated", cache_dtype, 4, device, attend_kwargs=dict(num_splits=3, block_m=5),
                            **LOGIT_OPTIONS[options])


# -------------------------------------------------------------- CPU emulation


@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_emulated_every_code_reads_and_stores_as_torch_does(emulated, cache_dtype):
    check_every_code(_pool, cache_dtype)


@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_emulated_mean_rounds_to_nearest_even_and_saturates(emulated, cache_dtype):
    check_mean_rounding(_pool, cache_dtype)


@pytest.mark.parametrize("name, cache_dtype", FP8_SCHEDULES)
@pytest.mark.parametrize("group", [2, 4])
def test_emulated_kernels_equal_the_reference_on_fp8_pages(emulated, name, cache_dtype, group):
    assert run_fp8_schedule(name, cache_dtype, group) > 4


@pytest.mark.parametrize("options, cache_dtype", LOGIT_CASES)
def test_emulated_logit_options_splits_and_tiles_on_fp8_pages(emulated, options, cache_dtype):
    assert run_logit_case(options, cache_dtype) > 4


@pytest.mark.parametrize("dtype, cache_dtype, tol", QUERY_DTYPES)
def test_emulated_half_queries_over_fp8_pages(emulated, dtype, cache_dtype, tol):
    """bf16 / fp16 queries and outputs over byte pages: the kernels' query type
    and their step rows' type (the pages') differ."""
    assert run_fp8_schedule("stagger-heads", cache_dtype, 2, dtype=dtype, tol=tol,
                            attend_kwargs=dict(num_splits=2)) > 4


class _Counted:
    """The extension with its write_chunks and attend calls counted."""

    def __init__(self, module):
        self.module, self.calls = module, collections.Counter()

    def __getattr__(self, name):
        attr = getattr(self.module, name)
        if name not in ("write_chunks", "attend"):
            return attr

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted


def test_emulated_kernels_read_the_fp8_pages(emulated, monkeypatch):
    monkeypatch.setattr(compressed, "attend", lambda *a, **k: pytest.fail("the PyTorch attention ran"))
    assert "cuda" in dispatch.FP8_READERS
    counted = _Counted(emulated)
    cuda_ext._state.update(module=counted)
    cfg = ChunkedKVConfig(**CONFIGS["boundary-gated"])
    steps = run_schedule(cfg, [63, 100], seed=2, impl="cuda", group=2, cache_dtype="fp8", tol=1e-4)
    assert counted.calls["attend"] >= steps and counted.calls["write_chunks"] >= 1


def test_emulated_fp32_step_rows_over_fp8_pages_are_refused(emulated, monkeypatch):
    one = torch.zeros(1, 1, dtype=torch.long)
    pages = torch.zeros(2, 1, 4, 16, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="step_rows must be the step's stored bytes"):
        emulated.write_chunks(pages, pages, torch.zeros(1, 1, 16), torch.ones(1), one[0], one, one, one, one, one,
                              8, 0, 1, False, "fp8", 1.0, 1.0)
    # attend: the kernels handed the step's rows in fp32 instead of their bytes
    cuda_ext._state.update(module=types.SimpleNamespace(
        **{name: getattr(emulated, name) for name in dir(emulated)
           if not name.startswith("__") and name != "attend"},
        attend=lambda query, step_rows, *rest: emulated.attend(query, step_rows.float(), *rest)))
    cfg = ChunkedKVConfig(**CONFIGS["none"])
    with pytest.raises(RuntimeError, match="step_rows must be the step's stored bytes"):
        run_schedule(cfg, [20], seed=1, impl="cuda", group=2, cache_dtype="fp8", tol=1e-4)


# ------------------------------------------------------------------ on a GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)


@gpu
@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_gpu_codes_and_rounding_as_torch(cache_dtype):
    check_every_code(_pool, cache_dtype, "cuda")
    check_mean_rounding(_pool, cache_dtype, "cuda")


@gpu
@pytest.mark.parametrize("name, cache_dtype", FP8_SCHEDULES)
@pytest.mark.parametrize("group", [2, 4])
def test_gpu_kernels_equal_the_reference_on_fp8_pages(name, cache_dtype, group):
    assert run_fp8_schedule(name, cache_dtype, group, "cuda") > 4


@gpu
@pytest.mark.parametrize("options, cache_dtype", LOGIT_CASES)
def test_gpu_logit_options_splits_and_tiles_on_fp8_pages(options, cache_dtype):
    assert run_logit_case(options, cache_dtype, "cuda") > 4


@gpu
@pytest.mark.parametrize("dtype, cache_dtype, tol", QUERY_DTYPES)
def test_gpu_half_queries_over_fp8_pages(dtype, cache_dtype, tol):
    assert run_fp8_schedule("stagger-heads", cache_dtype, 2, "cuda", dtype=dtype, tol=tol,
                            attend_kwargs=dict(num_splits=2)) > 4
