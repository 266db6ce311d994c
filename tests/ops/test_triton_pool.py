"""Contract of vllm_chunked_kv.ops.triton_pool, run under Triton's CPU interpreter.

- `pool_chunk` equals `reference.pool_chunk` (fp32, within 1e-5) for every
  pooling mode (mean, gated, key_norm), with and without keep_boundary
  (interior-only pooling), proportional on and off, chunk sizes that are and
  are not powers of two, key and value widths that differ and are not powers
  of two, any leading dims, and a chunk count that is not a multiple of the
  kernel's block.
- It writes every element of its outputs (they are NaN before the call).
- It accepts half-precision inputs and still pools in fp32.
- It rejects the shapes the reference rejects.
"""

import math

import pytest
import torch

from vllm_chunked_kv.config import ChunkedKVConfig
from vllm_chunked_kv.ops import reference

torch.set_num_threads(1)

CONFIGS = {
    "mean-4": dict(chunk_size=4, pooling="mean"),
    "mean-3-noprop": dict(chunk_size=3, pooling="mean", proportional=False),
    "gated-4": dict(chunk_size=4, pooling="gated", slot_gains=[0.1, 2.0, 0.0, 1.0]),
    "key_norm-6": dict(chunk_size=6, pooling="key_norm"),
    "boundary-mean-5": dict(chunk_size=5, mitigation="boundary", pooling="mean"),
    "boundary-gated-4": dict(chunk_size=4, mitigation="boundary", pooling="gated", slot_gains=[5.0, 1.0, 3.0, 7.0]),
    "boundary-key_norm-4": dict(chunk_size=4, mitigation="boundary", pooling="key_norm"),
    "overlap-key_norm-4": dict(chunk_size=4, mitigation="overlap", pooling="key_norm"),
    "stride2-gated": dict(mitigation="stride2", pooling="gated", slot_gains=[1.0, 3.0]),
}


def _nan_out(lead, head_d, head_dv):
    return (
        torch.full((*lead, head_d), float("nan")),
        torch.full((*lead, head_dv), float("nan")),
        torch.full(lead, float("nan")),
    )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_equals_reference_for_every_pooling_mode(triton_ops, name):
    cfg = ChunkedKVConfig(window=16, **CONFIGS[name])
    gen = torch.Generator().manual_seed(len(name))
    lead = (7, 3)  # 21 chunks: not a multiple of the 16-chunk block
    keys = torch.randn(*lead, cfg.chunk_size, 20, generator=gen) * 2
    values = torch.randn(*lead, cfg.chunk_size, 12, generator=gen)
    out = _nan_out(lead, 20, 12)
    got = triton_ops.pool.pool_chunk(keys, values, cfg, out=out)
    want = reference.pool_chunk(keys, values, cfg)
    for g, w in zip(got, want):
        assert not g.isnan().any(), "the kernel left elements unwritten"
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert got[2].unique().tolist() == pytest.approx([cfg.log_weight])


def test_keep_boundary_pools_the_interior_only(triton_ops):
    cfg = ChunkedKVConfig(chunk_size=4, window=8, mitigation="boundary")
    keys = torch.zeros(1, 4, 16)
    values = torch.arange(4.0).view(1, 4, 1).expand(1, 4, 16).clone()  # slot i holds value i
    values[0, 0] = 1000.0  # boundary slots must not leak in
    values[0, 3] = -1000.0
    key_row, value_row, log_weight = triton_ops.pool.pool_chunk(keys, values, cfg)
    torch.testing.assert_close(value_row, torch.full((1, 16), 1.5))
    torch.testing.assert_close(log_weight, torch.tensor([math.log(2)]))


def test_half_inputs_pool_in_fp32(triton_ops):
    cfg = ChunkedKVConfig(chunk_size=4, window=8, pooling="key_norm")
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(5, 4, 16, generator=gen).to(torch.bfloat16)
    values = torch.randn(5, 4, 16, generator=gen).to(torch.bfloat16)
    got = triton_ops.pool.pool_chunk(keys, values, cfg)
    want = reference.pool_chunk(keys, values, cfg)
    assert all(g.dtype == torch.float32 for g in got)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_rejects_what_the_reference_rejects(triton_ops):
    cfg = ChunkedKVConfig(chunk_size=4, window=8)
    with pytest.raises(ValueError, match="expected"):
        triton_ops.pool.pool_chunk(torch.zeros(2, 3, 8), torch.zeros(2, 3, 8), cfg)
    with pytest.raises(ValueError, match="out tensors"):
        triton_ops.pool.pool_chunk(torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), cfg, out=_nan_out((3,), 8, 8))


def test_compiles_for_a_gpu(compile_for_gpu):
    from vllm_chunked_kv.ops import triton_pool

    cfg = ChunkedKVConfig(chunk_size=4, window=16, pooling="key_norm", mitigation="boundary")
    pointers = {"keys_ptr": "*bf16", "values_ptr": "*bf16", "gains_ptr": "*fp32", "key_out_ptr": "*fp32",
                "value_out_ptr": "*fp32", "log_weight_out_ptr": "*fp32"}
    constants = dict(HEAD_D=128, D_P2=128, HEAD_DV=128, DV_P2=128, BLOCK_C=16, **triton_pool.pooling_constants(cfg))
    compiled = compile_for_gpu(triton_pool._chunked_kv_pool_kernel, pointers, constants)
    assert compiled.asm["cubin"]
