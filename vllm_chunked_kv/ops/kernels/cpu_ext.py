"""The C++ CPU kernels (``csrc/cpu/``, ``csrc/common/``): built on first use, cached, with a fallback.

`load()` JIT-builds and imports the extension with
``torch.utils.cpp_extension.load`` (OpenMP, ``-O3``; torch caches the build
under ``TORCH_EXTENSIONS_DIR`` and rebuilds when a source or a flag changes,
the flags carrying a digest of the headers). ``CHUNKED_KV_BUILD_CPP=0``
forbids building. A failed build or import is one warning naming the cause,
then None for the rest of the process; `unavailable_reasons()` says why, and
the dispatcher falls back to the PyTorch path.

The kernels are compiled once per instruction set (AVX-512 with BF16 dot
products, AVX-512, AVX2, scalar) and the widest this CPU supports runs;
``CHUNKED_KV_CPU_ISA`` names another (tests), `describe()` reports which.
The two products of a multi-token bf16 tile (prefill pieces) go through
oneDNN's batch-reduce GEMM as ATen exposes it, on the matrix units, where
the CPU has them (AMX); elsewhere the hand-written register tiles are
faster and run. ``CHUNKED_KV_CPU_GEMM`` = ``auto`` | ``library`` |
``tiles`` forces one (the library runs on any CPU, without matrix units
slower: tests).

`write_chunks` and `attend` have the signatures and semantics of
`compressed.write_chunks` / `compressed.attend` (visibility from the plan's
ranges and positions, as the Triton and CUDA kernels compute it; the plan
needs no bias): fp32 math over caches ``[num_blocks, Hkv, rows_per_block,
D + Dv]`` in fp32, fp16 or bf16 with contiguous rows and any
block/head/row strides, or FP8 pages (uint8 bytes, `ops/fp8.py`), read in
place. Queries are read as fp32 (converted
here when they are not), step rows in the cache dtype or fp32 (others are
converted to fp32, exactly), ``out`` is written in its own dtype.

Limits (`unsupported` reports them): at most 128 query heads per KV head,
value heads up to 1024, chunks up to 256 tokens.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops import fp8
from vllm_chunked_kv.ops.fp8 import PageFormat
from vllm_chunked_kv.ops.kernels import jit, shared
from vllm_chunked_kv.ops.plans.step_plan import ChunkWrites, KeySet, StepPlan, derived

BUILD_ENV = "CHUNKED_KV_BUILD_CPP"
ISA_ENV = "CHUNKED_KV_CPU_ISA"
GEMM_ENV = "CHUNKED_KV_CPU_GEMM"  # auto | library | tiles: the products of multi-token bf16 tiles
SOURCES_DIR: Path = jit.SOURCES_DIR
SOURCES = ("cpu/chunked_kv_cpu_ext.cpp", "cpu/chunked_kv_cpu_avx512bf16.cpp", "cpu/chunked_kv_cpu_avx512.cpp",
           "cpu/chunked_kv_cpu_avx2.cpp", "cpu/chunked_kv_cpu_scalar.cpp")  # under SOURCES_DIR
HEADERS = ("common/chunked_kv_types.h", "common/chunked_kv_args.h", "common/chunked_kv_binding.h",
           "cpu/chunked_kv_cpu.h", "cpu/chunked_kv_cpu_simd.h", "cpu/chunked_kv_cpu_tile.h",
           "cpu/chunked_kv_cpu_bf16.h", "cpu/chunked_kv_cpu_block.h", "cpu/chunked_kv_cpu_attend.h",
           "cpu/chunked_kv_cpu_write.h", "cpu/chunked_kv_cpu_plan.h", "cpu/chunked_kv_cpu_library.h")
NO_SINKS = torch.empty(0)  # `attend`'s sinks argument for a model without them
MAX_TILE_ROWS = 128  # csrc/cpu/chunked_kv_cpu.h kMaxTileRows: query rows of a tile (queries x GQA group)
MAX_HEAD_SIZE_V, MAX_CHUNK = 1024, 256

_state: dict = {"tried": False, "module": None, "reason": None, "flags": None}


def build_flags() -> list[str]:
    """Compiler flags of the build; the headers' digest makes a changed header
    rebuild it (the JIT build hashes the sources only)."""
    digest = hashlib.sha256(b"".join((SOURCES_DIR / name).read_bytes() for name in HEADERS)).hexdigest()[:16]
    return ["-O3", "-fopenmp", f"-DCHUNKED_KV_HEADERS={digest}"]


def _build_blocker() -> str | None:
    """Why not to try building at all (None: try)."""
    if os.environ.get(BUILD_ENV, "") == "0":
        return f"{BUILD_ENV}=0 forbids building the C++ kernels"
    missing = [name for name in SOURCES + HEADERS if not (SOURCES_DIR / name).is_file()]
    if missing:
        return f"C++ sources not found: {', '.join(str(SOURCES_DIR / m) for m in missing)}"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH; set CXX)"
    return None


def load() -> ModuleType | None:
    """The built extension, or None (see `unavailable_reasons`)."""
    return jit.load_once(_state, _build_blocker, _build, "the C++ CPU kernels", "using the PyTorch path")


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    flags = build_flags()
    module = cpp_extension.load(name="chunked_kv_cpu", sources=[str(SOURCES_DIR / name) for name in SOURCES],
                                extra_include_paths=[str(SOURCES_DIR)], extra_cflags=flags,
                                extra_ldflags=["-fopenmp"], verbose=False)
    isa = os.environ.get(ISA_ENV, "").strip()
    if isa:
        module.set_isa(isa)
    module.set_gemm(os.environ.get(GEMM_ENV, "auto").strip().lower() or "auto")
    _state["flags"] = flags
    return module


def loaded() -> ModuleType | None:
    """The extension if this process has already built or loaded it (never builds)."""
    return _state["module"]


def unavailable_reasons() -> list[str]:
    """Why the kernels cannot be used in this process (empty: they can). Tries `load()`."""
    return [] if load() is not None else [_state["reason"]]


def unsupported(head_size: int, head_size_v: int, group: int) -> list[str]:
    """Shapes beyond the kernels' limits (see the module docstring)."""
    reasons = []
    if group > MAX_TILE_ROWS:
        reasons.append(f"{group} query heads per KV head (the C++ kernel takes at most {MAX_TILE_ROWS})")
    if head_size_v > MAX_HEAD_SIZE_V:
        reasons.append(f"value head size {head_size_v} (the C++ kernel takes at most {MAX_HEAD_SIZE_V})")
    return reasons


def describe() -> str:
    """What runs: the instruction set, the threads, the build flags and the built library."""
    module = load()
    if module is None:
        return f"unavailable: {_state['reason']}"
    return (f"{module.isa()} kernels (this CPU: {', '.join(module.supported_isas())}), prefill products on "
            f"{module.gemm_path()}, {torch.get_num_threads()} OpenMP threads, flags {' '.join(_state['flags'])}, "
            f"{module.__file__}")


def _module() -> ModuleType:
    return jit.require(_state, load, "C++ CPU kernels")


def _rows(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` with contiguous rows (in `dtype` if given): a copy only when needed."""
    t = t if dtype is None else t.to(dtype)
    return t if t.stride(-1) == 1 else t.contiguous()


def _step_rows(step_rows: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Step rows as the kernels read them: in the cache dtype or fp32 (exact)."""
    return _rows(step_rows, None if step_rows.dtype in (cache_dtype, torch.float32) else torch.float32)


def write_raw(raw_cache: torch.Tensor, step_rows: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> None:
    """`shared.write_raw` in one call (no tensor ops per layer)."""
    _module().write_raw(raw_cache, _rows(step_rows, raw_cache.dtype), slots.long(), tokens.contiguous())


def write_chunks(comp_cache: torch.Tensor, raw_cache: torch.Tensor, step_rows: torch.Tensor, writes: ChunkWrites,
                 cfg: ChunkedKVConfig, head_size: int, fmt: PageFormat | None = None) -> None:
    """`compressed.write_chunks` in one call: the slots below a head's first
    group zeroed (the decode plan's null-page placeholders skipped), then one
    OpenMP loop over the chunks (index tables prepared once per step). FP8
    pages (`fmt`): step_rows are the step's stored bytes."""
    if not writes.heads.numel() and not writes.zero_heads.numel():
        return
    slots = cfg.pooled_slots

    def tables():
        c = torch.Tensor.contiguous
        return (c(writes.heads), c(writes.src_blocks), c(writes.src_offsets), c(writes.src_step),
                c(writes.dst_blocks), c(writes.dst_offsets), c(writes.zero_heads), c(writes.zero_blocks),
                c(writes.zero_offsets))

    args = derived(writes, "cpp", tables)
    gains = shared.step_gains(writes, cfg, comp_cache.device)
    _module().write_chunks(comp_cache, raw_cache, _step_rows(step_rows, comp_cache.dtype), gains, *args,
                           head_size, slots.start, slots.stop, cfg.pooling == "key_norm", *fp8.binding_args(fmt))


def attend(query: torch.Tensor, step_rows: torch.Tensor, comp_cache: torch.Tensor, raw_cache: torch.Tensor,
           plan: StepPlan, scale: float, *, out: torch.Tensor | None = None, num_splits: int | None = None,
           block_m: int | None = None, softcap: float = 0.0, sinks: torch.Tensor | None = None,
           lookback: int = 0, fmt: PageFormat | None = None) -> torch.Tensor:
    """`compressed.attend` (bias not needed): query ``[n, Hq, D]``, step_rows
    ``[n, Hkv, D + Dv]`` -> ``[n, Hq, Dv]`` in the query dtype, written into
    ``out`` when given, with the model's logit cap, sink logits ``[Hq]`` and
    the layer's own sliding window as there (slots behind the window are not
    read: vLLM may have freed their pages). ``num_splits``: work items per (tile, KV head), each over a
    contiguous share of the keys (None: enough to occupy torch's threads).
    ``block_m``: queries per tile of a multi-token request (None: 128 query
    rows). FP8 pages (`fmt`): step_rows are the step's stored bytes."""
    module = _module()
    out, group = shared.attend_output(query, raw_cache, out)
    n, num_heads, head_dv = out.shape
    if n == 0:
        return out
    num_kv_heads = raw_cache.shape[1]
    direct = out.dtype in (torch.float32, torch.float16, torch.bfloat16) and out.stride(-1) == 1
    target = out if direct else torch.empty(n, num_heads, head_dv, dtype=torch.float32)
    tile_q = block_m or max(1, MAX_TILE_ROWS // group)
    tiles = [(keys, 1 if keys.query_index.shape[1] == 1 else tile_q) for keys in plan.key_sets]
    splits = num_splits or default_splits(tiles, num_kv_heads, torch.get_num_threads())
    part_acc = part_ml = target  # unused when there is one split
    if splits > 1:
        part_acc = torch.empty(splits, n, num_heads, head_dv, dtype=torch.float32)
        part_ml = torch.empty(2, splits, n, num_heads, dtype=torch.float32)
    q32 = _rows(query, torch.float32)
    steps = _step_rows(step_rows, comp_cache.dtype) if fmt is None else _rows(step_rows)
    key_args, grid_args = derived(plan, ("cpp", scale), lambda: shared.kernel_args(plan, scale, page_tables=True))
    sink_logits = NO_SINKS if sinks is None else sinks.to(torch.float32).contiguous()  # [Hq]
    for (_, tile), args in zip(tiles, key_args):
        module.attend(q32, query.dtype == torch.bfloat16, steps, comp_cache, raw_cache, target, part_acc, part_ml,
                      *args, *grid_args, tile, splits, float(softcap), sink_logits, int(lookback), *fp8.binding_args(fmt))
    if splits > 1:
        module.merge_splits(part_acc, part_ml, target)
    if target is not out:
        out.copy_(target)
    return out


def default_splits(tiles: list[tuple[KeySet, int]], num_kv_heads: int, threads: int) -> int:
    """Work items per (tile, KV head): enough for every thread to have two
    when few tiles cover a long context (a decode batch), never more than
    one per 512 keys."""
    items = num_kv_heads * sum(keys.query_index.shape[0] * -(-keys.query_index.shape[1] // tile)
                               for keys, tile in tiles)
    if items == 0 or items >= 2 * threads:
        return 1
    max_keys = max(keys.raw_blocks.shape[1] + keys.query_index.shape[1] + keys.num_slot_columns
                   for keys, _ in tiles)
    return max(1, min(-(-2 * threads // items), max_keys // 512, 64))


def _reset_for_tests() -> None:
    """Forget the outcome of `load()` (tests only)."""
    _state.update(tried=False, module=None, reason=None, flags=None)
