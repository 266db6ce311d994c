"""Contract of the C++ CPU kernels on FP8 pages (csrc/cpu/, `cpu_ext` with ``fmt=``).

- Conversion: the kernels store a value as torch's cast stores it (rounded
  to nearest even, saturated at the format's largest, NaN kept), and read
  every one of the 256 codes of both formats as torch reads it: a chunk of
  one row pooled with gain 1 gives back its own value; the mean of two rows
  (where ties to even are common) gives the bytes `fp8.quantise` gives.
- On the schedule harness (`schedule.run_schedule`, pages of bytes poisoned
  with a NaN byte, random power-of-two scales), at every step the pages the
  kernels write equal the PyTorch path's (`schedule._check_fp8_pages`: one
  code apart at most, where a pooled sum rounds differently) and every
  output equals the reference read through the same pages, for every
  setting (`schedule.FP8_SCHEDULES`), GQA 2 and 4, the model's logit
  options, split contexts and query tiles, on every instruction set this
  CPU has.
- bf16 queries over FP8 pages (where the CPU has AVX-512 BF16, decode and
  packed tiles read keys and values as bf16 lanes through VBMI byte
  tables: FP8 values are bf16 exactly) equal the reference within bf16
  tolerance, for heads of 64 and 40; values of 64 take pair products
  (counted), values of 40 not. The tables read every finite code exactly: with one-hot
  queries (each logit one code's value) the output equals the AVX-512
  kernel's fp32 products bit for bit, decode and packed tiles alike, while
  Gaussian queries round differently there (a different path ran).
- Forced onto the library GEMM (oneDNN's batch-reduce GEMM, what runs on
  matrix units), multi-token tiles of bf16 queries over FP8 pages of both
  formats take both products there (counted) and equal the reference
  within bf16 tolerance (the queries and probabilities are bf16; FP8 values
  are bf16 exactly).
- The kernels ran: their call counters grow with PyTorch's attention
  disabled. The binding refuses fp32 step rows over FP8 pages (it takes the
  stored bytes) with one message.
"""

import pytest
import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops import dispatch, fp8
from vllm_chunked_kv.ops.kernels import compressed, cpu_ext

from .fp8_checks import check_every_code, check_mean_rounding, every_code_step, pooling_step
from .schedule import CONFIGS, FP8_SCHEDULES, LOGIT_OPTIONS, kernel_lengths, run_schedule
from .test_cpu_ext import gemm, isa, module  # noqa: F401 (fixtures)

torch.set_num_threads(1)


def _pool(rows: torch.Tensor, chunk: int, fmt: fp8.PageFormat) -> torch.Tensor:
    """What `cpu_ext.write_chunks` stores (`fp8_checks.Pool`)."""
    raw, comp, step_rows, writes, cfg = pooling_step(rows, chunk)
    cpu_ext.write_chunks(comp, raw, step_rows, writes, cfg, fmt.head_size, fmt=fmt)
    return comp[:, 0, 0]


@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_every_code_reads_and_stores_as_torch_does(module, cache_dtype):
    check_every_code(_pool, cache_dtype)


@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_a_mean_rounds_to_nearest_even_and_saturates(module, cache_dtype):
    check_mean_rounding(_pool, cache_dtype)


@pytest.mark.parametrize("name, cache_dtype", FP8_SCHEDULES)
@pytest.mark.parametrize("group", [2, 4])
def test_kernels_equal_the_reference_on_fp8_pages(module, name, cache_dtype, group):
    cfg = ChunkedKVConfig(**CONFIGS[name])
    assert run_schedule(cfg, kernel_lengths(cfg, group), seed=group, impl="cpp", group=group,
                        cache_dtype=cache_dtype, tol=1e-4) > 4


@pytest.mark.parametrize("options", ["softcap-sinks", "window-sinks"])
def test_logit_options_splits_and_tiles_on_fp8_pages(module, options):
    cfg = ChunkedKVConfig(**CONFIGS["boundary-gated"])
    assert run_schedule(cfg, kernel_lengths(cfg, 4), seed=4, impl="cpp", group=4, cache_dtype="fp8", tol=1e-4,
                        attend_kwargs=dict(num_splits=3, block_m=5), **LOGIT_OPTIONS[options])


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_every_instruction_set_on_fp8_pages(module, isa, cache_dtype):
    """Each instruction set's byte loads (whole vectors and masked tails: heads of 40 and 24)."""
    for each in module.supported_isas():
        isa(each)
        cfg = ChunkedKVConfig(**CONFIGS["stagger-heads"])
        run_schedule(cfg, kernel_lengths(cfg, 6), seed=6, impl="cpp", group=3, head_size=40, head_size_v=24,
                     cache_dtype=cache_dtype, tol=1e-4, attend_kwargs=dict(block_m=5))


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("head_size", [64, 40])
def test_bf16_queries_over_fp8_pages(module, cache_dtype, head_size):
    before = module.pair_value_tiles()
    cfg = ChunkedKVConfig(**CONFIGS["boundary-gated"])
    assert run_schedule(cfg, kernel_lengths(cfg, 7), seed=7, impl="cpp", group=3, head_size=head_size,
                        head_size_v=head_size, dtype=torch.bfloat16, cache_dtype=cache_dtype, tol=3e-2,
                        attend_kwargs=dict(block_m=5)) > 4
    takes_pairs = "avx512bf16" in module.supported_isas() and head_size % 32 == 0
    assert (module.pair_value_tiles() > before) == takes_pairs


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("block_m", [1, 16])  # decode tiles (4 rows), packed tiles (64 rows)
def test_fp8_keys_read_as_bf16_lanes_exactly(module, isa, cache_dtype, block_m):
    if "avx512bf16" not in module.supported_isas():
        pytest.skip("this CPU has no AVX-512 BF16 with VBMI")
    for one_hot in (True, False):
        args, fmt = every_code_step(cache_dtype, one_hot)
        outs = {}
        for each in ("avx512bf16", "avx512"):
            isa(each)
            out = torch.full((*args[0].shape[:2], 40), float("nan"))  # fp32: a logit's rounding is not lost in bf16
            cpu_ext.attend(*args, out=out, block_m=block_m, fmt=fmt)
            assert out.isfinite().all()
            outs[each] = out
        if one_hot:
            assert torch.equal(outs["avx512bf16"], outs["avx512"])
        else:
            torch.testing.assert_close(outs["avx512bf16"], outs["avx512"], atol=1e-3, rtol=1e-3)  # logits up to ~10^4
            assert not torch.equal(outs["avx512bf16"], outs["avx512"])


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_library_products_on_fp8_pages(module, gemm, cache_dtype):
    gemm("library")
    before = module.library_tiles()
    cfg = ChunkedKVConfig(**CONFIGS["boundary-gated"])
    assert run_schedule(cfg, kernel_lengths(cfg, 5), seed=5, impl="cpp", group=4, dtype=torch.bfloat16,
                        cache_dtype=cache_dtype, tol=3e-2, attend_kwargs=dict(block_m=5)) > 4  # 20-row tiles
    assert module.library_tiles() > before


def test_the_kernels_read_the_fp8_pages(module, monkeypatch):
    monkeypatch.setattr(compressed, "attend", lambda *a, **k: pytest.fail("the PyTorch attention ran"))
    assert "cpp" in dispatch.FP8_READERS
    writes, attends = module.calls()
    cfg = ChunkedKVConfig(**CONFIGS["boundary-gated"])
    steps = run_schedule(cfg, [63, 100], seed=2, impl="cpp", group=2, cache_dtype="fp8", tol=1e-4)
    after = module.calls()
    assert after[1] - attends >= steps and after[0] - writes >= 1


def test_fp32_step_rows_over_fp8_pages_are_refused(module):
    raw, comp, _, w, _ = pooling_step(torch.zeros(1, 16, dtype=torch.uint8), 1)  # one chunk of one row
    with pytest.raises(RuntimeError, match="step_rows must be the step's stored bytes"):
        module.write_chunks(comp, raw, torch.zeros(1, 1, 16), torch.ones(1), w.heads, w.src_blocks, w.src_offsets,
                            w.src_step, w.dst_blocks, w.dst_offsets, w.zero_heads, w.zero_blocks, w.zero_offsets,
                            8, 0, 1, False, "fp8", 1.0, 1.0)
