"""Contract of the Triton kernels on FP8 pages (`triton_pool.write_chunks` and
`triton_attention.attend` with ``fmt=``; conversions in `triton_fp8`), run
under Triton's CPU interpreter.

- Conversion: the kernels store a value as torch's cast stores it (rounded
  to nearest even, subnormals included, saturated at the format's largest,
  NaN kept), and read every one of the 256 codes of both formats as torch
  reads it, NaN codes as NaN (the interpreter's own float8 reads them as
  finite numbers and stores by truncation: the kernels decode the bits
  themselves): a chunk of one row pooled with gain 1 gives back its own
  value; the mean of two rows (where ties to even are common) gives the
  bytes `fp8.quantise` gives.
- On the schedule harness (`schedule.run_schedule`, pages of bytes poisoned
  with a NaN byte, random power-of-two scales), at every step the pages the
  kernels write equal the PyTorch path's (`schedule._check_fp8_pages`: one
  code apart at most, where a pooled sum rounds differently) and every
  output equals the reference read through the same pages, for every
  setting (`schedule.FP8_SCHEDULES`) with GQA 2; with GQA 4, the model's
  logit options with split contexts and query tiles, bf16 queries and
  outputs, decode-only batches on the device-side decode plan. The
  schedules' requests are shorter than `kernel_lengths` (the interpreter's
  time), long enough to seal many chunks and drop raw rows.
- The kernels ran: every step launched the Triton attention kernel and the
  chunk writes the pooling kernel, with the FP8 constant of the pages, with
  PyTorch's attention disabled; dispatch lists triton among the FP8 readers.
  step_rows that are not bytes over FP8 pages are refused with one message.
- The kernels as `attend`/`write_chunks` launch them on E4M3 pages compile
  ahead of time for sm_80, which has no FP8 conversions (not run; slow).
"""

import functools

import pytest
import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops import fp8

from .fp8_checks import check_every_code, check_mean_rounding, pooling_step
from .schedule import CONFIGS, FP8_SCHEDULES, LOGIT_OPTIONS

POOL = "vllm_chunked_kv.ops.kernels.triton_pool"


def fp8_lengths(cfg: ChunkedKVConfig) -> list[int]:
    """Two requests: both seal chunks, the longer many, and drops raw rows behind its window."""
    return [2 * cfg.window + 5, 4 * cfg.window + 9]


def _pool(triton_ops, rows: torch.Tensor, chunk: int, fmt: fp8.PageFormat) -> torch.Tensor:
    """What `triton_pool.write_chunks` stores (`fp8_checks.Pool`, with the fixture first)."""
    raw, comp, step_rows, writes, cfg = pooling_step(rows, chunk)
    comp = triton_ops.schedule.call_returning(POOL, "write_chunks", comp, raw, step_rows, writes, cfg,
                                              fmt.head_size, fmt=fmt)[0]  # the cache comes back from the worker
    return comp[:, 0, 0]


@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_every_code_reads_and_stores_as_torch_does(triton_ops, cache_dtype):
    check_every_code(functools.partial(_pool, triton_ops), cache_dtype)


@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_a_mean_rounds_to_nearest_even_and_saturates(triton_ops, cache_dtype):
    check_mean_rounding(functools.partial(_pool, triton_ops), cache_dtype)


@pytest.mark.parametrize("name, cache_dtype", FP8_SCHEDULES)
def test_kernels_equal_the_reference_on_fp8_pages(triton_ops, name, cache_dtype):
    cfg = ChunkedKVConfig(**CONFIGS[name])
    assert triton_ops.schedule.run_schedule(cfg, fp8_lengths(cfg), seed=2, impl="triton", group=2,
                                            cache_dtype=cache_dtype, tol=1e-4) > 4


@pytest.mark.parametrize("options", ["softcap-sinks", "window-sinks"])
def test_logit_options_splits_and_tiles_on_fp8_pages(triton_ops, options):
    cfg = ChunkedKVConfig(**CONFIGS["boundary-gated"])
    assert triton_ops.schedule.run_schedule(cfg, fp8_lengths(cfg), seed=4, impl="triton", group=4, cache_dtype="fp8",
                                            tol=1e-4, attend_kwargs=dict(num_splits=3, block_m=5),
                                            **LOGIT_OPTIONS[options]) > 4


@pytest.mark.parametrize("name, cache_dtype, options", [
    ("overlap", "fp8", dict(group=4, dtype=torch.bfloat16, tol=3e-2)),  # bf16 queries, rows and outputs
    ("stagger-heads", "fp8_e5m2", dict(group=4, decode_only=True, decode_plan=True, attend_kwargs=dict(num_splits=2))),
])
def test_bf16_queries_and_decode_plans_on_fp8_pages(triton_ops, name, cache_dtype, options):
    cfg = ChunkedKVConfig(**CONFIGS[name])
    assert triton_ops.schedule.run_schedule(cfg, fp8_lengths(cfg), seed=5, impl="triton", cache_dtype=cache_dtype,
                                            **{"tol": 1e-4, **options}) > 4


def run_counting_launches() -> tuple[int, list[tuple[str, int]], list[str]]:
    """In the interpreter worker: one FP8 schedule through the Triton ops with PyTorch's
    attention disabled -> (steps, (kernel, FP8 constant) of every launch, dispatch's
    reasons why triton cannot read FP8 pages here)."""
    from vllm_chunked_kv.ops import dispatch
    from vllm_chunked_kv.ops.kernels import compressed, triton_attention, triton_pool

    from .schedule import run_schedule

    launches = []

    class Counted:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((self.kernel.fn.__name__, kwargs["FP8"]))
                return self.kernel[grid](*args, **kwargs)

            return launch

    def no_torch_attention(*args, **kwargs):
        raise AssertionError("the PyTorch attention ran")

    saved = (triton_attention._chunked_kv_attention_kernel, triton_pool._chunked_kv_write_chunks_kernel,
             compressed.attend)
    triton_attention._chunked_kv_attention_kernel = Counted(saved[0])
    triton_pool._chunked_kv_write_chunks_kernel = Counted(saved[1])
    compressed.attend = no_torch_attention
    try:
        cfg = ChunkedKVConfig(**CONFIGS["boundary-gated"])
        steps = run_schedule(cfg, fp8_lengths(cfg), seed=2, impl="triton", group=2, cache_dtype="fp8", tol=1e-4)
    finally:
        triton_attention._chunked_kv_attention_kernel, triton_pool._chunked_kv_write_chunks_kernel = saved[:2]
        compressed.attend = saved[2]
    return steps, launches, dispatch.available("triton", "cpu", cache_dtype="fp8")


def test_the_kernels_read_the_fp8_pages(triton_ops):
    from vllm_chunked_kv.ops import dispatch

    from .conftest import _Module

    assert "triton" in dispatch.FP8_READERS
    steps, launches, reasons = _Module(triton_ops.pool._worker, __name__).run_counting_launches()
    assert reasons == []
    attention = [kind for kernel, kind in launches if kernel == "_chunked_kv_attention_kernel"]
    pooling = [kind for kernel, kind in launches if kernel == "_chunked_kv_write_chunks_kernel"]
    assert len(attention) >= steps and pooling and set(attention) == set(pooling) == {3}  # E4M3


def test_step_rows_that_are_not_bytes_are_refused(triton_ops):
    fmt = fp8.PageFormat("fp8", head_size=8)
    raw, comp, _, writes, cfg = pooling_step(torch.zeros(1, 16, dtype=torch.uint8), 1)  # one chunk of one row
    with pytest.raises(ValueError, match="step_rows must hold FP8 bytes"):
        triton_ops.pool.write_chunks(comp, raw, torch.zeros(1, 1, 16), writes, cfg, 8, fmt)


@pytest.mark.slow
def test_fp8_kernels_compile_for_a_gpu(compile_for_gpu):
    """The attention kernel (a prefill tile: tl.dot over the decoded rows) and the pooling kernel
    over E4M3 pages, bf16 queries, head 128, GQA 4, a split context, compile for sm_80 (not run)."""
    from vllm_chunked_kv.ops.kernels import triton_attention, triton_fp8, triton_pool
    from vllm_chunked_kv.ops.plans.step_plan import StepPlan

    kind, tile_m, arch = triton_fp8.kind(fp8.PageFormat("fp8", head_size=128)), 16, 80
    cfg = ChunkedKVConfig(chunk_size=4, window=128, mitigation="boundary", pooling="key_norm")
    plan = StepPlan(cfg=cfg, raw_writes=None, writes=None, key_sets=[])
    constants = triton_attention.launch_constants(plan, num_heads=32, num_kv_heads=8, head_d=128, head_dv=128,
                                                  tile_m=tile_m, splits=2, fp8_kind=kind)
    pointers = {"q_ptr": "*bf16", "out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
                "origins_ptr": "*i32", "sinks_ptr": "*fp32"}
    pointers |= {name: "*u8" for name in ("step_ptr", "raw_ptr", "comp_ptr")}
    pointers |= {name: "*i64" for name in ("q_index_ptr", "q_pos_ptr", "raw_blocks_ptr", "raw_offsets_ptr",
                                           "raw_pos_ptr", "comp_blocks_ptr", "comp_offsets_ptr", "num_raw_ptr",
                                           "num_slots_ptr")}
    compiled = compile_for_gpu(triton_attention._chunked_kv_attention_kernel, pointers, constants, arch)
    assert compiled.asm["cubin"] and compiled.metadata.shared <= 160 * 1024
    pointers = {"step_ptr": "*u8", "raw_ptr": "*u8", "comp_ptr": "*u8", "gains_ptr": "*fp32"}
    pointers |= {name: "*i64" for name in ("heads_ptr", "src_blocks_ptr", "src_offsets_ptr", "src_step_ptr",
                                           "dst_blocks_ptr", "dst_offsets_ptr")}
    constants = dict(HEAD_D=128, D_P2=128, HEAD_DV=128, DV_P2=128, SPG=3, BLOCK_C=16, FP8=kind,
                     **triton_pool.pooling_constants(cfg))
    assert compile_for_gpu(triton_pool._chunked_kv_write_chunks_kernel, pointers, constants, arch).asm["cubin"]
