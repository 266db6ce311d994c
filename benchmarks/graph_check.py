"""The decode step as a CUDA graph would capture it, checked and timed without vLLM.

    python benchmarks/graph_check.py --device cuda --cases 64x32768 --jsonl out/graph_check.jsonl

A Llama-3-8B-shaped stack of layers (32 query heads over 8 KV heads of 128,
bf16, pages of 16 tokens) decodes `--steps` tokens per case (BATCHxCONTEXT),
crossing chunk boundaries, as the backend runs a uniform decode batch: the
device-side plan (`ops/plans/decode_plan.py`), then per layer `write_raw`,
`write_chunks` and `attend`. One JSON line per result, appended as it comes:
``sync`` (after a warm-up, a whole step under `host_sync.no_host_sync`;
on CUDA also ``set_sync_debug_mode("error")``), ``reference`` (every step's
outputs and written pages against the PyTorch path with its dense bias, which
the schedule harness holds to `reference.py`; small cases), ``graph`` (CUDA:
the step captured once and replayed for every step, equal to eager), and
``timing`` (medians, L2 flushed before each repeat: eager step, graph replay,
the step's kernels one by one, torch SDPA over the full contiguous K/V of one
layer with GQA folded, the copy bandwidth, bytes read against it).

Pages hold random rows (a state the kernels must read correctly): compressed
pages for the whole context, raw pages only for the kept leading rows and
the raw window (the rest of the raw table is the null page 0, as vLLM frees
them). On CPU (CI) the checks run eagerly at small shapes; graph capture is
reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_chunked_kv.core import grid, layout
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops import dispatch
from vllm_chunked_kv.ops.plans.decode_plan import build_decode_plan
from vllm_chunked_kv.ops.host_sync import no_host_sync

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark scripts
from gpu_kernels import DTYPES, add_layer_arguments, copy_bandwidth, make_cfg, median_ms  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--impl", default=None, help="implementation (default: dispatch.choose)")
    p.add_argument("--mitigations", default="none", help="comma-separated, each run over every case")
    p.add_argument("--cases", default="64x32768",
                   help="comma-separated BATCHxCONTEXT (context: tokens per request after the last step)")
    p.add_argument("--steps", type=int, default=8, help="decode steps (crossing chunk boundaries)")
    p.add_argument("--layers", type=int, default=4)
    add_layer_arguments(p, repeats=10)
    p.add_argument("--reference-max-tokens", type=int, default=1 << 19,
                   help="compare with the PyTorch path only where batch x context is at most this (it gathers "
                   "every slot in fp32); 0: never")
    p.add_argument("--case-timeout", type=int, default=0, help="seconds per case and mitigation (0: none)")
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--jsonl", type=Path, help="append one JSON line per result here")
    args = p.parse_args(argv)
    args.mitigations = [m for m in args.mitigations.split(",") if m]
    args.cases = [tuple(int(x) for x in case.split("x")) for case in args.cases.split(",") if case]
    args.batch, args.context = args.cases[0]  # make_stack reads these; run_case sets them per case
    args.mitigation = args.mitigations[0]
    return args


def emit(args: argparse.Namespace, record: dict) -> dict:
    """Print a result and append it to --jsonl at once (a later failure keeps it)."""
    line = json.dumps(record)
    print(line, flush=True)
    if args.jsonl is not None:
        args.jsonl.parent.mkdir(parents=True, exist_ok=True)
        with args.jsonl.open("a") as f:
            f.write(line + "\n")
    return record


# ------------------------------------------------------------------ the stack


@dataclass
class Stack:
    """The pages, tables and per-step inputs of a decode batch over `layers` layers."""

    cfg: ChunkedKVConfig
    origins: list[tuple[int, ...]]  # per layer: grid origin of each KV head
    block_size: int
    raw_block_size: int
    block_table: torch.Tensor  # [b, pages] int32 compressed pages
    raw_table: torch.Tensor  # [b, raw pages] int32, 0 (null page) outside the kept rows and the window
    comp: list[torch.Tensor]  # per layer [pages, Hkv, per_block, 2D]
    raw: list[torch.Tensor]  # per layer [raw pages, Hkv, raw_block_size, 2D]
    lens: list[torch.Tensor]  # per step [b] int32: sequence lengths after the step's token
    inputs: list[list[tuple[torch.Tensor, torch.Tensor]]]  # per step, per layer: query [b, Hq, D], rows [b, Hkv, 2D]
    head_size: int
    scale: float

    def clone_pages(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [c.clone() for c in self.comp], [r.clone() for r in self.raw]

    def plan(self, seq_lens: torch.Tensor, origins: tuple[int, ...], bias: bool):
        """The device-side decode plan (tensor ops, as on a GPU)."""
        return build_decode_plan(seq_lens, self.block_table, self.block_size, self.raw_table, self.raw_block_size,
                                 self.cfg, list(origins), bias=bias)

    def raw_slots(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """[b] raw slot of each request's new row (position seq_len - 1), on the device."""
        t = seq_lens.long() - 1  # [b]
        page = self.raw_table.long().gather(1, (t // self.raw_block_size)[:, None])[:, 0]  # [b]
        return page * self.raw_block_size + t % self.raw_block_size


def make_stack(args: argparse.Namespace, device: torch.device, seed: int = 0) -> Stack:
    torch.manual_seed(seed)
    cfg, dtype, b, d = make_cfg(args.mitigation, args), DTYPES[args.dtype], args.batch, args.head_size
    hkv = args.num_kv_heads
    per_block = layout.states_per_block(cfg, args.block_size)
    raw_bs = per_block  # raw rows per page: a compressed page's states (`raw_cache.raw_spec`)
    origins = [tuple(cfg.origins(layer, hkv)) for layer in range(args.layers)]
    keep = grid.forever_raw(cfg, grid.possible_origins(cfg, [o for os in origins for o in os]))
    # Requests end one position apart mod hop, so every phase of the grid is in the batch.
    ends = [args.context - (r % cfg.hop) for r in range(b)]  # [b] lengths after the last step
    pages = math.ceil(args.context / args.block_size)
    block_table = (torch.randperm(b * pages) + 1).view(b, pages).to(torch.int32)  # [b, pages]
    raw_cols = math.ceil(args.context / raw_bs)
    col_start = torch.arange(raw_cols) * raw_bs  # [raw pages] first position of each raw page
    raw_table = torch.zeros(b, raw_cols, dtype=torch.int32)  # [b, raw pages]
    used = 0
    for r, end in enumerate(ends):
        start = end - args.steps  # length before the first step
        live = (col_start < keep) | (col_start + raw_bs > start - layout.raw_window(cfg) - raw_bs)
        raw_table[r, live] = torch.arange(used + 1, used + 1 + int(live.sum()), dtype=torch.int32)
        used += int(live.sum())
    comp = [torch.randn(b * pages + 1, hkv, per_block, 2 * d, dtype=dtype, device=device) for _ in origins]
    raw = [torch.randn(used + 1, hkv, raw_bs, 2 * d, dtype=dtype, device=device) for _ in origins]
    lens = [torch.tensor([e - args.steps + 1 + s for e in ends], dtype=torch.int32, device=device)
            for s in range(args.steps)]
    inputs = [[(torch.randn(b, args.num_heads, d, dtype=dtype, device=device),
                torch.randn(b, hkv, 2 * d, dtype=dtype, device=device)) for _ in origins] for _ in range(args.steps)]
    return Stack(cfg, origins, args.block_size, raw_bs, block_table.to(device), raw_table.to(device), comp, raw,
                 lens, inputs, d, 1 / math.sqrt(d))


def decode_step(stack: Stack, ops, comp, raw, seq_lens, inputs, outputs, *, bias: bool) -> None:
    """One uniform decode step, as the backend runs it: the device-side plan
    (once per grid), then per layer write_raw, write_chunks and attend into
    ``outputs[layer]`` ``[b, Hq, D]``. Waits for nothing (`no_host_sync`)."""
    slots = stack.raw_slots(seq_lens)  # [b]
    plans = {}
    for layer, origins in enumerate(stack.origins):
        if origins not in plans:
            plans[origins] = stack.plan(seq_lens, origins, bias)
        plan = plans[origins]
        query, rows = inputs[layer]
        ops.write_raw(raw[layer], rows, slots, plan.raw_writes)
        ops.write_chunks(comp[layer], raw[layer], rows, plan.writes, stack.cfg, stack.head_size)
        ops.attend(query, rows, comp[layer], raw[layer], plan, stack.scale, out=outputs[layer])


def eager_run(stack: Stack, ops, *, bias: bool) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """Every step from the starting pages: per step the layers' outputs, and the final compressed pages."""
    comp, raw = stack.clone_pages()
    results = []
    for s in range(len(stack.lens)):
        outputs = [torch.full_like(q, float("nan")) for q, _ in stack.inputs[s]]  # an unwritten row fails
        decode_step(stack, ops, comp, raw, stack.lens[s], stack.inputs[s], outputs, bias=bias)
        results.append(outputs)
    return results, comp


def max_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest absolute difference over pairs of tensors; a NaN on either side counts as infinite."""
    worst = 0.0
    for x, y in zip(a, b):
        diff = (x.float() - y.float()).abs().nan_to_num(nan=math.inf)
        worst = max(worst, float(diff.max()))
    return worst


def pages_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """`max_err` of compressed pages, the null page 0 left out (writes that complete no chunk go there)."""
    return max_err([x[1:] for x in a], [y[1:] for y in b])


# ------------------------------------------------------------------ checks


def check_sync(stack: Stack, ops, device: torch.device) -> dict:
    comp, raw = stack.clone_pages()
    outputs = [torch.empty_like(q) for q, _ in stack.inputs[0]]
    decode_step(stack, ops, comp, raw, stack.lens[0], stack.inputs[0], outputs, bias=ops.needs_bias)  # warm-up
    try:
        with no_host_sync(device):
            decode_step(stack, ops, comp, raw, stack.lens[1 % len(stack.lens)], stack.inputs[0], outputs,
                        bias=ops.needs_bias)
        return {"check": "sync", "ok": True}
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the timings still run
        return {"check": "sync", "ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}


def check_reference(stack: Stack, ops, eager, eager_comp, tol: float) -> dict:
    ref, ref_comp = eager_run(stack, dispatch.ops("torch"), bias=True)
    out_err = max(max_err(a, b) for a, b in zip(eager, ref))
    page_err = pages_err(eager_comp, ref_comp)
    return {"check": "reference", "ok": out_err <= tol and page_err <= tol, "max_abs_err": out_err,
            "pages_max_abs_err": page_err, "tol": tol}


def capture(stack: Stack, ops, comp, raw):
    """The step captured in a CUDA graph over static buffers: (graph, lens buffer, inputs, outputs)."""
    seq_lens = stack.lens[0].clone()
    inputs = [(q.clone(), r.clone()) for q, r in stack.inputs[0]]
    outputs = [torch.empty_like(q) for q, _ in inputs]
    saved = [c.clone() for c in comp], [r.clone() for r in raw]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (allocations, lazily built constants), then undone
        decode_step(stack, ops, comp, raw, seq_lens, inputs, outputs, bias=ops.needs_bias)
    torch.cuda.current_stream().wait_stream(side)
    for dst, src in zip(comp + raw, saved[0] + saved[1]):
        dst.copy_(src)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_step(stack, ops, comp, raw, seq_lens, inputs, outputs, bias=ops.needs_bias)
    return graph, seq_lens, inputs, outputs


def check_graph(stack: Stack, ops, eager, eager_comp) -> tuple[dict, tuple | None]:
    comp, raw = stack.clone_pages()
    try:
        graph, seq_lens, inputs, outputs = capture(stack, ops, comp, raw)
    except Exception as exc:  # noqa: BLE001
        return {"check": "graph", "ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}, None
    errs = []
    for s in range(len(stack.lens)):
        seq_lens.copy_(stack.lens[s])
        for (q, r), (sq, sr) in zip(inputs, stack.inputs[s]):
            q.copy_(sq)
            r.copy_(sr)
        graph.replay()
        errs.append(max_err(outputs, eager[s]))
    page_err = pages_err(comp, eager_comp)
    record = {"check": "graph", "ok": max(errs) == 0 and page_err == 0, "max_abs_err": max(errs),
              "pages_max_abs_err": page_err}
    return record, (graph, comp, raw)


# ------------------------------------------------------------------ timing


class Timer:
    """Median milliseconds of a callable, with the L2 cache flushed before each repeat."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device, self.repeats = device, repeats
        self.flush = torch.empty(256 << 20 if device.type == "cuda" else 1 << 20, dtype=torch.uint8, device=device)

    def __call__(self, fn) -> float:
        return median_ms(self.device, fn, self.repeats, before=self.flush.zero_)


def attention_bytes(plan, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> int:
    """Bytes of K/V rows one layer's chunked attention reads: stored raw rows, new rows, visible slots."""
    keys = plan.key_sets[0]
    rows = int(keys.num_raw.sum()) + keys.query_index.numel() + int(keys.num_slots.sum())
    return rows * num_kv_heads * 2 * head_size * torch.empty((), dtype=dtype).element_size()


def sdpa_baseline(args: argparse.Namespace, timer: Timer, lens: list[int]) -> tuple[float, int]:
    """(ms, bytes) of torch SDPA decoding one layer over full contiguous K/V of
    the same shapes, GQA folded: queries [b, Hkv, G, D] against K, V [b, Hkv, T, D]."""
    dtype, b, hkv, d = DTYPES[args.dtype], args.batch, args.num_kv_heads, args.head_size
    t = max(lens)
    q = torch.randn(b, hkv, args.num_heads // hkv, d, dtype=dtype, device=timer.device)
    k = torch.randn(b, hkv, t, d, dtype=dtype, device=timer.device)
    v = torch.randn_like(k)
    ms = timer(lambda: F.scaled_dot_product_attention(q, k, v))
    return ms, 2 * k.numel() * k.element_size()


def timings(stack: Stack, ops, args, device: torch.device, graph_state) -> dict:
    timer = Timer(device, args.repeats)
    comp, raw = stack.clone_pages()
    lens, inputs = stack.lens[-1], stack.inputs[-1]
    outputs = [torch.empty_like(q) for q, _ in inputs]
    step_ms = timer(lambda: decode_step(stack, ops, comp, raw, lens, inputs, outputs, bias=ops.needs_bias))
    plan, slots = stack.plan(lens, stack.origins[0], ops.needs_bias), stack.raw_slots(lens)
    q, rows = inputs[0]
    parts = {
        "plan": timer(lambda: stack.plan(lens, stack.origins[0], ops.needs_bias)),
        "write_raw": timer(lambda: ops.write_raw(raw[0], rows, slots, plan.raw_writes)),
        "write_chunks": timer(lambda: ops.write_chunks(comp[0], raw[0], rows, plan.writes, stack.cfg,
                                                       stack.head_size)),
        "attend": timer(lambda: ops.attend(q, rows, comp[0], raw[0], plan, stack.scale, out=outputs[0])),
    }
    layers = len(stack.origins)
    kernel_sum = parts["plan"] + layers * (parts["write_raw"] + parts["write_chunks"] + parts["attend"])
    graph_ms = None
    if graph_state is not None:
        graph_ms = timer(graph_state[0].replay)
    copy_gbs = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (64 << 20), args.repeats)
    chunked_bytes = attention_bytes(plan, args.num_kv_heads, args.head_size, DTYPES[args.dtype])
    sdpa_ms, sdpa_bytes = sdpa_baseline(args, timer, lens.tolist())
    attend_gbs = chunked_bytes / (parts["attend"] * 1e-3) / 1e9
    return {
        "timing": "decode", "batch": args.batch, "context": args.context, "layers": layers,
        "eager_step_ms": step_ms, "graph_replay_ms": graph_ms, "kernel_sum_ms": kernel_sum,
        "graph_vs_kernel_sum": None if graph_ms is None else graph_ms / kernel_sum,
        "per_layer_ms": parts, "copy_gbs": copy_gbs,
        "attend_bytes": chunked_bytes, "attend_gbs": attend_gbs, "attend_fraction_of_copy": attend_gbs / copy_gbs,
        "sdpa_ms": sdpa_ms, "sdpa_bytes": sdpa_bytes, "sdpa_gbs": sdpa_bytes / (sdpa_ms * 1e-3) / 1e9,
        "speedup_vs_sdpa": sdpa_ms / parts["attend"],
    }


def versions(device: torch.device) -> dict:
    out = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device)}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    if device.type == "cuda":
        out.update(cuda=torch.version.cuda, name=torch.cuda.get_device_name(device))
    else:
        out["name"] = platform.processor() or platform.machine()
    return out


def run_case(args: argparse.Namespace, impl: str, device: torch.device) -> bool:
    """Every check and the timing of one case (args.batch, args.context,
    args.mitigation), each result emitted as it comes; False if a check failed."""
    ops = dispatch.ops(impl)
    tag = {"impl": impl, "mitigation": args.mitigation, "batch": args.batch, "context": args.context,
           "head_size": args.head_size}
    stack = make_stack(args, device)
    ok = emit(args, {**tag, **check_sync(stack, ops, device)})["ok"]
    eager, eager_comp = eager_run(stack, ops, bias=ops.needs_bias)
    if args.batch * args.context <= args.reference_max_tokens:
        tol = 1e-4 if args.dtype == "float32" else 2e-2
        ok &= emit(args, {**tag, **check_reference(stack, ops, eager, eager_comp, tol)})["ok"]
    graph_state = None
    if device.type == "cuda":
        record, graph_state = check_graph(stack, ops, eager, eager_comp)
        ok &= emit(args, {**tag, **record})["ok"]
    else:
        emit(args, {**tag, "check": "graph", "ok": None, "skipped": "CUDA graphs need a CUDA device"})
    del eager, eager_comp
    if not args.no_timing:
        emit(args, {**tag, **timings(stack, ops, args, device, graph_state)})
    return bool(ok)


class CaseTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise CaseTimeout


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    impl = args.impl or dispatch.choose(device, head_size=args.head_size, group=args.num_heads // args.num_kv_heads)
    emit(args, {"versions": versions(device), "impl": impl,
                "shape": {k: getattr(args, k) for k in ("steps", "layers", "num_heads", "num_kv_heads", "head_size",
                                                        "block_size", "chunk_size", "window", "sink_tokens",
                                                        "dtype")}})
    failed = False
    if args.case_timeout:
        signal.signal(signal.SIGALRM, _alarm)
    for batch, context in args.cases:
        for mitigation in args.mitigations:
            args.batch, args.context, args.mitigation = batch, context, mitigation
            signal.alarm(args.case_timeout)
            try:
                failed |= not run_case(args, impl, device)
            except Exception as exc:  # noqa: BLE001 - one case failing leaves the others to run
                failed = True
                emit(args, {"impl": impl, "mitigation": mitigation, "batch": batch, "context": context,
                            "error": f"{type(exc).__name__}: {exc}"[:1000]})
            finally:
                signal.alarm(0)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
