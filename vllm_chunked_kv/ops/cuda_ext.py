"""The optional CUDA extension (``csrc/``): built on first use, only where it can run.

`load()` JIT-builds and imports the extension with
``torch.utils.cpp_extension.load`` when a CUDA device is present, or when
``CHUNKED_KV_BUILD_CUDA=1`` forces a build (e.g. to check a toolchain).
Otherwise it compiles nothing and returns None; `unavailable_reasons()` says
why. A failed build or import is one warning naming the cause, then None for
the rest of the process.

`pool_chunk` and `attend` wrap the extension with the signatures of
`triton_pool.pool_chunk` and `triton_attention.attend`; `unsupported`
lists the limits of its kernels (the dispatcher uses the Triton kernels
beyond them).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from types import ModuleType

import torch

from vllm_chunked_kv.config import ChunkedKVConfig
from vllm_chunked_kv.ops.paged import PagedBatch

BUILD_ENV = "CHUNKED_KV_BUILD_CUDA"
SOURCES_DIR = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = ("chunked_kv_kernels.cu", "chunked_kv_ext.cpp")
MAX_GROUP, MAX_HEAD_SIZE, MAX_CHUNK = 8, 256, 64  # csrc/chunked_kv.h
_NO_SEAL_WINDOW = 1 << 30

_state: dict = {"tried": False, "module": None, "reason": None}


def _build_blocker() -> str | None:
    """Why not to try building at all (None: try)."""
    forced = os.environ.get(BUILD_ENV, "") == "1"
    if not forced and not torch.cuda.is_available():
        return f"no CUDA device (torch.cuda.is_available() is False) and {BUILD_ENV}=1 is not set"
    missing = [name for name in SOURCES if not (SOURCES_DIR / name).is_file()]
    if missing:
        return f"CUDA sources not found: {', '.join(str(SOURCES_DIR / m) for m in missing)}"
    return None


def load() -> ModuleType | None:
    """The built extension, or None (see `unavailable_reasons`)."""
    if _state["tried"]:
        return _state["module"]
    _state["tried"] = True
    blocker = _build_blocker()
    if blocker is not None:
        _state["reason"] = blocker
        return None
    try:
        from torch.utils import cpp_extension

        _state["module"] = cpp_extension.load(
            name="chunked_kv_cuda",
            sources=[str(SOURCES_DIR / name) for name in SOURCES],
            extra_include_paths=[str(SOURCES_DIR)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3"],
            verbose=False,
        )
    except Exception as exc:  # any build or import failure: fall back, once, loudly
        cause = (str(exc).strip().splitlines() or [""])[-1][:300]
        _state["reason"] = f"building the CUDA extension failed: {type(exc).__name__}: {cause}"
        warnings.warn(f"vllm-chunked-kv: {_state['reason']}; using the Triton or PyTorch kernels", RuntimeWarning, stacklevel=2)
    return _state["module"]


def unavailable_reasons() -> list[str]:
    """Why the extension cannot be used in this process (empty: it can). Tries `load()`."""
    if load() is not None:
        return []
    return [_state["reason"]]


def unsupported(cfg: ChunkedKVConfig | None, head_size: int, head_size_v: int, group: int) -> list[str]:
    """Shapes and settings beyond the CUDA kernels' limits."""
    reasons = []
    if group > MAX_GROUP:
        reasons.append(f"{group} query heads per KV head (the CUDA kernel takes at most {MAX_GROUP})")
    if max(head_size, head_size_v) > MAX_HEAD_SIZE:
        reasons.append(f"head size {max(head_size, head_size_v)} (the CUDA kernel takes at most {MAX_HEAD_SIZE})")
    if cfg is not None and cfg.chunk_size > MAX_CHUNK:
        reasons.append(f"chunk_size {cfg.chunk_size} (the CUDA kernel takes at most {MAX_CHUNK})")
    return reasons


def _default_splits(blocks: int, max_seq_len: int, device: torch.device) -> int:
    """Blocks per (token, KV head): enough to fill the device twice over when
    few tokens read a long context, at most one per 512 positions."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(-(-2 * sms // blocks), -(-max_seq_len // 512), 64))


def _pooling_args(cfg: ChunkedKVConfig, device) -> tuple:
    gains = torch.zeros(cfg.chunk_size) if cfg.pooling == "key_norm" else torch.tensor(cfg.normalised_gains())
    slots = cfg.pooled_slots
    return gains.to(device=device, dtype=torch.float32), cfg.hop, slots.start, slots.stop, cfg.pooling == "key_norm"


def pool_chunk(keys: torch.Tensor, values: torch.Tensor, cfg: ChunkedKVConfig, *, out=None):
    """As `reference.pool_chunk`, on the GPU: fp32 ``(key_row, value_row, log_weight)``."""
    module = load()
    if module is None:
        raise RuntimeError(f"CUDA extension unavailable: {_state['reason']}")
    if keys.shape[-2] != cfg.chunk_size or values.shape[:-1] != keys.shape[:-1]:
        raise ValueError(f"expected [..., {cfg.chunk_size}, head_dim] keys and values, got {tuple(keys.shape)}, {tuple(values.shape)}")
    lead = keys.shape[:-2]
    flat_k = keys.reshape(-1, cfg.chunk_size, keys.shape[-1]).contiguous()  # [..., cs, D] -> [M, cs, D]
    flat_v = values.reshape(-1, cfg.chunk_size, values.shape[-1]).contiguous()  # [..., cs, Dv] -> [M, cs, Dv]
    gains, hop, lo, hi, key_norm = _pooling_args(cfg, keys.device)
    key_row, value_row, log_weight = module.pool_chunk(flat_k, flat_v, gains, hop, lo, hi, key_norm, cfg.log_weight)
    result = (key_row.view(*lead, -1), value_row.view(*lead, -1), log_weight.view(lead))  # [M, ...] -> [..., ...]
    if out is None:
        return result
    for dst, src in zip(out, result):
        dst.copy_(src)
    return out


def attend(query: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch, scale: float,
           cfg: ChunkedKVConfig | None = None, origins: torch.Tensor | None = None, *,
           out: torch.Tensor | None = None, num_splits: int | None = None) -> torch.Tensor:
    """As `paged.attend`, on the GPU: query ``[n, Hq, D]`` -> ``[n, Hq, Dv]``."""
    module = load()
    if module is None:
        raise RuntimeError(f"CUDA extension unavailable: {_state['reason']}")
    n, num_heads, head_d = query.shape
    num_kv_heads, head_dv = kv_cache.shape[1], kv_cache.shape[-1] - head_d
    if out is None:
        out = query.new_empty(n, num_heads, head_dv)
    if n == 0:
        return out
    device = query.device
    if cfg is None:
        cfg, origins = ChunkedKVConfig(chunk_size=1, window=_NO_SEAL_WINDOW), None
    if origins is None:
        origins = torch.zeros(num_kv_heads, dtype=torch.int32, device=device)
    q_lens = torch.tensor(batch.query_start[1:]) - torch.tensor(batch.query_start[:-1])  # [R]
    token_req = torch.repeat_interleave(torch.arange(len(q_lens), dtype=torch.int32), q_lens)  # [n]
    if num_splits is None:
        num_splits = _default_splits(n * num_kv_heads, max(batch.seq_lens), device)
    part_acc = torch.empty(num_splits * n * num_heads * head_dv if num_splits > 1 else 0, dtype=torch.float32, device=device)
    part_ml = torch.empty(2 * num_splits * n * num_heads if num_splits > 1 else 0, dtype=torch.float32, device=device)
    gains, hop, lo, hi, key_norm = _pooling_args(cfg, device)
    module.attend(
        query, kv_cache, out, batch.block_table.to(torch.int32),
        token_req.to(device), torch.tensor(batch.query_start, dtype=torch.int32, device=device),
        torch.tensor(batch.seq_lens, dtype=torch.int32, device=device),
        origins.to(device=device, dtype=torch.int32).contiguous(), gains, part_acc, part_ml,
        float(scale), cfg.window, cfg.sink_tokens, cfg.chunk_size, hop, lo, hi, key_norm,
        bool(cfg.keep_boundary), cfg.log_weight, num_splits,
    )
    return out


def _reset_for_tests() -> None:
    """Forget the outcome of `load()` (tests only)."""
    _state.update(tried=False, module=None, reason=None)
