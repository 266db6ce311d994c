"""Triton pooling of sealed chunks into compressed rows (DESIGN.md §3-4).

`pool_chunk` has the signature and semantics of `reference.pool_chunk`:
keys, values ``[..., chunk_size, head_dim]`` -> fp32 ``(key_row, value_row,
log_weight)``. The slot-weight math (`_chunked_kv_slot_weights`) and the
weighted sum (`_chunked_kv_pool_rows`) are Triton helpers that the attention
kernel (`triton_attention.py`) calls too, so both kernels pool alike.

Every pooling mode is one code path: fixed gains (``mean``, ``gated``) come
from `cfg.normalised_gains()` as a small tensor, ``key_norm`` is a softmax of
the keys' L2 norms over the pooled slots; ``keep_boundary`` only narrows the
pooled slots to ``[1, chunk_size - 1)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_chunked_kv.config import ChunkedKVConfig

# Whether this module's kernels run under Triton's CPU interpreter (decided
# when they are decorated, i.e. when this module is imported).
INTERPRETED = bool(triton.knobs.runtime.interpret)

# A finite "minus infinity": masked slots get weight exp(-1e30 - max) == 0
# without the NaN that exp(-inf - -inf) gives on a fully masked row.
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _chunked_kv_slot_weights(
    keys,  # [BLOCK_C, CS_P2, D_P2] fp32, zeros where masked
    slot,  # [CS_P2] slot index within the chunk
    gains_ptr,  # [CHUNK_SIZE] fp32 normalised gains (unused for key_norm)
    CHUNK_SIZE: tl.constexpr,
    POOL_LO: tl.constexpr,
    POOL_HI: tl.constexpr,
    KEY_NORM: tl.constexpr,
):
    """Pooling weight of each slot: ``[BLOCK_C, CS_P2]`` for key_norm,
    ``[1, CS_P2]`` (broadcastable) for fixed gains; 0 on unpooled slots."""
    pooled = (slot >= POOL_LO) & (slot < POOL_HI)  # [CS_P2]
    if KEY_NORM:
        norms = tl.sqrt(tl.sum(keys * keys, axis=2))  # [BLOCK_C, CS_P2, D_P2] -> [BLOCK_C, CS_P2]
        norms = tl.where(pooled[None, :], norms, _NEG_BIG)
        e = tl.exp(norms - tl.max(norms, axis=1)[:, None])  # [BLOCK_C, CS_P2]
        weights = e / tl.sum(e, axis=1)[:, None]
    else:
        gains = tl.load(gains_ptr + slot, mask=pooled & (slot < CHUNK_SIZE), other=0.0)  # [CS_P2]
        weights = gains[None, :]  # [1, CS_P2]
    return weights


@triton.jit
def _chunked_kv_pool_rows(weights, rows):
    """Weighted sum over slots: weights ``[BLOCK_C | 1, CS_P2]``, rows
    ``[BLOCK_C, CS_P2, D]`` -> ``[BLOCK_C, D]``."""
    return tl.sum(weights[:, :, None] * rows, axis=1)


@triton.jit
def _chunked_kv_pool_kernel(
    keys_ptr,  # [M, CHUNK_SIZE, HEAD_D]
    values_ptr,  # [M, CHUNK_SIZE, HEAD_DV]
    gains_ptr,  # [CHUNK_SIZE] fp32
    key_out_ptr,  # [M, HEAD_D] fp32
    value_out_ptr,  # [M, HEAD_DV] fp32
    log_weight_out_ptr,  # [M] fp32
    num_chunks,
    log_weight,
    stride_kc, stride_ks, stride_kd,
    stride_vc, stride_vs, stride_vd,
    CHUNK_SIZE: tl.constexpr,
    CS_P2: tl.constexpr,
    HEAD_D: tl.constexpr,
    D_P2: tl.constexpr,
    HEAD_DV: tl.constexpr,
    DV_P2: tl.constexpr,
    POOL_LO: tl.constexpr,
    POOL_HI: tl.constexpr,
    KEY_NORM: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    chunk = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    slot = tl.arange(0, CS_P2)  # [CS_P2]
    d = tl.arange(0, D_P2)
    dv = tl.arange(0, DV_P2)
    chunk_ok = chunk < num_chunks
    row_ok = chunk_ok[:, None] & (slot < CHUNK_SIZE)[None, :]  # [BLOCK_C, CS_P2]
    chunk64 = chunk.to(tl.int64)
    k_off = chunk64[:, None, None] * stride_kc + slot[None, :, None] * stride_ks + d[None, None, :] * stride_kd
    keys = tl.load(keys_ptr + k_off, mask=row_ok[:, :, None] & (d < HEAD_D)[None, None, :], other=0.0).to(tl.float32)
    v_off = chunk64[:, None, None] * stride_vc + slot[None, :, None] * stride_vs + dv[None, None, :] * stride_vd
    values = tl.load(values_ptr + v_off, mask=row_ok[:, :, None] & (dv < HEAD_DV)[None, None, :], other=0.0).to(tl.float32)
    weights = _chunked_kv_slot_weights(keys, slot, gains_ptr, CHUNK_SIZE, POOL_LO, POOL_HI, KEY_NORM)
    key_row = _chunked_kv_pool_rows(weights, keys)  # [BLOCK_C, D_P2]
    value_row = _chunked_kv_pool_rows(weights, values)  # [BLOCK_C, DV_P2]
    tl.store(key_out_ptr + chunk64[:, None] * HEAD_D + d[None, :], key_row, mask=chunk_ok[:, None] & (d < HEAD_D)[None, :])
    tl.store(value_out_ptr + chunk64[:, None] * HEAD_DV + dv[None, :], value_row, mask=chunk_ok[:, None] & (dv < HEAD_DV)[None, :])
    tl.store(log_weight_out_ptr + chunk64, tl.zeros([BLOCK_C], dtype=tl.float32) + log_weight, mask=chunk_ok)


# ------------------------------------------------------------------ host side


def gains_tensor(cfg: ChunkedKVConfig, device: torch.device) -> torch.Tensor:
    """The fixed slot gains a kernel reads (``[chunk_size]`` fp32; zeros for
    key_norm, whose weights come from the keys)."""
    if cfg.pooling == "key_norm":
        return torch.zeros(cfg.chunk_size, dtype=torch.float32, device=device)
    return torch.tensor(cfg.normalised_gains(), dtype=torch.float32, device=device)


def pooling_constants(cfg: ChunkedKVConfig) -> dict:
    """The constexpr parameters that describe a config's pooling."""
    slots = cfg.pooled_slots
    return {
        "CHUNK_SIZE": cfg.chunk_size,
        "CS_P2": triton.next_power_of_2(cfg.chunk_size),
        "POOL_LO": slots.start,
        "POOL_HI": slots.stop,
        "KEY_NORM": cfg.pooling == "key_norm",
    }


def pool_chunk(
    keys: torch.Tensor,
    values: torch.Tensor,
    cfg: ChunkedKVConfig,
    *,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    block_chunks: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pool chunks into compressed rows, as `reference.pool_chunk`.

    keys ``[..., chunk_size, head_dim]``, values ``[..., chunk_size, Dv]``;
    returns fp32 ``(key_row [..., head_dim], value_row [..., Dv],
    log_weight [...])``, written into ``out`` (contiguous fp32 tensors of
    those shapes) when given.
    """
    if keys.shape[-2] != cfg.chunk_size or values.shape[:-1] != keys.shape[:-1]:
        raise ValueError(
            f"expected [..., {cfg.chunk_size}, head_dim] keys and values, got {tuple(keys.shape)}, {tuple(values.shape)}"
        )
    if len(cfg.pooled_slots) == 0:
        raise ValueError("a chunk without interior has no pooled row")
    lead = keys.shape[:-2]
    head_d, head_dv = keys.shape[-1], values.shape[-1]
    flat_k = keys.reshape(-1, cfg.chunk_size, head_d)  # [..., cs, D] -> [M, cs, D]
    flat_v = values.reshape(-1, cfg.chunk_size, head_dv)  # [..., cs, Dv] -> [M, cs, Dv]
    num = flat_k.shape[0]
    if out is None:
        out = (
            torch.empty(*lead, head_d, dtype=torch.float32, device=keys.device),
            torch.empty(*lead, head_dv, dtype=torch.float32, device=keys.device),
            torch.empty(lead, dtype=torch.float32, device=keys.device),
        )
    _check_out(out, [(*lead, head_d), (*lead, head_dv), tuple(lead)])
    key_row, value_row, log_weight = out
    if num:
        _chunked_kv_pool_kernel[(triton.cdiv(num, block_chunks),)](
            flat_k, flat_v, gains_tensor(cfg, keys.device), key_row, value_row, log_weight,
            num, cfg.log_weight,
            *flat_k.stride(), *flat_v.stride(),
            HEAD_D=head_d, D_P2=triton.next_power_of_2(head_d),
            HEAD_DV=head_dv, DV_P2=triton.next_power_of_2(head_dv),
            BLOCK_C=block_chunks, **pooling_constants(cfg),
        )
    return key_row, value_row, log_weight


def _check_out(out, shapes) -> None:
    for tensor, shape in zip(out, shapes):
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != torch.float32 or not tensor.is_contiguous():
            raise ValueError(f"out tensors must be contiguous fp32 of shapes {shapes}, got {[tuple(t.shape) for t in out]}")
