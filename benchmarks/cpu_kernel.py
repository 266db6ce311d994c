"""The chunked KV ops alone on CPU: the C++ kernels (`ops/kernels/cpu_ext.py`) against
the PyTorch path (`ops/kernels/compressed.py`) on the same pages, and the bytes the
attention reads per second against a memcpy of as many bytes.

For each context and batch, pages are laid out as vLLM's managers would
(compressed pages for the whole context, raw pages only for the sinks and
the window, the rest vLLM's null page), one copy per layer so that a step
streams from memory as a model's would, and a step plan is built for one
decode token per request, or for the last `--prefill` tokens of one
request (a prefill piece). Times are the median over `--repeat` steps of
all layers, under `torch.inference_mode()` as in vLLM: the plan (once per
step: for decode steps of the C++ kernels the device-side plan of
`ops/plans/decode_plan.py`, as the backend builds it, with the Python plan's
time beside it), `write_chunks` and `attend` per layer. ``read GB/s`` is
the rows a decode step's attention reads (visible compressed slots and raw
rows, keys and values, every KV head and layer) over its time; ``memcpy
GB/s`` copies a buffer of the same size; ``stream GB/s`` only reads one
(a sum: what a read-only kernel can reach on these cores, where a memcpy
also writes). ``vllm ms`` is vLLM's own CPU attention (its default CPU
backend's kernel; ``isa`` is the path vLLM picks on this CPU: ``amx`` with
matrix units, else ``vec`` or ``vec16``) for the same queries over the
whole context, with no cache write (the C++ time includes `write_chunks`);
``sdpa ms`` is torch's scaled_dot_product_attention over the whole context
for the same queries, an anchor wherever torch runs. Prefill rows give
each kernel's GFLOP/s: the multiply-adds of the rows it attends (the
chunked kernel: sinks, sealed slots and the raw region of each query; vLLM
and SDPA: every earlier position). ``--json`` writes every row with the
CPU's model and instruction-set flags.
``--kv-cache-dtype fp8`` stores both kernels' pages in FP8 (the step's rows
as bytes, as the backend hands them on).
With ``--cold`` each timed step
starts after a 64 MB copy, so that its pages come from memory as in a
model, whose weights pass through the caches between layers.

    python benchmarks/cpu_kernel.py --contexts 2048 8192 16384 32768 --batches 1 8 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_chunked_kv.core import grid, layout
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops import dispatch, fp8
from vllm_chunked_kv.ops.plans.decode_plan import build_decode_plan
from vllm_chunked_kv.ops.plans.step_plan import NULL_PAGE, PagedBatch, build_plan


def stored(rows: torch.Tensor, dtype: torch.dtype, fmt: fp8.PageFormat | None) -> torch.Tensor:
    """Cache rows as pages hold them: in `dtype`, or FP8 bytes (`fmt`)."""
    return rows.to(dtype) if fmt is None else fp8.quantise(rows, fmt)


def paged_step(cfg: ChunkedKVConfig, context: int, batch: int, q_len: int, *, block_size: int, layers: int,
               num_kv_heads: int, head_size: int, dtype: torch.dtype, fmt: fp8.PageFormat | None = None):
    """Caches ``[layers]`` and the `PagedBatch` of one step whose requests end at `context`
    (FP8 pages of bytes with `fmt`)."""
    per_block = layout.states_per_block(cfg, block_size)  # rows per page, compressed and raw
    comp_pages = -(-context // block_size)
    raw_pages = -(-context // per_block)
    keep_from = max(0, context - q_len - layout.raw_window(cfg)) // per_block  # raw pages that exist
    sink_pages = -(-cfg.sink_tokens // per_block)
    block_table = torch.arange(batch * comp_pages).view(batch, comp_pages) + 1
    raw_table = torch.full((batch, raw_pages), NULL_PAGE, dtype=torch.long)
    live = [p for p in range(raw_pages) if p < sink_pages or p >= keep_from]
    raw_table[:, live] = torch.arange(batch * len(live)).view(batch, len(live)) + 1
    row = 2 * head_size
    gen = torch.Generator().manual_seed(0)
    caches = [(stored(torch.randn(batch * comp_pages + 1, num_kv_heads, per_block, row, generator=gen), dtype, fmt),
               stored(torch.randn(batch * len(live) + 1, num_kv_heads, per_block, row, generator=gen), dtype, fmt))
              for _ in range(layers)]
    starts = [i * q_len for i in range(batch + 1)]
    paged = PagedBatch(query_start=starts, seq_lens=[context] * batch, block_table=block_table,
                       block_size=block_size, raw_block_table=raw_table, raw_block_size=per_block)
    return caches, paged


def time_ops(impl: str, cfg, caches, paged, *, heads: int, head_size: int, dtype, repeat: int,
             flush=None, fmt: fp8.PageFormat | None = None) -> dict:
    """Median seconds of the plan and of one step's write_chunks + attend over
    all layers (`flush()`, if given, runs before each timed step; FP8 pages with `fmt`)."""
    ops = dispatch.ops(impl)
    n = paged.query_start[-1]
    num_kv_heads = caches[0][0].shape[1]
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(n, heads, head_size, generator=gen).to(dtype)
    step_rows = torch.randn(n, num_kv_heads, 2 * head_size, generator=gen).to(dtype)
    page = {}
    if fmt is not None:  # the step's rows as the backend hands them on: their stored bytes
        step_rows, page = fp8.quantise(step_rows, fmt), {"fmt": fmt}
    out = query.new_empty(n, heads, head_size)
    origins = [0] * num_kv_heads
    decode = all(b - a == 1 for a, b in zip(paged.query_start, paged.query_start[1:]))
    seq_lens = torch.tensor(paged.seq_lens)

    def make_plan(on_device: bool):
        if on_device:  # what the backend builds for a uniform decode batch with the C++ kernels
            return build_decode_plan(seq_lens, paged.block_table, paged.block_size, paged.raw_block_table,
                                     paged.raw_block_size, cfg, origins, bias=ops.needs_bias, native=ops.native_plans)
        return build_plan(paged, cfg, origins, bias=ops.needs_bias)

    python_plans, plans, steps = [], [], []
    for i in range(repeat + 1):  # both plans after a step, as in a model; which one runs first alternates
        for python_plan in ((True, False) if i % 2 else (False, True)):
            begin = time.perf_counter()
            built = make_plan(not python_plan and decode and impl == "cpp")
            (python_plans if python_plan else plans).append(time.perf_counter() - begin)
            if not python_plan:
                plan = built
        if flush is not None:
            flush()
        begin = time.perf_counter()
        for comp, raw in caches:
            ops.write_chunks(comp, raw, step_rows, plan.writes, cfg, head_size, **page)
            ops.attend(query, step_rows, comp, raw, plan, head_size ** -0.5, out=out, **page)
        steps.append(time.perf_counter() - begin)
    keys = plan.key_sets
    rows = sum(int(k.num_raw.sum()) + int(k.num_slots.sum()) + k.query_index.numel() for k in keys)
    read = rows * num_kv_heads * 2 * head_size * caches[0][0].element_size() * len(caches)
    return {"plan_s": statistics.median(plans[1:]), "python_plan_s": statistics.median(python_plans[1:]),
            "step_s": statistics.median(steps[1:]), "bytes": read}


def time_vllm(context: int, batch: int, q_len: int, *, layers: int, heads: int, num_kv_heads: int, head_size: int,
              dtype, repeat: int, flush=None, block_size: int = 128, kv_cache_dtype: str = "auto") -> float | None:
    """Median seconds of vLLM's own CPU attention (`cpu_attention_with_kv_cache`,
    the kernel of its default CPU backend) over all layers, for the same
    queries over the whole context (pages of `block_size` tokens, none
    dropped), or None when this vLLM has no CPU attention op (`vllm_isa`
    names the path it takes)."""
    try:
        from vllm import _custom_ops as vllm_ops
    except ImportError:
        return None
    if not hasattr(vllm_ops, "cpu_attention_with_kv_cache"):
        return None
    isa = vllm_isa(dtype, head_size, block_size, kv_cache_dtype)
    pages = -(-context // block_size)
    gen = torch.Generator().manual_seed(2)
    fmt = fp8.PageFormat(kv_cache_dtype, head_size) if fp8.is_fp8(kv_cache_dtype) else None
    caches = [stored(torch.randn(batch * pages + 1, num_kv_heads, 2 * block_size, head_size, generator=gen), dtype, fmt)
              for _ in range(layers)]  # [pages, Hkv, K rows then V rows, D]
    block_table = (torch.arange(batch * pages, dtype=torch.int32).view(batch, pages) + 1)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    query_start = torch.arange(batch + 1, dtype=torch.int32) * q_len
    metadata = vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=batch, num_heads=heads, num_kv_heads=num_kv_heads, head_dim=head_size, seq_lens=seq_lens,
        dtype=dtype, query_start_loc=query_start, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=True,
        kv_cache_dtype=kv_cache_dtype)
    query = torch.randn(batch * q_len, heads, head_size, generator=gen).to(dtype)  # [n, Hq, D]
    out = torch.empty_like(query)
    times = []
    for _ in range(repeat + 1):
        if flush is not None:
            flush()
        start = time.perf_counter()
        for cache in caches:
            keys, values = cache.chunk(2, dim=2)
            vllm_ops.cpu_attention_with_kv_cache(
                query=query, key_cache=keys, value_cache=values, output=out, query_start_loc=query_start,
                seq_lens=seq_lens, scale=head_size ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
                block_table=block_table, softcap=0.0, scheduler_metadata=metadata, s_aux=None,
                kv_cache_dtype=kv_cache_dtype)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def vllm_isa(dtype, head_size: int, block_size: int = 128, kv_cache_dtype: str = "auto") -> str | None:
    """The path vLLM's CPU attention takes for these shapes on this CPU ("amx", "vec", "vec16"), or None."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    return _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)


def time_sdpa(context: int, batch: int, q_len: int, *, layers: int, heads: int, num_kv_heads: int, head_size: int,
              dtype, repeat: int, flush=None) -> float:
    """Median seconds of torch's scaled_dot_product_attention over all layers,
    each request's `q_len` last queries over its whole context (causal)."""
    gen = torch.Generator().manual_seed(3)
    kv = [torch.randn(2, batch, num_kv_heads, context, head_size, generator=gen).to(dtype) for _ in range(layers)]
    query = torch.randn(batch, heads, q_len, head_size, generator=gen).to(dtype)
    mask = None
    if q_len > 1:  # query i sits at position context - q_len + i
        mask = torch.arange(context)[None, :] <= torch.arange(context - q_len, context)[:, None]  # [L, context]
    times = []
    for _ in range(repeat + 1):
        if flush is not None:
            flush()
        start = time.perf_counter()
        for keys, values in kv:
            F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def attention_flops(cfg: ChunkedKVConfig, context: int, q_len: int, *, batch: int, layers: int, heads: int,
                    head_size: int) -> tuple[float, float]:
    """Floating-point operations of a step's attention (logits and values,
    2 per multiply-add): the chunked kernel's (each query's sinks, sealed
    slots, grid origin 0, and raw region) and full attention's (every earlier position)."""
    rows_per_chunk = 3 if cfg.keep_boundary else 1
    chunked = full = 0
    for t in range(context - q_len, context):
        first_raw = grid.raw_from(cfg, t)
        chunked += grid.num_sealed(cfg, t) * rows_per_chunk + (t + 1 - first_raw) + min(cfg.sink_tokens, first_raw)
        full += t + 1
    per_row = 2 * 2 * head_size * heads * batch * layers
    return chunked * per_row, full * per_row


def stream_read_bandwidth(nbytes: int, repeat: int) -> float:
    """Bytes per second of reading `nbytes` (at least 64 MB, so that it streams from memory) once: a sum."""
    data = torch.randn(max(nbytes, 64 << 20) // 4)
    times = []
    for _ in range(repeat + 1):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(times[1:])


def memcpy_bandwidth(nbytes: int, repeat: int) -> float:
    """Bytes per second of copying `nbytes` (at least 64 MB, so that it streams from memory)."""
    size = max(nbytes, 64 << 20) // 4
    src, dst = torch.randn(size), torch.empty(size)
    times = []
    for _ in range(repeat + 1):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 4 * size / statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 16384, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prefill", type=int, default=2048, help="tokens of the prefill piece (0: no prefill rows)")
    parser.add_argument("--prefill-batch", type=int, default=1, help="requests of the prefill step")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *fp8.FORMATS],
                        help="pages in the model's dtype (auto) or FP8, for both kernels")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunked-kv", default="{\"chunk_size\": 4, \"window\": 128}")
    parser.add_argument("--json", type=Path, help="write every row and the CPU's model and flags here")
    parser.add_argument("--cold", action="store_true",
                        help="copy a 64 MB buffer before each timed step, so that the pages come from memory, "
                             "as in a model whose weights pass through the caches between layers")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    cfg = ChunkedKVConfig(**json.loads(args.chunked_kv))
    dtype = getattr(torch, args.dtype)
    fmt = fp8.PageFormat(args.kv_cache_dtype, args.head_size) if fp8.is_fp8(args.kv_cache_dtype) else None
    shape = dict(heads=args.heads, head_size=args.head_size, dtype=dtype, repeat=args.repeat, fmt=fmt)
    if args.cold:
        junk, junk_out = torch.randn(16 << 20), torch.empty(16 << 20)  # 64 MB each, more than most L3 caches
        shape["flush"] = lambda: junk_out.copy_(junk)
    cpu = dispatch.cpu_description()
    isa = vllm_isa(dtype, args.head_size, kv_cache_dtype=args.kv_cache_dtype)
    print(f"cpu={cpu['model']!r} flags={','.join(cpu['flags'])} vllm isa={isa}")
    print(f"cfg={args.chunked_kv} layers={args.layers} heads={args.heads}/{args.kv_heads}x{args.head_size} "
          f"dtype={args.dtype} kv_cache_dtype={args.kv_cache_dtype} threads={args.threads} ops={dispatch.ops('cpp').name} cold={args.cold}")
    print(f"{'step':>14} {'context':>7} {'plan ms':>8} {'py plan':>8} {'torch ms':>9} {'cpp ms':>8} {'speedup':>7} "
          f"{'vllm ms':>8} {'cpp/vllm':>8} {'sdpa ms':>8} {'cpp/sdpa':>8} {'isa':>5} "
          f"{'read GB/s | cpp GF/s':>20} {'stream GB/s | vllm GF/s':>23} {'fraction | sdpa GF/s':>20}")
    cases = [("decode", b, 1) for b in args.batches]
    cases += [("prefill", args.prefill_batch, args.prefill)] if args.prefill else []
    rows = []
    for kind, batch, q_len in cases:
        for context in args.contexts:
            if q_len > context:
                continue
            caches, paged = paged_step(cfg, context, batch, q_len, block_size=args.block_size, layers=args.layers,
                                       num_kv_heads=args.kv_heads, head_size=args.head_size, dtype=dtype, fmt=fmt)
            torch_t = time_ops("torch", cfg, caches, paged, **shape)
            cpp_t = time_ops("cpp", cfg, caches, paged, **shape)
            del caches
            sizes = dict(layers=args.layers, heads=args.heads, num_kv_heads=args.kv_heads, head_size=args.head_size,
                         dtype=dtype, repeat=args.repeat, flush=shape.get("flush"))
            vllm_s = time_vllm(context, batch, q_len, **sizes, kv_cache_dtype=args.kv_cache_dtype)
            sdpa_s = time_sdpa(context, batch, q_len, **sizes)
            row = {"step": kind, "batch": batch, "q_len": q_len, "context": context, "plan_ms": cpp_t["plan_s"] * 1e3,
                   "python_plan_ms": cpp_t["python_plan_s"] * 1e3, "torch_ms": torch_t["step_s"] * 1e3,
                   "cpp_ms": cpp_t["step_s"] * 1e3, "vllm_ms": vllm_s and vllm_s * 1e3, "sdpa_ms": sdpa_s * 1e3,
                   "vllm_isa": isa}
            if kind == "decode":
                row["read_gbs"] = cpp_t["bytes"] / cpp_t["step_s"] / 1e9
                row["stream_gbs"] = stream_read_bandwidth(cpp_t["bytes"], args.repeat) / 1e9
                row["memcpy_gbs"] = memcpy_bandwidth(cpp_t["bytes"], args.repeat) / 1e9
                rates = (row["read_gbs"], row["stream_gbs"], row["read_gbs"] / row["stream_gbs"])
            else:
                chunked, full = attention_flops(cfg, context, q_len, batch=batch, layers=args.layers,
                                                heads=args.heads, head_size=args.head_size)
                row["cpp_gflops"] = chunked / cpp_t["step_s"] / 1e9
                row["vllm_gflops"] = vllm_s and full / vllm_s / 1e9
                row["sdpa_gflops"] = full / sdpa_s / 1e9
                rates = (row["cpp_gflops"], row["vllm_gflops"] or float("nan"), row["sdpa_gflops"])
            rows.append(row)
            vllm = f"{vllm_s * 1e3:>8.2f} {cpp_t['step_s'] / vllm_s:>8.2f}" if vllm_s else f"{'-':>8} {'-':>8}"
            label = f"{kind} b={batch}" if kind == "decode" else f"prefill {batch}x{q_len}"
            print(f"{label:>14} {context:>7} {row['plan_ms']:>8.2f} {row['python_plan_ms']:>8.2f} "
                  f"{row['torch_ms']:>9.2f} {row['cpp_ms']:>8.2f} {torch_t['step_s'] / cpp_t['step_s']:>7.2f} {vllm} "
                  f"{row['sdpa_ms']:>8.2f} {cpp_t['step_s'] / sdpa_s:>8.2f} {isa or '-':>5} "
                  f"{rates[0]:>20.2f} {rates[1]:>23.2f} {rates[2]:>20.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"command": vars(args) | {"json": str(args.json)}, "cpu": cpu,
                                         "ops": dispatch.ops("cpp").name, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    with torch.inference_mode():  # as vLLM runs a model step (no autograd bookkeeping per op)
        main()
