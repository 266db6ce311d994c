"""Checks every implementation's FP8 test runs (tests/ops/test_{cpu,cuda,triton}_fp8.py):
how a kernel stores bytes, through its `write_chunks` pooling stored rows.

A `pool(rows, chunk, fmt)` function is an implementation's `write_chunks` over
`pooling_step(rows, chunk)`: stored rows ``[M * chunk, Dk + Dv]`` (uint8) pooled
with equal gains, returning the bytes it stored, ``[M, Dk + Dv]`` on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops import fp8
from vllm_chunked_kv.ops.plans.step_plan import ChunkWrites

Pool = Callable[[torch.Tensor, int, fp8.PageFormat], torch.Tensor]


def pooling_step(rows: torch.Tensor, chunk: int):
    """(raw pages ``[M, 1, chunk, W]`` holding `rows`, compressed pages ``[M, 1, 1, W]``
    of a 0x55 filler, step rows (none read), the writes pooling page m's rows into
    compressed page m, mean pooling's config) on the rows' device."""
    m, width = rows.shape[0] // chunk, rows.shape[1]
    long = dict(dtype=torch.long, device=rows.device)
    blocks = torch.arange(m, **long)
    none = torch.zeros(0, **long)
    writes = ChunkWrites(heads=torch.zeros(m, **long), src_blocks=blocks[:, None].expand(m, chunk).contiguous(),
                         src_offsets=torch.arange(chunk, **long).expand(m, chunk).contiguous(),
                         src_step=torch.full((m, chunk), -1, **long), dst_blocks=blocks[:, None],
                         dst_offsets=torch.zeros(m, 1, **long), zero_heads=none, zero_blocks=none,
                         zero_offsets=none)
    raw = rows.view(m, 1, chunk, width).clone()  # [blocks, Hkv, rows, Dk + Dv]
    comp = torch.full((m, 1, 1, width), 0x55, dtype=torch.uint8, device=rows.device)
    step_rows = torch.zeros(1, 1, width, dtype=torch.uint8, device=rows.device)
    return raw, comp, step_rows, writes, ChunkedKVConfig(chunk_size=chunk, window=chunk, pooling="mean")


def check_every_code(pool: Pool, cache_dtype: str, device: str = "cpu") -> None:
    """Each of the 256 codes, as a key and as a value, pooled alone (gain 1), comes back
    as the value torch reads from it (NaN codes NaN, E5M2's infinities saturated; a
    pooled -0 may come back +0 and a NaN's sign may change)."""
    fmt = fp8.PageFormat(cache_dtype, head_size=128, k_scale=0.25, v_scale=3.0)
    codes = torch.arange(256, dtype=torch.uint8)[None]  # [1, 256]: keys 0..127, values 128..255
    both = torch.cat([codes, codes.flip(-1)])  # [2, 256]: every code as a key and as a value
    got = pool(both.to(device), 1, fmt)
    want = fp8.quantise(fp8.dequantise(both, fmt), fmt)
    torch.testing.assert_close(fp8.dequantise(got, fmt), fp8.dequantise(want, fmt), rtol=0, atol=0, equal_nan=True)


def check_mean_rounding(pool: Pool, cache_dtype: str, device: str = "cpu") -> None:
    """The mean of two stored rows (magnitudes from subnormal to saturated; over 100
    elements lie midway between two codes) is stored as `fp8.quantise` stores it:
    rounded to nearest even, saturated (-0 and +0 alike)."""
    fmt = fp8.PageFormat(cache_dtype, head_size=40, k_scale=0.5, v_scale=0.125)
    gen = torch.Generator().manual_seed(1)
    rows = fp8.quantise(torch.randn(400, 96, generator=gen) * 4.0 ** torch.randint(-6, 7, (400, 1), generator=gen),
                        fmt)  # [200 chunks x 2 rows, 96]
    got = pool(rows.to(device), 2, fmt)
    read = fp8.dequantise(rows, fmt).view(200, 2, 96)
    mean = read[:, 0] * 0.5 + read[:, 1] * 0.5  # [200, 96]
    ties = fp8.quantise(mean * (1 + 2 ** -20), fmt) != fp8.quantise(mean * (1 - 2 ** -20), fmt)  # midway between codes
    assert ties.sum() > 100
    torch.testing.assert_close(fp8.dequantise(got, fmt), fp8.dequantise(fp8.quantise(mean, fmt), fmt), rtol=0, atol=0)
