"""What the kernels share: the helpers every implementation calls the same way.

- `gather_rows`: the K/V rows a write reads. A chunk (or a dynamic-boundary
  unit) completed in a step can span tokens stored by earlier steps and
  tokens of the step itself, whose rows are in `step_rows` and, for tokens
  the cache does not keep, nowhere else; the plan names every row's raw page
  and offset and its token index in the step (-1 when stored before it:
  `PagedBatch.row_sources`), and this gather takes each row from the right place.
- `write_raw`: the step's raw rows into the raw pages (the PyTorch, Triton and
  CUDA paths; the C++ kernels do the same in one call).
- `store_rows`: pooled rows in the cache's dtype, or FP8 bytes (`ops/fp8.py`).
- `zero_unused_slots`, `fixed_gains`, `step_gains`: what a chunk write needs
  besides its rows.
- `attend_output`, `kernel_args`: what an `attend` writes, and the arguments
  the C++ and CUDA launches take, in their order.

No kernel module imports another: each imports this one and the plans.
"""

from __future__ import annotations

import torch

from vllm_chunked_kv.core import grid
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops import fp8
from vllm_chunked_kv.ops.fp8 import PageFormat
from vllm_chunked_kv.ops.plans import constants
from vllm_chunked_kv.ops.plans.step_plan import NULL_PAGE, ChunkWrites, StepPlan, derived


def gather_rows(raw_cache: torch.Tensor, step_rows: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                src_step: torch.Tensor, heads: torch.Tensor, fmt: PageFormat | None = None) -> torch.Tensor:
    """Rows at (`blocks`, `heads`, `offsets`) of raw_cache ``[pages, Hkv, block, Dk + Dv]``, or row
    ``src_step`` of step_rows ``[n, Hkv, Dk + Dv]`` where ``src_step >= 0``. The four index tensors
    broadcast to one shape S; the result is ``S + [Dk + Dv]`` in the cache dtype, or with FP8
    pages (`fmt`; step_rows then hold the step's stored bytes too) the rows they hold, fp32."""
    stored = raw_cache[blocks, heads, offsets]  # S + [Dk + Dv]
    own = step_rows[src_step.clamp(min=0), heads]  # S + [Dk + Dv]
    rows = torch.where((src_step >= 0)[..., None], own.to(stored.dtype), stored)
    return rows if fmt is None else fp8.dequantise(rows, fmt)


def store_rows(rows: torch.Tensor, cache: torch.Tensor, fmt: PageFormat | None) -> torch.Tensor:
    """`rows` (fp32 math) as `cache` stores them: its dtype, or FP8 bytes quantised once (`fmt`)."""
    return rows.to(cache.dtype) if fmt is None else fp8.quantise(rows, fmt)


def write_raw(raw_cache: torch.Tensor, step_rows: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> None:
    """Store the rows of `tokens` at their flat slots ``block * raw_block_size + offset``.

    step_rows ``[n, Hkv, Dk + Dv]`` (the step's K/V), slots ``[n]`` (vLLM's
    slot mapping of the raw pages, -1 for padding), tokens ``[w]`` (the rows
    to store). The PyTorch, Triton and CUDA paths store raw rows with this
    function; the C++ CPU kernels do the same in one call (`cpu_ext.write_raw`).
    """
    # vLLM pads dummy batches with slot -1 (PAD_SLOT_ID); such rows go to the
    # null page (`step_plan.NULL_PAGE`), which no plan reads, instead of the
    # last page (-1 // block_size), which a live request may hold. No host sync.
    block_size = raw_cache.shape[2]
    slots = slots[tokens]  # [w]
    slots = torch.where(slots >= 0, slots, NULL_PAGE * block_size)  # [w]
    raw_cache[slots // block_size, :, slots % block_size, :] = step_rows[tokens].to(raw_cache.dtype)


def zero_unused_slots(comp_cache: torch.Tensor, writes: ChunkWrites) -> None:
    """Zero the slots below a head's first group (every implementation does
    this the same way: a handful of rows, once per request)."""
    if writes.zero_heads.numel():
        comp_cache[writes.zero_blocks, writes.zero_heads, writes.zero_offsets] = 0


def fixed_gains(cfg: ChunkedKVConfig, device) -> torch.Tensor:
    """The fixed pooling weight of each slot that the kernels read
    (``[chunk_size]`` fp32; zeros for key_norm, whose weights come from the
    keys). Made once per device and gains: on a GPU a fresh tensor is a
    copy from the host, which a captured decode step cannot make."""
    gains = (0.0,) * cfg.chunk_size if cfg.pooling == "key_norm" else tuple(cfg.normalised_gains())
    return constants.floats(gains, device)


def step_gains(writes: ChunkWrites, cfg: ChunkedKVConfig, device) -> torch.Tensor:
    """`fixed_gains` of a layer's settings, made once per step's writes and
    gains: layers share their step's writes but may pool with their own
    gains (per-layer slot_gains, `ChunkedKVConfig.for_layer`)."""
    # The layers of one step differ at most in their slot_gains: those name the
    # gains (a tuple here, not `normalised_gains`, which every layer would recompute).
    key = ("gains", cfg.pooling, None if cfg.slot_gains is None else tuple(cfg.slot_gains))
    return derived(writes, key, lambda: fixed_gains(cfg, device))


def attend_output(query: torch.Tensor, raw_cache: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """What a kernel's `attend` writes: ``out``, or a new ``[n, Hq, Dv]`` in the
    query dtype; and the GQA group (query heads per KV head, which must divide)."""
    n, num_heads, head_d = query.shape
    num_kv_heads, head_dv = raw_cache.shape[1], raw_cache.shape[-1] - head_d
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    return (query.new_empty(n, num_heads, head_dv) if out is None else out), num_heads // num_kv_heads


def kernel_args(plan: StepPlan, scale: float, *, page_tables: bool = False) -> tuple[list[tuple], tuple]:
    """What the C++ and CUDA `attend` launches take, in their order: per key
    set, its index tensors (contiguous: query index and positions, raw
    blocks, offsets, positions and counts, compressed blocks, offsets and
    counts), with `page_tables` (the C++ CPU kernel) followed by
    ``comp_rows_per_page`` and the slots in the key set's own form (an empty
    offsets tensor with page tables), else one entry per slot, and last its
    grid origins ``[b, Hkv]``; then the scale and grid constants shared by all."""
    key_args = []
    for keys in plan.key_sets:
        blocks, offsets = (keys.comp_blocks, keys.comp_offsets) if page_tables else keys.slot_tables()
        if offsets is None:
            offsets = blocks.new_empty(0)
        args = tuple(t.contiguous() for t in (keys.query_index, keys.query_positions, keys.raw_blocks,
                                              keys.raw_offsets, keys.raw_positions, keys.num_raw, blocks,
                                              offsets, keys.num_slots))
        origins = keys.origins.to(dtype=torch.long).contiguous()
        key_args.append(args + (keys.comp_rows_per_page, origins) if page_tables else args + (origins,))
    cfg = plan.cfg
    shared = (float(scale), cfg.log_weight, cfg.window, cfg.sink_tokens, cfg.chunk_size, cfg.hop,
              grid.slots_per_group(cfg))
    return key_args, shared
