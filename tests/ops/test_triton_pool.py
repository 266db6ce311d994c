"""Contract of vllm_chunked_kv.ops.kernels.triton_pool's `write_chunks` in isolation
(its use inside whole schedules is covered by test_triton_attention.py).

Under Triton's CPU interpreter: a step's chunk writes equal
`compressed.write_chunks` for every pooling mode with and without boundary
retention, chunks pooled from stored raw rows, the step's own rows, or both,
fp32 (1e-5) and bf16 (one rounding) (every target slot written, nothing else). The kernel compiles ahead of time for sm_90 (not run).
"""

import pytest
import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops.kernels import compressed
from vllm_chunked_kv.ops.plans.step_plan import ChunkWrites

HEAD_D, HEAD_DV, NUM_KV_HEADS = 16, 8, 2


def _writes(cfg: ChunkedKVConfig, num_chunks: int, num_tokens: int, gen) -> ChunkWrites:
    """Random chunks: each row comes from the step (index) or a stored raw row."""
    spg = 3 if cfg.keep_boundary else 1
    from_step = torch.rand(num_chunks, cfg.chunk_size, generator=gen) < 0.5
    src_step = torch.where(from_step, torch.randint(0, num_tokens, (num_chunks, cfg.chunk_size), generator=gen), -1)
    dst = torch.randperm(6 * 8, generator=gen)[: num_chunks * spg].view(num_chunks, spg)  # distinct slots
    empty = torch.zeros(0, dtype=torch.long)
    return ChunkWrites(
        heads=torch.randint(0, NUM_KV_HEADS, (num_chunks,), generator=gen),
        src_blocks=torch.randint(0, 5, (num_chunks, cfg.chunk_size), generator=gen),
        src_offsets=torch.randint(0, 4, (num_chunks, cfg.chunk_size), generator=gen),
        src_step=src_step, dst_blocks=dst // 8, dst_offsets=dst % 8,
        zero_heads=empty, zero_blocks=empty, zero_offsets=empty,
    )


@pytest.mark.parametrize(
    "settings",
    [
        dict(chunk_size=4, window=8),
        dict(chunk_size=4, window=8, pooling="gated", slot_gains=[0.1, 0.5, 0.2, 0.2]),
        dict(chunk_size=5, window=8, pooling="key_norm", mitigation="boundary"),
        dict(chunk_size=4, window=8, mitigation="boundary", pooling="gated", slot_gains=[1.0, 2.0, 3.0, 4.0]),
        dict(chunk_size=1, window=3),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_chunks_equals_torch(triton_ops, settings, dtype):
    cfg = ChunkedKVConfig(**settings)
    gen = torch.Generator().manual_seed(3)
    writes = _writes(cfg, num_chunks=11, num_tokens=9, gen=gen)
    raw = torch.randn(5, NUM_KV_HEADS, 4, HEAD_D + HEAD_DV, generator=gen).to(dtype)
    step_rows = torch.randn(9, NUM_KV_HEADS, HEAD_D + HEAD_DV, generator=gen).to(dtype)
    want = torch.full((6, NUM_KV_HEADS, 8, HEAD_D + HEAD_DV), float("nan"), dtype=dtype)
    compressed.write_chunks(want, raw, step_rows, writes, cfg, HEAD_D)
    got = torch.full_like(want, float("nan"))
    got = triton_ops.schedule.call_returning(  # the cache comes back from the worker
        "vllm_chunked_kv.ops.kernels.triton_pool", "write_chunks", got, raw, step_rows, writes, cfg, HEAD_D)[0]
    written = want.isfinite()
    assert written.sum() == 11 * (3 if cfg.keep_boundary else 1) * (HEAD_D + HEAD_DV)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of an fp32 sum in another order
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True)


def test_write_chunks_compiles_for_a_gpu(compile_for_gpu):
    from vllm_chunked_kv.ops.kernels import triton_pool

    cfg = ChunkedKVConfig(chunk_size=4, window=16, pooling="key_norm", mitigation="boundary")
    pointers = {"step_ptr": "*bf16", "raw_ptr": "*bf16", "comp_ptr": "*bf16", "gains_ptr": "*fp32"}
    pointers |= {name: "*i64" for name in ("heads_ptr", "src_blocks_ptr", "src_offsets_ptr", "src_step_ptr",
                                           "dst_blocks_ptr", "dst_offsets_ptr")}
    constants = dict(HEAD_D=128, D_P2=128, HEAD_DV=128, DV_P2=128, SPG=3, BLOCK_C=16, FP8=0,
                     **triton_pool.pooling_constants(cfg))
    compiled = compile_for_gpu(triton_pool._chunked_kv_write_chunks_kernel, pointers, constants)
    assert compiled.asm["cubin"]
