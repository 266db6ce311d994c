"""The optional CUDA extension (``csrc/cuda/``, ``csrc/common/``): built on first use, only where it can run.

`load()` JIT-builds and imports the extension with
``torch.utils.cpp_extension.load`` when a CUDA device is present, or when
``CHUNKED_KV_BUILD_CUDA=1`` forces a build (e.g. to check a toolchain).
Otherwise it compiles nothing and returns None; `unavailable_reasons()` says
why. A failed build or import is one warning naming the cause, then None for
the rest of the process.

`write_chunks` and `attend` have the signatures and semantics of
`compressed.write_chunks` / `compressed.attend` (and of the Triton kernels,
whose visibility rule they share): fp32 math; caches ``[num_blocks, Hkv,
rows_per_block, D + Dv]`` with contiguous rows and any block/head/row
strides, in the model's dtype or FP8 pages (uint8 bytes, `ops/fp8.py`: read
as bytes times the layer's scales, pooled rows rounded once); step rows
``[n, Hkv, D + Dv]``; the plan's int64 index tensors. The
plan needs no bias (`build_plan(..., bias=False)`). The zero slots of a
step's writes are a torch index assignment here.

Limits (`unsupported` reports them; the dispatcher then uses the Triton
kernels):

- at most 32 query heads per KV head and head sizes (keys, values) up to
  256. An attention block keeps its query rows (``tile × group``), their
  accumulators and 32 key rows in fp32 shared memory; a decode tile has
  ``group`` rows, and within these limits it fits the opt-in shared memory
  of an A100 or H100 (137 KB at most). With the extension loaded,
  `unsupported` also checks the tile against the device's own limit;
  multi-token tiles shrink to fit it;
- positions, slot indices and the window are below ``2**31``;
- query, step rows and ``out`` share a dtype in the kernels, the two caches
  another (fp32, fp16 or bf16); other combinations are converted here
  (exactly: to fp32, or through a temporary ``out``). On FP8 pages the step
  rows are the step's stored bytes, as the caches', and the query and
  ``out`` any float dtype.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import ModuleType

import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops import fp8
from vllm_chunked_kv.ops.fp8 import PageFormat
from vllm_chunked_kv.ops.kernels import jit, shared
from vllm_chunked_kv.ops.plans.step_plan import ChunkWrites, KeySet, StepPlan

BUILD_ENV = "CHUNKED_KV_BUILD_CUDA"


SOURCES_DIR = jit.SOURCES_DIR
SOURCES = ("cuda/chunked_kv_write.cu", "cuda/chunked_kv_attention.cu", "cuda/chunked_kv_ext.cpp")  # under SOURCES_DIR
HEADERS = ("cuda/chunked_kv.h", "common/chunked_kv_types.h", "common/chunked_kv_args.h",
           "common/chunked_kv_binding.h", "cuda/chunked_kv_common.cuh", "cuda/chunked_kv_fp8.cuh",
           "cuda/cpu_emulation.h")
MAX_TILE_ROWS = 32  # csrc/cuda/chunked_kv.h kMaxTileRows: query rows of a multi-token tile
MAX_GROUP, MAX_HEAD_SIZE = 32, 256  # a decode tile within these fits an A100's or H100's shared memory

_state: dict = {"tried": False, "module": None, "reason": None}


def _build_blocker() -> str | None:
    """Why not to try building at all (None: try)."""
    forced = os.environ.get(BUILD_ENV, "") == "1"
    if not forced and not torch.cuda.is_available():
        return f"no CUDA device (torch.cuda.is_available() is False) and {BUILD_ENV}=1 is not set"
    missing = [name for name in SOURCES + HEADERS if not (SOURCES_DIR / name).is_file()]
    if missing:
        return f"CUDA sources not found: {', '.join(str(SOURCES_DIR / m) for m in missing)}"
    return None


def headers_digest() -> str:
    """A digest of the headers: part of the build flags, so that a changed
    header rebuilds the extension (the JIT build hashes the sources only)."""
    digest = hashlib.sha256()
    for name in HEADERS:
        digest.update((SOURCES_DIR / name).read_bytes())
    return digest.hexdigest()[:16]


def load() -> ModuleType | None:
    """The built extension, or None (see `unavailable_reasons`)."""
    return jit.load_once(_state, _build_blocker, _build, "the CUDA extension", "using the Triton or PyTorch kernels")


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name="chunked_kv_cuda",
        sources=[str(SOURCES_DIR / name) for name in SOURCES],
        extra_include_paths=[str(SOURCES_DIR)],
        extra_cflags=["-O3", f"-DCHUNKED_KV_HEADERS={headers_digest()}"],
        extra_cuda_cflags=["-O3", f"-DCHUNKED_KV_HEADERS={headers_digest()}"],
        verbose=False,
    )


def unavailable_reasons() -> list[str]:
    """Why the extension cannot be used in this process (empty: it can). Tries `load()`."""
    if load() is not None:
        return []
    return [_state["reason"]]


def unsupported(head_size: int, head_size_v: int, group: int) -> list[str]:
    """Shapes beyond the kernels' limits (see the module docstring); with
    the extension loaded, also a decode tile beyond the device's shared memory."""
    reasons = []
    if group > MAX_GROUP:
        reasons.append(f"{group} query heads per KV head (the CUDA kernel takes at most {MAX_GROUP})")
    if max(head_size, head_size_v) > MAX_HEAD_SIZE:
        reasons.append(f"head size {max(head_size, head_size_v)} (the CUDA kernel takes at most {MAX_HEAD_SIZE})")
    module = _state["module"]
    limit = _shared_limit(module, None)
    if not reasons and limit is not None:
        need = module.attend_shared_bytes(group, head_size, head_size_v)
        if need > limit:
            reasons.append(f"a decode tile of {group} query heads per KV head with head sizes {head_size}/"
                           f"{head_size_v} needs {need} bytes of shared memory; the device allows {limit} per block")
    return reasons


def _module() -> ModuleType:
    return jit.require(_state, load, "CUDA extension")


def _device_limits(module: ModuleType, device: torch.device | None) -> tuple[int, int] | None:
    """(multiprocessors, opt-in shared bytes per block) of `device` (None:
    the current CUDA device), or None without a device to ask."""
    if module.EMULATED:
        return module.device_limits(0)
    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    return module.device_limits(index)


def _shared_limit(module: ModuleType | None, device: torch.device | None) -> int | None:
    limits = None if module is None else _device_limits(module, device)
    return None if limits is None else limits[1]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` with contiguous rows (a copy only if its last dimension is strided)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def write_chunks(comp_cache: torch.Tensor, raw_cache: torch.Tensor, step_rows: torch.Tensor, writes: ChunkWrites,
                 cfg: ChunkedKVConfig, head_size: int, fmt: PageFormat | None = None) -> None:
    """`compressed.write_chunks` in one launch (one block per chunk). FP8
    pages (`fmt`): step_rows are the step's stored bytes."""
    shared.zero_unused_slots(comp_cache, writes)
    if not writes.heads.numel():
        return
    module = _module()
    slots = cfg.pooled_slots
    key_norm = cfg.pooling == "key_norm"
    gains = shared.step_gains(writes, cfg, comp_cache.device)
    c = torch.Tensor.contiguous
    module.write_chunks(comp_cache, raw_cache, _rows(step_rows), gains, c(writes.heads), c(writes.src_blocks),
                        c(writes.src_offsets), c(writes.src_step), c(writes.dst_blocks), c(writes.dst_offsets),
                        head_size, slots.start, slots.stop, key_norm, *fp8.binding_args(fmt))


def attend(query: torch.Tensor, step_rows: torch.Tensor, comp_cache: torch.Tensor, raw_cache: torch.Tensor,
           plan: StepPlan, scale: float, *, out: torch.Tensor | None = None, num_splits: int | None = None,
           block_m: int | None = None, softcap: float = 0.0, sinks: torch.Tensor | None = None,
           lookback: int = 0, fmt: PageFormat | None = None) -> torch.Tensor:
    """`compressed.attend` (bias not needed): query ``[n, Hq, D]``, step_rows
    ``[n, Hkv, D + Dv]`` -> ``[n, Hq, Dv]`` in the query dtype, written into
    ``out`` when given, with the model's logit cap, sink logits ``[Hq]``
    and the layer's own sliding window as there (slots behind it are not read). ``num_splits``: blocks per tile and KV head (None:
    enough to fill the device). ``block_m``: queries per tile of a
    multi-token request (None: up to 32 query rows, as shared memory allows).
    FP8 pages (`fmt`): step_rows are the step's stored bytes."""
    module = _module()
    out, group = shared.attend_output(query, raw_cache, out)
    n, num_heads, head_d = query.shape
    num_kv_heads, head_dv = raw_cache.shape[1], raw_cache.shape[-1] - head_d
    if n == 0:
        return out
    query, step_rows = _rows(query), _rows(step_rows)
    if fmt is None and step_rows.dtype != query.dtype:  # one dtype in the kernel: fp32 holds both exactly
        query, step_rows = query.float(), step_rows.float()
    direct = out.dtype == query.dtype and out.stride(-1) == 1
    target = out if direct else query.new_empty(n, num_heads, head_dv)
    limits = _device_limits(module, query.device)
    tile_q = block_m or _tile_queries(module, group, head_d, head_dv, None if limits is None else limits[1])
    tiles = [(keys, 1 if keys.query_index.shape[1] == 1 else tile_q) for keys in plan.key_sets]
    splits = num_splits or _default_splits(tiles, num_kv_heads, limits)
    part_acc = part_ml = target  # unused when there is one split
    if splits > 1:
        part_acc = torch.empty(splits, n, num_heads, head_dv, dtype=torch.float32, device=query.device)
        part_ml = torch.empty(2, splits, n, num_heads, dtype=torch.float32, device=query.device)
    key_args, grid_args = shared.kernel_args(plan, scale)
    sink_logits = query.new_empty(0) if sinks is None else sinks.to(device=query.device, dtype=torch.float32)
    for (_, tile), args in zip(tiles, key_args):
        module.attend(query, step_rows, comp_cache, raw_cache, target, part_acc, part_ml, *args, *grid_args,
                      tile, splits, float(softcap), sink_logits.contiguous(), int(lookback), *fp8.binding_args(fmt))
    if splits > 1:
        module.merge_splits(part_acc, part_ml, target)
    if target is not out:
        out.copy_(target)
    return out


def _tile_queries(module: ModuleType, group: int, head_d: int, head_dv: int, shared_limit: int | None) -> int:
    """Queries per tile of a multi-token request: up to MAX_TILE_ROWS query
    rows, fewer while a tile's shared memory exceeds the device's limit."""
    tile = max(1, MAX_TILE_ROWS // group)
    if shared_limit is None:
        return tile
    while tile > 1 and module.attend_shared_bytes(tile * group, head_d, head_dv) > shared_limit:
        tile //= 2
    return tile


def _default_splits(tiles: list[tuple[KeySet, int]], num_kv_heads: int, limits: tuple[int, int] | None) -> int:
    """Blocks per (tile, KV head): enough to fill the device twice over when
    few tiles cover a long context, never more than one per 512 keys."""
    if limits is None:
        return 1
    blocks = num_kv_heads * sum(keys.query_index.shape[0] * -(-keys.query_index.shape[1] // tile)
                                for keys, tile in tiles)
    max_keys = max((keys.raw_blocks.shape[1] + keys.query_index.shape[1] + keys.num_slot_columns
                    for keys, _ in tiles), default=0)
    if blocks == 0:
        return 1
    return max(1, min(-(-2 * limits[0] // blocks), -(-max_keys // 512), 64))


def _reset_for_tests() -> None:
    """Forget the outcome of `load()` (tests only)."""
    _state.update(tried=False, module=None, reason=None)
