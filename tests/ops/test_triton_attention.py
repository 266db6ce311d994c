"""Contract of vllm_chunked_kv.ops.triton_attention, run under Triton's CPU interpreter.

`attend` computes what `paged.attend` computes (fp32 within 1e-4), reading
the paged cache through a scattered block table, for:

- every mitigation (none, boundary, overlap, stride2) and staggered grids
  (stagger 'heads' and explicit origins with sinks beyond an origin);
- every pooling mode (mean, gated, key_norm), proportional on and off;
- GQA ratios 1 and 4 (and 3, not a power of two);
- batches that mix a whole prefill, chunked-prefill continuations and
  decodes, and decode-only batches, with odd lengths 1, 63 and 100 and a
  block size that divides none of them;
- one program per tile and a context split across several programs;
- no config (exact causal attention).

A whole prefill also equals `reference_chunked_attention` directly. Outputs
are NaN before the call, so an element the kernel does not write fails.
bf16 caches agree within bf16 tolerance.
"""

import math

import pytest
import torch

from vllm_chunked_kv.config import ChunkedKVConfig
from vllm_chunked_kv.ops import paged, reference

torch.set_num_threads(1)

# (context length after this step, query tokens this step) per request
MIXED = [(100, 100), (63, 1), (1, 1), (77, 20), (90, 1)]
HEAD_D = 16


def _batch(requests, num_kv_heads, head_dv, block_size=8, dtype=torch.float32, seed=0):
    """A paged cache with every request's rows on scattered pages, and its PagedBatch."""
    gen = torch.Generator().manual_seed(seed)
    pages_per = [math.ceil(s / block_size) for s, _ in requests]
    num_blocks = sum(pages_per) + 3
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(requests), max(pages_per), dtype=torch.int32)
    used = 0
    for r, count in enumerate(pages_per):
        table[r, :count] = order[used : used + count]
        used += count
    kv_cache = torch.randn(num_blocks, num_kv_heads, block_size, HEAD_D + head_dv, generator=gen).to(dtype)
    query_start = torch.tensor([0] + [q for _, q in requests]).cumsum(0)
    batch = paged.PagedBatch.from_vllm(
        query_start_loc=query_start,
        seq_lens=torch.tensor([s for s, _ in requests]),
        block_table=table,
        block_size=block_size,
    )
    return kv_cache, batch, gen


def _check(triton_ops, cfg, origins, *, group, num_kv_heads=2, requests=MIXED, head_dv=HEAD_D, splits=1, dtype=torch.float32, tol=1e-4):
    kv_cache, batch, gen = _batch(requests, num_kv_heads, head_dv, dtype=dtype)
    n = batch.query_start[-1]
    query = torch.randn(n, num_kv_heads * group, HEAD_D, generator=gen).to(dtype)
    origins_t = None if origins is None else torch.tensor(origins)
    if cfg is not None and origins_t is None:
        origins_t = torch.zeros(num_kv_heads, dtype=torch.long)
    scale = HEAD_D**-0.5
    out = torch.full((n, num_kv_heads * group, head_dv), float("nan"), dtype=dtype)
    got = triton_ops.attention.attend(query, kv_cache, batch, scale, cfg, origins_t, out=out, num_splits=splits)
    want = paged.attend(query, kv_cache, batch, scale, cfg, origins_t)
    assert not got.isnan().any(), "the kernel left elements unwritten"
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


CASES = {
    "none-mean": dict(chunk_size=4, window=8, sink_tokens=3, pooling="mean"),
    "none-gated-noprop": dict(chunk_size=4, window=9, pooling="gated", slot_gains=[0.5, 1.0, 0.0, 2.0], proportional=False),
    "none-key_norm-hop2": dict(chunk_size=4, hop=2, window=6, sink_tokens=1, pooling="key_norm"),
    "boundary-mean": dict(chunk_size=4, window=8, sink_tokens=5, mitigation="boundary"),
    "boundary-key_norm-5": dict(chunk_size=5, window=7, sink_tokens=2, mitigation="boundary", pooling="key_norm"),
    "overlap-gated": dict(chunk_size=4, window=8, sink_tokens=2, mitigation="overlap", pooling="gated", slot_gains=[1.0, 2.0, 3.0, 4.0]),
    "stride2-mean": dict(window=5, sink_tokens=1, mitigation="stride2"),
    "stride2-key_norm": dict(window=4, mitigation="stride2", pooling="key_norm"),
    "chunk6-window-over-all": dict(chunk_size=6, window=200),
}


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_equals_paged_attend(triton_ops, name, group):
    _check(triton_ops, ChunkedKVConfig(**CASES[name]), None, group=group)


@pytest.mark.parametrize(
    "settings, origins",
    [
        (dict(chunk_size=4, window=8, sink_tokens=1, mitigation="stagger"), [0, 2]),  # stagger 'heads', 2 groups
        (dict(chunk_size=4, window=8, sink_tokens=2, mitigation="stagger", stagger_groups=4, pooling="key_norm"), [1, 3]),
        (dict(chunk_size=4, window=8, sink_tokens=1, mitigation="overlap", stagger="heads"), [0, 1]),
    ],
)
@pytest.mark.parametrize("group", [1, 4])
def test_staggered_grids(triton_ops, settings, origins, group):
    _check(triton_ops, ChunkedKVConfig(**settings), origins, group=group)


def test_boundary_with_staggered_origins_and_gqa_3(triton_ops):
    cfg = ChunkedKVConfig(chunk_size=4, window=8, sink_tokens=2, mitigation="boundary", stagger=[[3, 1, 0]])
    _check(triton_ops, cfg, [3, 1, 0], group=3, num_kv_heads=3)


@pytest.mark.parametrize("name", ["none-mean", "boundary-key_norm-5", "overlap-gated"])
def test_split_context_equals_one_program(triton_ops, name):
    _check(triton_ops, ChunkedKVConfig(**CASES[name]), None, group=4, splits=3)


@pytest.mark.parametrize("group", [1, 4])
def test_no_config_is_exact_causal_attention(triton_ops, group):
    _check(triton_ops, None, None, group=group)


def test_value_width_differs_from_key_width(triton_ops):
    _check(triton_ops, ChunkedKVConfig(**CASES["boundary-mean"]), None, group=2, head_dv=24)


def test_bf16_cache(triton_ops):
    _check(triton_ops, ChunkedKVConfig(**CASES["overlap-gated"]), None, group=4, dtype=torch.bfloat16, tol=2e-2)


def test_whole_prefill_equals_reference(triton_ops):
    cfg = ChunkedKVConfig(chunk_size=4, window=8, sink_tokens=3, mitigation="boundary", pooling="key_norm")
    kv_cache, batch, gen = _batch([(63, 63)], num_kv_heads=2, head_dv=HEAD_D)
    query = torch.randn(63, 8, HEAD_D, generator=gen)
    rows = paged.gather_rows(kv_cache, batch.block_table, 63)[0]  # [Hkv, 63, D + Dv]
    keys, values = rows[..., :HEAD_D].transpose(0, 1), rows[..., HEAD_D:].transpose(0, 1)  # [63, Hkv, D] each
    origins = torch.tensor([0, 2])
    want = reference.reference_chunked_attention(query, keys, values, cfg, scale=0.3, origins=origins)
    out = torch.full_like(want, float("nan"))
    got = triton_ops.attention.attend(query, kv_cache, batch, 0.3, cfg, origins, out=out)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("group", [1, 4])
def test_decode_only_batch(triton_ops, group):
    cfg = ChunkedKVConfig(chunk_size=4, window=8, sink_tokens=3, mitigation="boundary", pooling="gated", slot_gains=[1.0, 1.0, 2.0, 1.0])
    _check(triton_ops, cfg, None, group=group, requests=[(100, 1), (63, 1), (1, 1), (9, 1)])


@pytest.mark.parametrize(
    "dtype, settings, group, tile_m, splits, arch",
    [
        ("bf16", dict(chunk_size=4, window=128, mitigation="boundary", pooling="key_norm"), 8, 1, 4, 90),  # decode
        ("fp16", dict(chunk_size=4, window=128, mitigation="overlap"), 1, 1, 1, 80),  # decode, padded rows
        ("bf16", dict(chunk_size=4, window=128, mitigation="stagger"), 4, 16, 1, 90),  # prefill tile
    ],
)
def test_compiles_for_a_gpu(compile_for_gpu, dtype, settings, group, tile_m, splits, arch):
    """The kernel as `attend` launches it compiles for sm_80 / sm_90 (not run)."""
    from vllm_chunked_kv.ops import triton_attention

    constants = triton_attention.launch_constants(
        ChunkedKVConfig(**settings), num_heads=8 * group, num_kv_heads=8, head_d=128, head_dv=128,
        tile_m=tile_m, splits=splits,
    )
    pointers = {"q_ptr": f"*{dtype}", "kv_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "part_acc_ptr": "*fp32",
                "part_ml_ptr": "*fp32", "gains_ptr": "*fp32"}
    pointers |= {name: "*i32" for name in ("block_table_ptr", "work_req_ptr", "work_first_ptr", "query_start_ptr",
                                           "seq_lens_ptr", "origins_ptr")}
    compiled = compile_for_gpu(triton_attention._chunked_kv_attention_kernel, pointers, constants, arch)
    assert compiled.asm["cubin"]
    assert compiled.metadata.shared <= 160 * 1024  # fits an A100's and an H100's shared memory
