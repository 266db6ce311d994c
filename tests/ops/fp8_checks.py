"""Checks every implementation's FP8 test runs (tests/ops/test_{cpu,cuda,triton}_fp8.py):
how a kernel stores bytes, through its `write_chunks` pooling stored rows.

A `pool(rows, chunk, fmt)` function is an implementation's `write_chunks` over
`pooling_step(rows, chunk)`: stored rows ``[M * chunk, Dk + Dv]`` (uint8) pooled
with equal gains, returning the bytes it stored, ``[M, Dk + Dv]`` on the CPU.
`every_code_step` is a step whose keys hold every finite code, for how a
kernel reads them.
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


def every_code_step(cache_dtype: str, one_hot: bool) -> tuple[tuple, fp8.PageFormat]:
    """One prefill of 128 tokens, GQA 4 over 2 KV heads, keys of 64 dims (values of 40: no
    value pair products, whose bf16 probabilities would round), on FP8 pages
    whose keys hold every finite code (NaN and E5M2's infinities excepted): dim d
    of a key holds exponent field d mod 2^E (E exponent bits), token n's sign and
    mantissa (n mod 2^(M+1)); rows beyond the window pooled (chunk 4, window 32).
    Queries bf16: with `one_hot`, one dim per query row, of magnitude 2^(bias - e)
    for that dim's exponent field e (2^(bias - 1) for subnormals), so that every
    logit is a single code's value brought near 1 (exact in fp32 however the dot
    product is summed); else Gaussian. Returns the arguments of ``attend(query,
    stored, comp, raw, plan, scale)`` (scale 1) and the page format (scales 1)."""
    from .schedule import prefill_pages

    man, bias = (3, 7) if cache_dtype in ("fp8", "fp8_e4m3") else (2, 15)
    fields, head, head_v = 1 << (7 - man), 64, 40
    fmt = fp8.PageFormat(cache_dtype, head_size=head)
    n, hq, hkv = 128, 8, 2
    field = torch.arange(head) % fields  # [D]: each dim's exponent field
    pattern = torch.arange(n)[:, None] % (1 << (man + 1))  # [n, 1]: sign and mantissa bits
    finite_field = torch.where(field == fields - 1, fields - 2, field) if man == 2 else field  # E5M2: no inf/NaN
    keys = (pattern >> man << 7) | (finite_field << man) | (pattern & ((1 << man) - 1))  # [n, D] codes
    if man == 3:
        keys = torch.where(keys & 0x7F == 0x7F, keys - 1, keys)  # E4M3: 0x7f and 0xff are NaN
    gen = torch.Generator().manual_seed(3)
    values = fp8.quantise(torch.randn(n, hkv, head_v, generator=gen), fmt)  # [n, Hkv, Dv] bytes
    stored = torch.cat([keys.to(torch.uint8)[:, None].expand(n, hkv, head), values], dim=-1)  # [n, Hkv, D + Dv]
    if one_hot:
        dim = (torch.arange(n)[:, None] * hq + torch.arange(hq)) % head  # [n, Hq]: each row's one dim
        exponent = bias - field[dim].clamp(min=1)
        query = torch.zeros(n, hq, head)
        query.scatter_(-1, dim[..., None], (2.0 ** exponent.float())[..., None])
    else:
        query = torch.randn(n, hq, head, generator=gen)
    pager, plan = prefill_pages(ChunkedKVConfig(chunk_size=4, window=32, sink_tokens=4), stored, head, fmt)
    return (query.to(torch.bfloat16), stored, pager.comp, pager.raw, plan, 1.0), fmt
