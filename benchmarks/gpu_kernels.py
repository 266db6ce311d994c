"""Check and time the chunked KV kernels on a GPU, against vLLM's own kernels.

    python benchmarks/gpu_kernels.py [--json results.json]

1. Measures the device's copy bandwidth (``dst.copy_(src)`` of 1 GiB: bytes
   read + written per second).
2. Checks every available implementation (CUDA extension, Triton) against
   the PyTorch reference on small shapes, for every mitigation and a
   staggered grid: `attend` against `paged.attend`, `pool_chunk` against
   `reference.pool_chunk` (max abs error, fp32).
3. Times decode (one new token per request) and a prefill piece
   (``--prefill-tokens`` new tokens) at each context length, for each
   implementation and mitigation, and vLLM's Triton unified attention and
   FlashAttention on the same shapes (full attention: what the chunked
   kernels replace). Achieved bandwidth = bytes of stored KV rows the call
   must read / time, also as a fraction of the copy bandwidth (prefill is
   compute-bound: its fraction is reported, not expected to be near 1).

Prints a Markdown table and writes everything as JSON. With ``--device cpu
--impls torch`` and small shapes it runs the same steps on the PyTorch path
(that is how its output format is tested); vLLM's kernels need CUDA and are
reported as skipped with the reason.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable

import torch

from vllm_chunked_kv.config import ChunkedKVConfig
from vllm_chunked_kv.ops import dispatch, paged, reference

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
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=4)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--sink-tokens", type=int, default=4)
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--copy-bytes", type=int, default=1 << 30)
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


# ------------------------------------------------------------------ measuring


def _timer(device: torch.device, fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``fn`` after two warm-up calls."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
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
    ms = _timer(device, lambda: dst.copy_(src), repeats)
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def make_cfg(mitigation: str, args) -> ChunkedKVConfig:
    settings = dict(window=args.window, sink_tokens=args.sink_tokens, mitigation=mitigation)
    if mitigation != "stride2":
        settings["chunk_size"] = args.chunk_size
    return ChunkedKVConfig(**settings)


def make_problem(seq_lens, q_lens, args, device, dtype):
    """A paged cache in this project's layout (and vLLM's split K/V layout
    over the same pages), queries and the PagedBatch."""
    bs = args.block_size
    pages = [math.ceil(s / bs) for s in seq_lens]
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    order = torch.randperm(sum(pages))
    used = 0
    for r, count in enumerate(pages):
        table[r, :count] = order[used : used + count]
        used += count
    d = args.head_size
    kv_cache = torch.randn(sum(pages), args.num_kv_heads, bs, 2 * d, device=device, dtype=dtype)
    query = torch.randn(sum(q_lens), args.num_heads, d, device=device, dtype=dtype)
    batch = paged.PagedBatch.from_vllm(
        query_start_loc=torch.tensor([0, *q_lens]).cumsum(0),
        seq_lens=torch.tensor(seq_lens),
        block_table=table.to(device),
        block_size=bs,
    )
    return query, kv_cache, batch


def kv_bytes(seq_lens, args, dtype) -> int:
    """Bytes of stored KV rows a call must read (each row once)."""
    row = args.num_kv_heads * 2 * args.head_size * torch.empty((), dtype=dtype).element_size()
    return sum(seq_lens) * row


# ------------------------------------------------------------------ checking


def run_checks(impls: list[str], mitigations: list[str], args, device) -> list[dict]:
    """Max abs error of each implementation against the reference, fp32, small shapes."""
    small = argparse.Namespace(**{**vars(args), "num_heads": 8, "num_kv_heads": 2, "head_size": 64,
                                  "window": 16, "chunk_size": args.chunk_size, "sink_tokens": 3})
    results = []
    torch.manual_seed(0)
    query, kv_cache, batch = make_problem([300, 257, 1, 411], [300, 1, 1, 37], small, device, torch.float32)
    for impl in impls:
        for name in [*mitigations, "stagger"]:
            cfg = make_cfg(name, small) if name != "stagger" else ChunkedKVConfig(
                chunk_size=args.chunk_size, window=16, sink_tokens=3, mitigation="stagger")
            origins = torch.tensor(cfg.origins(0, small.num_kv_heads), device=device)
            got = dispatch.attend(query, kv_cache, batch, 0.125, cfg, origins, impl=impl)
            want = paged.attend(query, kv_cache, batch, 0.125, cfg, origins)
            keys = torch.randn(50, 2, cfg.chunk_size, 64, device=device)
            values = torch.randn(50, 2, cfg.chunk_size, 64, device=device)
            pooled = dispatch.pool_chunk(keys, values, cfg, impl=impl)
            pool_err = max((g - w).abs().max().item() for g, w in zip(pooled, reference.pool_chunk(keys, values, cfg)))
            for op, err in (("attend", (got - want).abs().max().item()), ("pool_chunk", pool_err)):
                results.append({"impl": impl, "op": op, "mitigation": name, "max_abs_err": err, "ok": err <= 1e-3})
    return results


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


def baseline_inputs(query, kv_cache, batch, args):
    """vLLM's split layout [num_blocks, block_size, Hkv, D] over the same pages."""
    d = args.head_size
    k = kv_cache[..., :d].transpose(1, 2).contiguous()  # [nb, Hkv, bs, D] -> [nb, bs, Hkv, D]
    v = kv_cache[..., d:].transpose(1, 2).contiguous()  # [nb, Hkv, bs, Dv] -> [nb, bs, Hkv, Dv]
    n, device = query.shape[0], query.device
    q_lens = [b - a for a, b in zip(batch.query_start[:-1], batch.query_start[1:])]
    threshold = 128 // args.num_kv_heads
    meta = {
        "cu_q": torch.tensor(batch.query_start, dtype=torch.int32, device=device), "max_q": max(q_lens),
        "seqused_k": torch.tensor(batch.seq_lens, dtype=torch.int32, device=device), "max_k": max(batch.seq_lens),
        "scale": args.head_size**-0.5, "block_table": batch.block_table, "threshold_3d": threshold,
        "segm_out": torch.empty(threshold, args.num_heads, 16, 1 << (d - 1).bit_length(), dtype=torch.float32, device=device),
        "segm_max": torch.empty(threshold, args.num_heads, 16, dtype=torch.float32, device=device),
        "segm_sum": torch.empty(threshold, args.num_heads, 16, dtype=torch.float32, device=device),
    }
    return k, v, torch.empty(n, args.num_heads, d, dtype=query.dtype, device=device), meta


# ------------------------------------------------------------------ timing


def run_timings(impls, mitigations, args, device, dtype, copy_gbps) -> list[dict]:
    rows = []
    baselines = vllm_baselines(device)
    shapes = [("decode", b, [ctx] * b, [1] * b) for ctx in args.contexts for b in args.batches]
    if args.prefill_tokens:
        shapes += [("prefill", 1, [ctx], [min(args.prefill_tokens, ctx)]) for ctx in args.contexts]
    for mode, batch_size, seq_lens, q_lens in shapes:
        query, kv_cache, batch = make_problem(seq_lens, q_lens, args, device, dtype)
        nbytes = kv_bytes(seq_lens, args, dtype)
        base = {"mode": mode, "context": seq_lens[0], "batch": batch_size, "new_tokens": sum(q_lens), "kv_bytes": nbytes}

        def record(impl, mitigation, fn):
            row = {**base, "impl": impl, "mitigation": mitigation}
            try:
                ms = _timer(device, fn, args.repeats)
                gbps = nbytes / (ms * 1e-3) / 1e9
                row.update(ms=ms, gbps=gbps, fraction_of_copy=gbps / copy_gbps, status="ok")
            except Exception as exc:  # one failing kernel must not hide the others' numbers
                row.update(ms=None, gbps=None, fraction_of_copy=None, status=f"failed: {type(exc).__name__}: {exc}"[:300])
            rows.append(row)

        for impl in impls:
            for mitigation in mitigations:
                cfg = make_cfg(mitigation, args)
                origins = torch.zeros(args.num_kv_heads, dtype=torch.int32, device=device)
                record(impl, mitigation, lambda: dispatch.attend(query, kv_cache, batch, 0.1, cfg, origins, impl=impl))
        k, v, out, meta = baseline_inputs(query, kv_cache, batch, args)
        for name, runner in baselines.items():
            if isinstance(runner, str):
                rows.append({**base, "impl": name, "mitigation": "full attention", "ms": None, "gbps": None,
                             "fraction_of_copy": None, "status": f"skipped: {runner}"})
            else:
                record(name, "full attention", lambda: runner(query, k, v, out, meta))
        del query, kv_cache, batch, k, v, out
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
