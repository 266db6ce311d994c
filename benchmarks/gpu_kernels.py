"""Check and time the chunked KV kernels on a GPU, against vLLM's own kernels.

    python benchmarks/gpu_kernels.py [--json results.json]

1. Measures the device's copy bandwidth (``dst.copy_(src)`` of 1 GiB: bytes
   read + written per second).
2. Checks every available implementation (CUDA extension, Triton) against
   the reference on small shapes, for every mitigation and a staggered
   grid: two steps on compressed pages (whole prompts, then decodes and a
   chunk), outputs against `masked_chunked_attention` (the reference, vectorised), compressed pages
   against PyTorch's `write_chunks` (max abs error, fp32).
3. Times one layer's step (`write_chunks` + `attend`, as the backend runs
   them) for decode (one new token per request) and a prefill piece
   (``--prefill-tokens`` new tokens) at each context length, for each
   implementation and mitigation, on compressed and raw pages laid out as
   the backend lays them out; and vLLM's Triton unified attention and
   FlashAttention on the same shapes over every position (full attention:
   what the chunked kernels replace). Achieved bandwidth = bytes of K/V rows
   the call must read (chunked: stored raw rows, new rows, compressed slots;
   full: every position) / time, also as a fraction of the copy bandwidth
   (prefill is compute-bound: its fraction is reported, not expected to be
   near 1). Compare times across rows, bandwidth within a row.

Prints a Markdown table and writes everything as JSON. With ``--device cpu
--impls torch`` and small shapes it runs the same steps on the PyTorch path
(that is how its output format is tested); vLLM's kernels need CUDA and are
reported as skipped with the reason.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import torch

from vllm_chunked_kv.core import grid, layout
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops import dispatch
from vllm_chunked_kv.ops.masked import masked_chunked_attention
from vllm_chunked_kv.ops.plans.step_plan import PagedBatch, build_plan

MITIGATIONS = ("none", "boundary", "overlap", "stride2")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    p.add_argument("--device", default="cuda")
    p.add_argument("--impls", default="cuda,triton", help="chunked implementations to check and time")
    p.add_argument("--mitigations", default=",".join(MITIGATIONS))
    p.add_argument("--contexts", type=ints, default=[8192, 16384, 32768, 65536, 131072])
    p.add_argument("--batches", type=ints, default=[1, 16], help="requests per decode step")
    p.add_argument("--prefill-tokens", type=int, default=2048, help="new tokens of the timed prefill piece (0: none)")
    add_layer_arguments(p, repeats=20)
    p.add_argument("--copy-bytes", type=int, default=1 << 30)
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def add_layer_arguments(p: argparse.ArgumentParser, repeats: int) -> None:
    """A Llama-3-8B-shaped layer (32 query heads, 8 KV heads of 128, bf16, pages of
    16 tokens) at chunk 4, window 128, 4 sinks; and the timed repeats."""
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=4)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--sink-tokens", type=int, default=4)
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--repeats", type=int, default=repeats)


# ------------------------------------------------------------------ measuring


def median_ms(device: torch.device, fn: Callable[[], object], repeats: int,
              before: Callable[[], object] | None = None) -> float:
    """Median milliseconds of ``fn`` after two warm-up calls; ``before`` runs
    untimed ahead of each timed call (e.g. an L2 flush)."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        if before is not None:
            before()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - began) * 1e3)
    return statistics.median(samples)


def copy_bandwidth(device: torch.device, num_bytes: int, repeats: int) -> float:
    """Device copy bandwidth in GB/s (bytes read + written)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = median_ms(device, lambda: dst.copy_(src), repeats)
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def make_cfg(mitigation: str, args) -> ChunkedKVConfig:
    settings = dict(window=args.window, sink_tokens=args.sink_tokens, mitigation=mitigation)
    if mitigation != "stride2":
        settings["chunk_size"] = args.chunk_size
    return ChunkedKVConfig(**settings)


def _pages(num_reqs: int, count: int, device) -> torch.Tensor:
    """A block table of ``count`` distinct, shuffled pages per request (page 0 unused)."""
    order = torch.randperm(num_reqs * count) + 1
    return order.view(num_reqs, count).to(device)  # [num_reqs, count]


def make_problem(seq_lens, q_lens, cfg: ChunkedKVConfig, args, device, dtype, *, bias: bool):
    """A step of ``q_lens`` new tokens per request ending at ``seq_lens``, on
    compressed and raw pages in the backend's layout (random rows), its plan,
    queries and the step's K/V. Raw pages outside the window map to page 0,
    as vLLM frees them."""
    bs = args.block_size
    per_block = layout.states_per_block(cfg, bs)
    num_reqs, width = len(seq_lens), args.num_kv_heads
    origins = cfg.origins(0, args.num_kv_heads)
    keep = grid.forever_raw(cfg, origins)
    comp_table = _pages(num_reqs, math.ceil(max(seq_lens) / bs), device)
    raw_pages = math.ceil(max(seq_lens) / per_block)
    raw_table = _pages(num_reqs, raw_pages, device)
    positions = torch.arange(raw_pages, device=device) * per_block  # first position of each raw page
    for r, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        dead = (positions >= keep) & (positions + per_block <= seq_len - q_len - layout.raw_window(cfg))
        raw_table[r, dead] = 0
    d = args.head_size
    comp = torch.randn(comp_table.numel() + 1, width, per_block, 2 * d, device=device, dtype=dtype)
    raw = torch.randn(raw_table.numel() + 1, width, per_block, 2 * d, device=device, dtype=dtype)
    batch = PagedBatch(
        query_start=[0, *itertools.accumulate(q_lens)], seq_lens=list(seq_lens), block_table=comp_table,
        block_size=bs, raw_block_table=raw_table, raw_block_size=per_block,
    )
    plan = build_plan(batch, cfg, origins, bias=bias)
    n = sum(q_lens)
    query = torch.randn(n, args.num_heads, d, device=device, dtype=dtype)
    step_rows = torch.randn(n, width, 2 * d, device=device, dtype=dtype)  # [n, Hkv, D + Dv]
    return query, step_rows, comp, raw, plan


def step(ops, query, step_rows, comp, raw, plan, head_size: int, scale: float = 0.1):
    """What the backend runs per layer and step (raw rows are written by
    `write_raw`, the same torch scatter for every implementation, not timed)."""
    ops.write_chunks(comp, raw, step_rows, plan.writes, plan.cfg, head_size)
    return ops.attend(query, step_rows, comp, raw, plan, scale)


def read_bytes(plan, num_kv_heads: int, head_size: int, dtype) -> int:
    """Bytes of stored and new K/V rows one attention call must read (each row once)."""
    rows = sum(int(keys.num_raw.sum()) + keys.query_index.numel() + int(keys.num_slots.sum()) for keys in plan.key_sets)
    return rows * num_kv_heads * 2 * head_size * torch.empty((), dtype=dtype).element_size()


def full_bytes(seq_lens, args, dtype) -> int:
    """Bytes of K/V rows full attention reads (every position once)."""
    row = args.num_kv_heads * 2 * args.head_size * torch.empty((), dtype=dtype).element_size()
    return sum(seq_lens) * row


# ------------------------------------------------------------------ checking


def run_checks(impls: list[str], mitigations: list[str], args, device) -> list[dict]:
    """Each implementation against the reference, fp32, small shapes: a
    prefill of several requests and a mixed step after it (max abs error of
    the outputs against `masked_chunked_attention` (the reference, vectorised), and of the compressed
    pages against PyTorch's `write_chunks`)."""
    small = argparse.Namespace(**{**vars(args), "num_heads": 8, "num_kv_heads": 2, "head_size": 64,
                                  "window": 16, "sink_tokens": 3})
    results = []
    for impl in impls:
        for name in [*mitigations, "stagger"]:
            cfg = make_cfg(name, small)
            attend_err, write_err = check_one(dispatch.ops(impl), cfg, small, device)
            for op, err in (("attend", attend_err), ("write_chunks", write_err)):
                results.append({"impl": impl, "op": op, "mitigation": name, "max_abs_err": err, "ok": err <= 1e-3})
            progress(f"check {impl} {name}: attend {attend_err:.1e}, write_chunks {write_err:.1e}")
    return results


def progress(line: str) -> None:
    """One line on stderr as each check and timing ends (the tables print at the end)."""
    print(line, file=sys.stderr, flush=True)


def check_one(ops, cfg: ChunkedKVConfig, args, device) -> tuple[float, float]:
    """Run two steps (whole prompts, then a mix of decodes and a chunk) through
    ``ops``; return the largest output and compressed-page errors."""
    gen = torch.Generator().manual_seed(0)
    ends, news = [300, 257, 1, 411], [300, 1, 1, 37]  # positions after the second step, tokens in it
    heads, group, d = args.num_kv_heads, args.num_heads // args.num_kv_heads, args.head_size
    q = [torch.randn(n, heads * group, d, generator=gen) for n in ends]
    kv = [torch.randn(n, heads, 2 * d, generator=gen) for n in ends]
    origins = cfg.origins(0, heads)
    bs, per_block = args.block_size, layout.states_per_block(cfg, args.block_size)
    comp_table = _pages(len(ends), math.ceil(max(ends) / bs), device)
    raw_table = _pages(len(ends), math.ceil(max(ends) / per_block), device)  # every raw row kept
    comp = torch.zeros(comp_table.numel() + 1, heads, per_block, 2 * d, device=device)
    raw = torch.zeros(raw_table.numel() + 1, heads, per_block, 2 * d, device=device)
    attend_err = write_err = 0.0
    for lo_hi in ([(0, e - n) for e, n in zip(ends, news)], [(e - n, e) for e, n in zip(ends, news)]):
        reqs = [r for r, (lo, hi) in enumerate(lo_hi) if hi > lo]
        batch = PagedBatch(
            query_start=[0, *itertools.accumulate(lo_hi[r][1] - lo_hi[r][0] for r in reqs)],
            seq_lens=[lo_hi[r][1] for r in reqs], block_table=comp_table[reqs], block_size=bs,
            raw_block_table=raw_table[reqs], raw_block_size=per_block)
        plan = build_plan(batch, cfg, origins, bias=ops.needs_bias)
        query = torch.cat([q[r][lo:hi] for r, (lo, hi) in enumerate(lo_hi) if r in reqs]).to(device)
        rows = torch.cat([kv[r][lo:hi] for r, (lo, hi) in enumerate(lo_hi) if r in reqs]).to(device)
        positions = [torch.arange(lo, hi, device=raw_table.device) for lo, hi in lo_hi]  # [hi - lo] each
        slots = torch.cat([raw_table[r][positions[r] // per_block] * per_block + positions[r] % per_block
                           for r, (lo, hi) in enumerate(lo_hi) if r in reqs])
        ops.write_raw(raw, rows, slots.to(device), plan.raw_writes)
        want = comp.clone()
        dispatch.ops("torch").write_chunks(want, raw, rows, plan.writes, cfg, d)
        ops.write_chunks(comp, raw, rows, plan.writes, cfg, d)
        write_err = max(write_err, (comp - want).abs().max().item())
        out = ops.attend(query, rows, comp, raw, plan, 0.125).float().cpu()
        for (r, (lo, hi)), got in zip([(r, lo_hi[r]) for r in reqs], out.split([hi - lo for lo, hi in lo_hi if hi > lo])):
            ref = masked_chunked_attention(q[r][:hi], kv[r][:hi, :, :d], kv[r][:hi, :, d:], cfg, scale=0.125,
                                              origins=origins)[lo:hi]
            attend_err = max(attend_err, (got - ref).abs().max().item())
    return attend_err, write_err


# ------------------------------------------------------------------ baselines


def vllm_baselines(device: torch.device) -> dict[str, Callable | str]:
    """vLLM's kernels by name: a runner factory, or the reason it cannot run."""
    if device.type != "cuda":
        reason = "vLLM's Triton and FlashAttention kernels need a CUDA device"
        return {"vllm_triton": reason, "vllm_flash_attn": reason}
    out: dict[str, Callable | str] = {}
    try:
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention

        out["vllm_triton"] = lambda q, k, v, o, meta: unified_attention(
            q=q, k=k, v=v, out=o, cu_seqlens_q=meta["cu_q"], max_seqlen_q=meta["max_q"], seqused_k=meta["seqused_k"],
            max_seqlen_k=meta["max_k"], softmax_scale=meta["scale"], causal=True, window_size=(-1, -1),
            block_table=meta["block_table"], softcap=0, q_descale=None, k_descale=None, v_descale=None,
            seq_threshold_3D=meta["threshold_3d"], num_par_softmax_segments=16,
            softmax_segm_output=meta["segm_out"], softmax_segm_max=meta["segm_max"], softmax_segm_expsum=meta["segm_sum"],
        )
    except Exception as exc:  # an import error on this build: report it, keep going
        out["vllm_triton"] = f"unavailable: {type(exc).__name__}: {exc}"
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        out["vllm_flash_attn"] = lambda q, k, v, o, meta: flash_attn_varlen_func(
            q, k, v, max_seqlen_q=meta["max_q"], cu_seqlens_q=meta["cu_q"], max_seqlen_k=meta["max_k"],
            seqused_k=meta["seqused_k"], softmax_scale=meta["scale"], causal=True, block_table=meta["block_table"], out=o,
        )
    except Exception as exc:
        out["vllm_flash_attn"] = f"unavailable: {type(exc).__name__}: {exc}"
    return out


def baseline_inputs(seq_lens, q_lens, args, device, dtype):
    """Full-attention inputs in vLLM's split layout ``[num_blocks, block_size,
    Hkv, D]``, every position stored (what the chunked kernels replace)."""
    d, bs = args.head_size, args.block_size
    table = _pages(len(seq_lens), math.ceil(max(seq_lens) / bs), device).to(torch.int32)
    k = torch.randn(table.numel() + 1, bs, args.num_kv_heads, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    n = sum(q_lens)
    query = torch.randn(n, args.num_heads, d, device=device, dtype=dtype)
    threshold = 128 // args.num_kv_heads
    meta = {
        "cu_q": torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device),
        "max_q": max(q_lens), "seqused_k": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "max_k": max(seq_lens), "scale": d**-0.5, "block_table": table, "threshold_3d": threshold,
        "segm_out": torch.empty(threshold, args.num_heads, 16, 1 << (d - 1).bit_length(), dtype=torch.float32,
                                device=device),
        "segm_max": torch.empty(threshold, args.num_heads, 16, dtype=torch.float32, device=device),
        "segm_sum": torch.empty(threshold, args.num_heads, 16, dtype=torch.float32, device=device),
    }
    return query, k, v, torch.empty(n, args.num_heads, d, dtype=dtype, device=device), meta


# ------------------------------------------------------------------ timing


def run_timings(impls, mitigations, args, device, dtype, copy_gbps) -> list[dict]:
    rows = []
    baselines = vllm_baselines(device)
    shapes = [("decode", b, [ctx] * b, [1] * b) for ctx in args.contexts for b in args.batches]
    if args.prefill_tokens:
        shapes += [("prefill", 1, [ctx], [min(args.prefill_tokens, ctx)]) for ctx in args.contexts]
    for mode, batch_size, seq_lens, q_lens in shapes:
        base = {"mode": mode, "context": seq_lens[0], "batch": batch_size, "new_tokens": sum(q_lens)}

        def record(impl, mitigation, nbytes, fn):
            row = {**base, "impl": impl, "mitigation": mitigation, "kv_bytes": nbytes}
            try:
                ms = median_ms(device, fn, args.repeats)
                gbps = nbytes / (ms * 1e-3) / 1e9
                row.update(ms=ms, gbps=gbps, fraction_of_copy=gbps / copy_gbps, status="ok")
            except Exception as exc:  # one failing kernel must not hide the others' numbers
                row.update(ms=None, gbps=None, fraction_of_copy=None, status=f"failed: {type(exc).__name__}: {exc}"[:300])
            rows.append(row)
            progress(f"{mode} context {seq_lens[0]} batch {batch_size} {impl} {mitigation}: {row['status']} {row['ms']} ms")

        for impl in impls:
            ops = dispatch.ops(impl)
            for mitigation in mitigations:
                cfg = make_cfg(mitigation, args)
                problem = make_problem(seq_lens, q_lens, cfg, args, device, dtype, bias=ops.needs_bias)
                nbytes = read_bytes(problem[-1], args.num_kv_heads, args.head_size, dtype)
                record(impl, mitigation, nbytes, partial(step, ops, *problem, args.head_size))
                del problem
        nbytes = full_bytes(seq_lens, args, dtype)
        inputs = baseline_inputs(seq_lens, q_lens, args, device, dtype) if device.type == "cuda" else None
        for name, runner in baselines.items():
            if isinstance(runner, str):
                rows.append({**base, "impl": name, "mitigation": "full attention", "kv_bytes": nbytes, "ms": None,
                             "gbps": None, "fraction_of_copy": None, "status": f"skipped: {runner}"})
            else:
                record(name, "full attention", nbytes, partial(runner, *inputs))
        del inputs
    return rows


def usable_impls(requested: list[str], device) -> tuple[list[str], dict[str, list[str]]]:
    usable, skipped = [], {}
    for impl in requested:
        reasons = dispatch.available(impl, device)
        if reasons:
            skipped[impl] = reasons
        else:
            usable.append(impl)
    return usable, skipped


def markdown(results: dict) -> str:
    lines = [
        f"device: {results['device']}; copy bandwidth {results['copy_gbps']:.1f} GB/s",
        "",
        "| check | impl | mitigation | max abs err | ok |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {c['op']} | {c['impl']} | {c['mitigation']} | {c['max_abs_err']:.2e} | {c['ok']} |" for c in results["checks"]]
    lines += ["", "| mode | context | batch | impl | mitigation | ms | GB/s | of copy | status |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in results["timings"]:
        num = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
        lines.append(f"| {t['mode']} | {t['context']} | {t['batch']} | {t['impl']} | {t['mitigation']} | "
                     f"{num(t['ms'], '.3f')} | {num(t['gbps'], '.1f')} | {num(t['fraction_of_copy'], '.2f')} | {t['status']} |")
    for impl, reasons in results["skipped_impls"].items():
        lines.append(f"\nnot run: {impl}: {'; '.join(reasons)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    mitigations = [m for m in args.mitigations.split(",") if m]
    impls, skipped = usable_impls([i for i in args.impls.split(",") if i], device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    copy_gbps = copy_bandwidth(device, args.copy_bytes, args.repeats)
    results = {
        "device": name, "dtype": args.dtype, "copy_gbps": copy_gbps, "skipped_impls": skipped,
        "shape": {k: getattr(args, k) for k in ("num_heads", "num_kv_heads", "head_size", "block_size",
                                                "chunk_size", "window", "sink_tokens")},
        "checks": run_checks(impls, mitigations, args, device),
        "timings": run_timings(impls, mitigations, args, device, dtype, copy_gbps),
    }
    print(markdown(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
