"""Contract of FP8 pages (`ops/fp8.py`) and of the implementations that read them.

- Storing: a row becomes one byte per element, keys divided by k_scale and
  values by v_scale; values beyond the format's largest saturate to it (no
  NaN, no infinity); a value the format holds survives the round trip
  exactly; E4M3 (``fp8``, ``fp8_e4m3``) and E5M2 (``fp8_e5m2``) differ.
- The PyTorch path on FP8 pages equals the reference read through the same
  pages (`reference_chunked_attention(..., fmt=)`) on the schedule harness,
  every step, for every setting of the harness (mitigations, pooling modes,
  sinks, staggered and aligned grids, dynamic boundaries), a model's logit
  options and prefix caching's every-row pages (E4M3; E5M2 for the
  settings that pool differently). The pages hold
  bytes, and a byte poisoned NaN that is read fails the run.
- A pooled row is quantised once: its bytes are the quantised pool of the
  raw rows as stored, whichever step completed the chunk.
- Dispatch: with an FP8 cache the implementations that do not read FP8
  pages say so; on a CPU the choice falls to one that does; a forced one that
  does not stops startup with one line naming it.
"""

from __future__ import annotations

import pytest
import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops import dispatch, fp8
from vllm_chunked_kv.ops.reference import pool_chunk

from .schedule import CONFIGS, FP8_SCHEDULES, LOGIT_OPTIONS, kernel_lengths, run_schedule

@pytest.mark.parametrize("cache_dtype", [*fp8.FORMATS])
def test_rows_are_stored_in_one_byte_with_their_scales(cache_dtype):
    fmt = fp8.PageFormat(cache_dtype, head_size=4, k_scale=0.5, v_scale=2.0)
    rows = torch.tensor([[1.0, -0.75, 3.0, 1e6, 1.0, -0.75, 3.0, -1e6]])  # [1, Dk + Dv]
    stored = fp8.quantise(rows, fmt)
    assert stored.dtype == torch.uint8 and stored.shape == rows.shape
    back = fp8.dequantise(stored, fmt)
    assert back.isfinite().all()
    largest = fmt.largest
    torch.testing.assert_close(back, torch.tensor([[1.0, -0.75, 3.0, largest * 0.5, 1.0, -0.75, 3.0, -largest * 2.0]]))
    assert fp8.round_trip(rows, fmt)[0, 1] == -0.75  # held exactly: x / scale is in the format


def test_the_two_formats_differ():
    x = torch.tensor([[0.3, 300.0]])
    e4m3 = fp8.round_trip(x, fp8.PageFormat("fp8_e4m3", head_size=1))
    e5m2 = fp8.round_trip(x, fp8.PageFormat("fp8_e5m2", head_size=1))
    assert not torch.equal(e4m3, e5m2)
    assert torch.equal(e4m3, fp8.round_trip(x, fp8.PageFormat("fp8", head_size=1)))  # vLLM's "fp8" is E4M3


@pytest.mark.parametrize("name, cache_dtype", FP8_SCHEDULES)
def test_torch_path_equals_the_reference_on_fp8_pages(name, cache_dtype):
    cfg = ChunkedKVConfig(**CONFIGS[name])
    steps = run_schedule(cfg, kernel_lengths(cfg, 3), seed=3, impl="torch", cache_dtype=cache_dtype, tol=1e-4,
                         decode_plan=name in ("none", "boundary-gated"))
    assert steps > 0


@pytest.mark.parametrize("options", ["softcap-sinks", "window"])
def test_torch_path_on_fp8_pages_with_logit_options(options):
    cfg = ChunkedKVConfig(**CONFIGS["boundary-gated"])
    assert run_schedule(cfg, kernel_lengths(cfg, 4), seed=4, cache_dtype="fp8", tol=1e-4, **LOGIT_OPTIONS[options])


def test_every_row_paged_on_fp8_pages():
    cfg = ChunkedKVConfig(**CONFIGS["stagger-heads"])
    assert run_schedule(cfg, kernel_lengths(cfg, 5), seed=5, cache_dtype="fp8_e5m2", cache_all=True, tol=1e-4)


def test_a_poisoned_byte_that_is_read_fails():
    """The harness's poison reaches the output when a dropped row is read (the check can fail)."""
    fmt = fp8.PageFormat("fp8", head_size=2)
    poisoned = torch.full((1, 4), 0x7F, dtype=torch.uint8)
    assert fp8.dequantise(poisoned, fmt).isnan().all()
    assert fp8.dequantise(poisoned, fp8.PageFormat("fp8_e5m2", head_size=2)).isnan().all()


def test_a_pooled_row_is_quantised_once_from_the_stored_rows():
    from vllm_chunked_kv.ops.kernels import compressed
    from vllm_chunked_kv.ops.plans.step_plan import ChunkWrites

    cfg = ChunkedKVConfig(chunk_size=4, window=4)
    fmt = fp8.PageFormat("fp8", head_size=3, k_scale=0.1, v_scale=0.3)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 1, 6, generator=gen)  # [chunk, Hkv, Dk + Dv]
    stored = fp8.quantise(rows, fmt)
    raw = torch.zeros(2, 1, 4, 6, dtype=torch.uint8)
    raw[1, 0, :2] = stored[:2, 0]  # the first two rows stored by an earlier step, the last two are the step's own
    comp = torch.zeros(2, 1, 4, 6, dtype=torch.uint8)
    t = lambda rows: torch.tensor(rows)  # noqa: E731
    none = torch.zeros(0, dtype=torch.long)
    writes = ChunkWrites(heads=t([0]), src_blocks=t([[1, 1, 1, 1]]), src_offsets=t([[0, 1, 2, 3]]),
                         src_step=t([[-1, -1, 0, 1]]), dst_blocks=t([[1]]), dst_offsets=t([[2]]),
                         zero_heads=none, zero_blocks=none, zero_offsets=none)
    compressed.write_chunks(comp, raw, stored[2:], writes, cfg, 3, fmt=fmt)
    read = fp8.dequantise(stored, fmt)[:, 0]  # [chunk, Dk + Dv]: the rows as the pages hold them
    key_row, value_row, _ = pool_chunk(read[:, :3], read[:, 3:], cfg)
    assert torch.equal(comp[1, 0, 2], fp8.quantise(torch.cat([key_row, value_row]), fmt))
    assert not comp[[0, 1, 1, 1], 0, [2, 0, 1, 3]].any()  # nothing else written


def test_dispatch_takes_an_fp8_reader(monkeypatch):
    assert dispatch.available("torch", "cpu", cache_dtype="fp8") == []
    assert {"torch", "cpp", "triton"} <= set(dispatch.FP8_READERS)
    dispatch.clear_choices()
    monkeypatch.delenv(dispatch.IMPL_ENV, raising=False)
    assert dispatch.choose("cpu", head_size=8, cache_dtype="fp8") in dispatch.FP8_READERS
    assert dispatch.forced_fp8_refusal("fp8") is None
    # kernels that do not read FP8 pages: the CUDA extension's, taken off the list (whether it reads them or not)
    monkeypatch.setattr(dispatch, "FP8_READERS", tuple(impl for impl in dispatch.FP8_READERS if impl != "cuda"))
    assert any("FP8" in reason for reason in dispatch.available("cuda", "cpu", cache_dtype="fp8_e5m2"))
    for forced in ("cpp", "triton", "cuda", "cuda+triton"):
        monkeypatch.setenv(dispatch.IMPL_ENV, forced)
        unable = [impl for impl in forced.split("+") if impl not in dispatch.FP8_READERS]
        refusal = dispatch.forced_fp8_refusal("fp8")
        assert (refusal is None) == (not unable), forced
        if unable:
            assert refusal.startswith(f"--kv-cache-dtype fp8: CHUNKED_KV_IMPL={forced}") and unable[0] in refusal
    dispatch.clear_choices()
