"""Chunked attention inside a transformers model (Llama-style decoders): what
`adapt` and the demo train and evaluate with, and what the perplexity and
copy-head benchmarks and the reference tests measure through.

Registers an attention function named `chunked_kv` with transformers'
`AttentionInterface`. The compression itself is the reference's
(`ops.masked.extended_kv`: the pooled rows and the additive mask of
docs/design.md §3-4, §10); this module only batches it: the batch is folded into
the KV-head axis, which the reference treats independently, and one softmax
runs over the extended key set. Gradients flow through the pooling, so the
same function trains the model under compression.

Learned per-slot gains (the trainable stand-in for DeepSeek-V4's gate,
served as `pooling="gated"`): with `gains` (a tensor of `chunk_size` logits,
or `[num_layers, chunk_size]` for gains per layer; the weights are their
softmax), the reference pools each chunk with those
weights in place of the mean (`extended_kv`'s `weights`), so a pooled row is
the gain-weighted sum of its chunk and gradients reach the logits; raw rows
are untouched. This equals the reference's gated pooling with those weights
as `slot_gains`.

Sequences must be unpadded and start at position 0 (true for the training
batches of `adapt` and the demo and their equal-length evaluation batches). With per-request
grid alignment (`align`), `grid_shifts` gives each batch row's shift
(`ChunkedKVConfig.grid_shift` of its prompt length).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from vllm_chunked_kv.core import grid
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops import fp8
from vllm_chunked_kv.ops.masked import extended_kv
from vllm_chunked_kv.ops.reference import softmax_weights

ATTN_NAME = "chunked_kv"
_CONFIG_ATTR = "chunked_kv_config"
_GAINS_ATTR = "chunked_kv_gains"  # a 1-tuple holding the gain logits (a tuple, so nn.Module does not adopt them)
_SHIFTS_ATTR = "chunked_kv_grid_shifts"  # per batch row grid shift, or None
_OBSERVER_ATTR = "chunked_kv_observer"  # a 1-tuple holding observer(layer_idx, probs, folded_k, origins), or None
_PAGES_ATTR = "chunked_kv_cache_dtype"  # an FP8 --kv-cache-dtype the rows are read through (scales 1), or None
_UNSET = object()  # marks an attribute the module did not have before `chunked_attention`
GAINS_LR_SCALE = 20.0  # learning-rate multiplier of the gain logits: the chunk_size of them learn faster than weights


def chunked_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-function signature: query [b, H, T, D], key/value [b, Hkv, T, D];
    the model's logit cap (``softcap``, Gemma 2) and learned sink logits
    (``s_aux`` [H], GPT-OSS) as `reference.softmax_weights` applies them."""
    softcap = kwargs.get("softcap") or 0.0
    sinks = kwargs.get("s_aux")  # [H] or None
    cfg: ChunkedKVConfig = getattr(module, _CONFIG_ATTR).for_layer(module.layer_idx)  # its own gains, if per layer
    lookback = kwargs.get("sliding_window") or 0  # the model's own window
    if lookback and cfg.sliding_window_layers == "window":  # kept exactly, as the backend serves it
        return window_attention(query, key, value, scaling, lookback, softcap, sinks), None
    batch, num_heads, seq_len, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    shifts = getattr(module, _SHIFTS_ATTR, None) or [0] * batch
    if len(shifts) != batch:
        raise ValueError(f"grid_shifts has {len(shifts)} entries for a batch of {batch}")
    heads = cfg.origins(module.layer_idx, num_kv_heads)
    origins = [grid.shifted(cfg, o, shift) for shift in shifts for o in heads]  # one per folded (batch, head)
    folded_k = key.permute(2, 0, 1, 3).reshape(seq_len, batch * num_kv_heads, head_dim)  # [T, b*Hkv, D]
    folded_v = value.permute(2, 0, 1, 3).reshape(seq_len, batch * num_kv_heads, -1)  # [T, b*Hkv, Dv]
    gains = getattr(module, _GAINS_ATTR, (None,))[0]
    if gains is not None and not gains_apply(cfg):
        raise ValueError("learned gains need mean pooling, hop == chunk_size and no boundary retention")
    if gains is not None and gains.dim() == 2:  # [num_layers, chunk_size]: one set of logits per layer
        gains = gains[module.layer_idx]
    weights = None if gains is None else gains.softmax(-1)  # [chunk_size]
    cache_dtype = getattr(module, _PAGES_ATTR, None)
    if cache_dtype is not None:  # FP8 pages: every row as stored and read back, pooled from those (ops/fp8.py)
        folded_k, folded_v = _as_stored(folded_k, folded_v, cache_dtype)
    ext = extended_kv(folded_k, folded_v, cfg, origins, weights=weights, lookback=lookback)
    if cache_dtype is not None:  # the pooled rows too (the raw ones are unchanged by a second trip)
        ext = ext._replace(**dict(zip(("keys", "values"), _as_stored(ext.keys, ext.values, cache_dtype))))
    ext_len = ext.keys.shape[0]  # T + N
    keys = ext.keys.view(ext_len, batch, num_kv_heads, head_dim).permute(1, 2, 0, 3)  # [b, Hkv, T+N, D]
    values = ext.values.view(ext_len, batch, num_kv_heads, -1).permute(1, 2, 0, 3)  # [b, Hkv, T+N, Dv]
    bias = ext.bias.view(seq_len, batch, num_kv_heads, ext_len).permute(1, 2, 0, 3)  # [b, Hkv, T, T+N]
    grouped_q = query.float().view(batch, num_kv_heads, group, seq_len, head_dim)  # [b, Hkv, G, T, D]
    logits = torch.matmul(grouped_q, keys.unsqueeze(2).transpose(-1, -2)) * scaling  # [b, Hkv, G, T, T+N]
    sinks = None if sinks is None else sinks.float().view(1, num_kv_heads, group, 1, 1)
    probs = softmax_weights(logits, bias.unsqueeze(2), softcap=softcap, sinks=sinks)  # [b, Hkv, G, T, T+N]
    observer = getattr(module, _OBSERVER_ATTR, (None,))[0]
    if observer is not None:
        observer(module.layer_idx, probs, folded_k, origins)
    out = torch.matmul(probs, values.unsqueeze(2))  # [b, Hkv, G, T, Dv]
    out = out.reshape(batch, num_heads, seq_len, -1).transpose(1, 2)  # [b, T, H, Dv]
    return out.to(query.dtype).contiguous(), None


def _as_stored(keys: torch.Tensor, values: torch.Tensor, cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[..., D]`` and values ``[..., Dv]`` as FP8 pages of `cache_dtype` (scales 1) give them back."""
    stored_keys, stored_values = fp8.round_trip_kv(keys, values, fp8.PageFormat(cache_dtype, keys.shape[-1]))
    return stored_keys.to(keys.dtype), stored_values.to(values.dtype)


def window_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, window: int,
                     softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A sliding-window layer, uncompressed: each query sees its last `window`
    positions, itself included (transformers' and vLLM's convention), with
    the model's cap and sinks. query [b, H, T, D], key/value [b, Hkv, T, D]
    -> [b, T, H, Dv]."""
    batch, num_heads, seq_len, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    pos = torch.arange(seq_len, device=query.device)
    seen = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)  # [T, T]
    if not softcap and sinks is None:  # torch's fused attention: no [T, T] probabilities kept for the backward
        out = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=seen, scale=scaling,
                                             enable_gqa=True)  # [b, H, T, Dv]
        return out.transpose(1, 2).to(query.dtype).contiguous()
    bias = torch.zeros(seq_len, seq_len, device=query.device).masked_fill(~seen, float("-inf"))
    grouped_q = query.float().view(batch, num_kv_heads, group, seq_len, head_dim)  # [b, Hkv, G, T, D]
    logits = torch.matmul(grouped_q, key.float().unsqueeze(2).transpose(-1, -2)) * scaling  # [b, Hkv, G, T, T]
    sinks = None if sinks is None else sinks.float().view(1, num_kv_heads, group, 1, 1)
    probs = softmax_weights(logits, bias, softcap=softcap, sinks=sinks)  # [b, Hkv, G, T, T]
    out = torch.matmul(probs, value.float().unsqueeze(2))  # [b, Hkv, G, T, Dv]
    return out.reshape(batch, num_heads, seq_len, -1).transpose(1, 2).to(query.dtype).contiguous()


def gains_apply(cfg: ChunkedKVConfig) -> bool:
    """Whether learned gains can replace `cfg`'s pooling: mean pooling of
    non-overlapping chunks, no boundary retention."""
    return cfg.pooling == "mean" and cfg.hop == cfg.chunk_size and not cfg.keep_boundary


def gain_weights(gains: torch.Tensor) -> list[float] | list[list[float]]:
    """The slot weights of gain logits ``[chunk_size]`` or ``[num_layers, chunk_size]``
    (their softmax), rounded for JSON: `slot_gains` of pooling "gated"."""
    weights = gains.detach().softmax(-1)
    if weights.dim() == 2:
        return [[round(g, 6) for g in row] for row in weights.tolist()]
    return [round(g, 6) for g in weights.tolist()]


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, chunked_attention_forward)


@contextlib.contextmanager
def chunked_attention(model, cfg: ChunkedKVConfig | None, gains: torch.Tensor | None = None,
                      grid_shifts: list[int] | None = None, observer=None,
                      cache_dtype: str | None = None) -> Iterator[None]:
    """Run `model` (a transformers Llama) with chunked attention `cfg` inside
    the block; None means full attention (eager). `gains`: learned per-slot
    gain logits; `grid_shifts`: each batch row's grid shift (see the module
    docstring); `observer(layer_idx, probs, folded_k, origins)`: called in
    every layer with the attention probabilities [b, Hkv, G, T, T+N] over the
    extended key set, the folded keys [T, b*Hkv, D] and their origins (to
    see what the model reads, `benchmarks/copy_heads.py`); `cache_dtype`: an FP8
    `--kv-cache-dtype`, whose pages (scales 1) every key and value and pooled
    row is read through, as the backend stores them (`ops/fp8.py`)."""
    previous = model.config._attn_implementation
    saved = []  # (module, {attribute: value before the block, or _UNSET})
    try:  # whatever was set is undone, even if setting up fails half-way
        if cfg is None:
            model.set_attn_implementation("eager")
        else:
            _register()
            values = {_CONFIG_ATTR: cfg, _GAINS_ATTR: (gains,), _SHIFTS_ATTR: grid_shifts,
                      _OBSERVER_ATTR: (observer,), _PAGES_ATTR: cache_dtype}
            for layer in model.model.layers:
                attn = layer.self_attn
                saved.append((attn, {name: attn.__dict__.get(name, _UNSET) for name in values}))
                for name, value in values.items():
                    setattr(attn, name, value)
            model.set_attn_implementation(ATTN_NAME)
        yield
    finally:
        for attn, before in saved:  # an outer block's settings come back; nothing stays alive past the block
            for name, value in before.items():
                if value is _UNSET:
                    attn.__dict__.pop(name, None)  # it may not have been set yet if entering failed
                else:
                    setattr(attn, name, value)
        model.set_attn_implementation(previous)
