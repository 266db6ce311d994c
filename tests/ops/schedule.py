"""A simulated vLLM pager and a random step schedule, shared by the tests of
every implementation of the compressed-layout ops (PyTorch, Triton, CUDA).

`Pager` plays vLLM's part: each request gets compressed pages (one state per
`tokens_per_state` tokens) and raw pages; a raw page that leaves the sliding
window within its own step is never allocated (it maps to a shared NaN
page; with `cache_all`, prefix caching's mode, every row gets its page and
every row a step computes must be written to it) and raw rows before the window hold NaN (row by row, stricter than
vLLM's whole pages), so reading any of them, even masked, fails; compressed
pages start zero-filled, as vLLM's do.

`run_schedule` feeds sequences in random step splits (prefill, chunked
prefill, single-token decodes, mixed batches) through one implementation's
ops (`dispatch.ops`), the output of every step NaN-filled before the call, and checks
each step's outputs against `reference_chunked_attention` over the whole
sequence. It imports no test framework, so a Triton interpreter worker can
run it whole.
"""

from __future__ import annotations

import random
import torch

from vllm_chunked_kv.core import grid, layout
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops import dispatch, fp8
from vllm_chunked_kv.ops.reference import reference_chunked_attention
from vllm_chunked_kv.ops.plans.decode_plan import build_decode_plan, build_mixed_plan
from vllm_chunked_kv.ops.plans.step_plan import PagedBatch, StepPlan, build_plan

# Settings every implementation is checked under: each mitigation and
# pooling mode, sinks, staggered grids, chunk 1, per-request grid alignment,
# dynamic boundaries.
CONFIGS = {
    "none": dict(mitigation="none", chunk_size=4, window=6),
    "none-sinks": dict(mitigation="none", chunk_size=4, window=5, sink_tokens=6),
    "boundary-gated": dict(mitigation="boundary", chunk_size=4, window=5, pooling="gated",
                           slot_gains=[0.1, 0.2, 0.3, 0.4], sink_tokens=2),
    "boundary-key_norm": dict(mitigation="boundary", chunk_size=5, window=7, pooling="key_norm"),
    "overlap": dict(mitigation="overlap", chunk_size=4, window=4, sink_tokens=1),
    "overlap-key_norm": dict(mitigation="overlap", chunk_size=6, window=8, pooling="key_norm", proportional=False),
    "stride2": dict(mitigation="stride2", window=3),
    "stagger-heads": dict(mitigation="stagger", chunk_size=4, window=5, sink_tokens=1),
    "stagger-list": dict(mitigation="none", chunk_size=4, hop=2, window=4, stagger=[[1, 0]]),
    "hop1": dict(mitigation="none", chunk_size=1, window=1),
    "align-stagger": dict(mitigation="stagger", chunk_size=4, window=5, sink_tokens=1, align="prompt_end"),
    "dynamic": dict(boundaries="dynamic", chunk_size=4, min_chunk=2, window=16, sink_tokens=1),
}


def kernel_lengths(cfg: ChunkedKVConfig, seed: int) -> list[int]:
    """Request lengths of the kernel tests: the odd 63 and 100, a short random
    one, and one that seals many chunks."""
    return [63, 100, random.Random(seed).randint(1, 40), 4 * cfg.window + 9]


# FP8 pages (every implementation's FP8 test): every setting on E4M3 pages; on E5M2 the ones that pool
# differently (mean, key norms, dynamic boundaries)
FP8_SCHEDULES = [(name, "fp8") for name in sorted(CONFIGS)] + [
    (name, "fp8_e5m2") for name in ("none", "boundary-key_norm", "dynamic")]

NAN_BYTE = 0x7F  # a NaN in both FP8 formats (E4M3: S.1111.111; E5M2: S.11111.11)


class Pager:
    """Pages of several requests, allocated and dropped the way vLLM's managers do."""

    def __init__(self, cfg: ChunkedKVConfig, origins: list[int], block_size: int, num_reqs: int, *,
                 num_kv_heads: int, row: int, dtype=torch.float32, device="cpu", cache_all: bool = False,
                 lookback: int = 0, stale_freed: bool = False, fmt: fp8.PageFormat | None = None):
        self.cfg, self.origins, self.block_size, self.cache_all = cfg, origins, block_size, cache_all
        self.fmt = fmt  # FP8 pages: bytes, poisoned with a NaN byte
        dtype = torch.uint8 if fmt is not None else dtype
        self.poison = NAN_BYTE if fmt is not None else float("nan")
        self.lookback = lookback  # a layer's own sliding window: its compressed pages are freed behind it
        self.stale_freed = stale_freed  # freed pages stay in the tables (NaN): a kernel must not read them
        self.per_block = layout.states_per_block(cfg, block_size)
        self.raw_block_size = self.per_block  # equal pages, as the backend declares them
        self.keep = grid.forever_raw(cfg, grid.possible_origins(cfg, origins))
        self.grid_shifts = [0] * num_reqs  # each request's grid shift (`align`)
        self.device = device
        self.comp = torch.zeros((64 * num_reqs, num_kv_heads, self.per_block, row), dtype=dtype, device=device)
        self.raw = torch.full((256 * num_reqs, num_kv_heads, self.raw_block_size, row), self.poison, dtype=dtype,
                              device=device)
        self.free_comp = list(range(1, self.comp.shape[0]))
        self.free_raw = list(range(1, self.raw.shape[0]))  # page 0 is the null page
        self.tables = [([], []) for _ in range(num_reqs)]

    def allocate(self, r: int, seq_len: int) -> None:
        comp, raw = self.tables[r]
        while len(comp) * self.block_size < seq_len:
            comp.append(self.free_comp.pop(0))
        sink_pages = -(-self.keep // self.raw_block_size)
        dead_until = max(0, seq_len - layout.raw_window(self.cfg) + 1) // self.raw_block_size
        while len(raw) * self.raw_block_size < seq_len:
            dead = not self.cache_all and sink_pages <= len(raw) < dead_until
            raw.append(0 if dead else self.free_raw.pop(0))

    def drop_outside_window(self, r: int, computed: int) -> None:
        """Poison every raw row before the sliding window but the forever-raw
        ones (stricter than vLLM, which drops whole pages only)."""
        first_kept = max(0, computed - layout.raw_window(self.cfg) + 1)
        raw = self.tables[r][1]
        for j in range(self.keep, first_kept):
            self.raw[raw[j // self.raw_block_size], :, j % self.raw_block_size] = self.poison

    def free_outside_lookback(self, r: int, computed: int) -> None:
        """With a model sliding window, free the compressed pages vLLM's
        sliding-window manager frees: every page whose tokens all lie before
        ``computed - lookback + 1``: the page becomes NaN and its table entry
        the null page, or with ``stale_freed`` stays (a kernel that reads
        below its first visible slot then fails)."""
        if not self.lookback:
            return
        comp = self.tables[r][0]
        for p in range(max(0, computed - self.lookback + 1) // self.block_size):
            if comp[p]:
                self.comp[comp[p]] = self.poison
                comp[p] = comp[p] if self.stale_freed else 0

    def batch(self, steps: list[tuple[int, int, int]]) -> PagedBatch:
        """steps: (request, first position, end position) of each scheduled request."""
        width = max(max(len(t[0]), len(t[1])) for t in self.tables)
        pad = lambda ids: ids + [0] * (width - len(ids))  # noqa: E731
        starts = [0]
        for _, lo, hi in steps:
            starts.append(starts[-1] + hi - lo)
        return PagedBatch(
            query_start=starts,
            seq_lens=[hi for _, _, hi in steps],
            block_table=torch.tensor([pad(self.tables[r][0]) for r, _, _ in steps], device=self.device),
            block_size=self.block_size,
            raw_block_table=torch.tensor([pad(self.tables[r][1]) for r, _, _ in steps], device=self.device),
            raw_block_size=self.raw_block_size,
            grid_shifts=[self.grid_shifts[r] for r, _, _ in steps],
        )

    def check_pages_complete(self, r: int, start: int, end: int) -> None:
        """Every existing raw page holds all its computed rows that were not
        dropped: prefix caching may hand the page to another request."""
        first_kept = start if self.cache_all else max(0, start - layout.raw_window(self.cfg) + 1)
        raw = self.tables[r][1]
        for j in [*range(self.keep), *range(first_kept, end)][:end]:
            page = raw[j // self.raw_block_size]
            if page:
                assert self.read(self.raw[page, :, j % self.raw_block_size]).isfinite().all(), f"raw row {j} missing"

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows of the pages as values (FP8 bytes dequantised; a NaN byte reads NaN)."""
        return rows if self.fmt is None else fp8.dequantise(rows, self.fmt)

    def raw_slots(self, steps) -> torch.Tensor:
        slots = []
        for r, lo, hi in steps:
            raw = self.tables[r][1]
            slots += [raw[j // self.raw_block_size] * self.raw_block_size + j % self.raw_block_size
                      for j in range(lo, hi)]
        return torch.tensor(slots, device=self.device)


def run_schedule(cfg: ChunkedKVConfig, lengths: list[int], seed: int, *, impl: str = "torch", num_kv_heads: int = 2,
                 group: int = 2, head_size: int = 8, head_size_v: int | None = None, decode_only: bool = False,
                 dtype=torch.float32, device="cpu", tol: float = 1e-5, attend_kwargs: dict | None = None,
                 cache_all: bool = False, decode_plan: bool = False, softcap: float = 0.0,
                 sinks: bool = False, lookback: int = 0, cache_dtype: str | None = None) -> int:
    """Run one random schedule through the ops of ``impl`` (`dispatch.ops`)
    and check every step against the reference; returns the number of steps.
    Other implementations than PyTorch's also write each step's chunks
    exactly as `compressed.write_chunks` does (their target slots are NaN
    before the call). With ``decode_plan``, one-token requests come first
    (as vLLM orders them for the backend); steps in which every request
    computes one token use `decode_plan.build_decode_plan`, mixed steps
    `decode_plan.build_mixed_plan` (at least one is checked). ``softcap``
    and ``sinks`` (random learned sink logits, one per query head) give the
    model's logit options to the reference and to `attend`; ``lookback`` a
    model sliding window, behind which compressed pages are freed as vLLM
    frees them (`Pager.free_outside_lookback`). ``cache_dtype`` (an FP8 format)
    stores the pages as FP8 bytes with random key and value scales (powers of two); the
    reference then reads them as stored (`reference_chunked_attention`'s fmt)."""
    ops = dispatch.ops(impl)
    head_size_v = head_size_v or head_size
    origins = cfg.origins(0, num_kv_heads)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    # FP8 scales are powers of two here, so that every implementation's way of applying them (to the
    # rows, or folded into the logits and the output) gives the same bytes at a rounding tie.
    fmt = None if cache_dtype is None else fp8.PageFormat(cache_dtype, head_size, 2.0 ** rng.randint(-5, -1),
                                                          2.0 ** rng.randint(-5, 0))
    sizes = [layout.block_multiple(cfg) * pages for pages in (2, 4, 16)]  # raw pages shorter and longer than the window
    block_size = rng.choice([size for size in sizes if _fits(cfg, size)])
    pager = Pager(cfg, origins, block_size, len(lengths), num_kv_heads=num_kv_heads, row=head_size + head_size_v,
                  dtype=dtype, device=device, cache_all=cache_all, lookback=lookback,
                  stale_freed=ops.name != "torch", fmt=fmt)  # the PyTorch path gathers every slot, hidden or not
    # With `align`, request r's prompt is its first prompt_lens[r] positions (the rest decodes).
    prompt_lens = [random.Random(seed + r).randint(1, n) for r, n in enumerate(lengths)]
    pager.grid_shifts = [cfg.grid_shift(p) for p in prompt_lens]
    req_origins = [[grid.shifted(cfg, o, shift) for o in origins] for shift in pager.grid_shifts]
    q = [torch.randn(n, num_kv_heads * group, head_size, generator=gen).to(dtype) for n in lengths]
    k = [(torch.randn(n, num_kv_heads, head_size, generator=gen) * 2).to(dtype) for n in lengths]
    v = [torch.randn(n, num_kv_heads, head_size_v, generator=gen).to(dtype) for n in lengths]
    logit_options = {"softcap": softcap} if softcap else {}
    if lookback:
        logit_options["lookback"] = lookback
    if sinks:
        logit_options["sinks"] = torch.randn(num_kv_heads * group, generator=gen) * 2  # [Hq]
    want = [reference_chunked_attention(q[r].float(), k[r].float(), v[r].float(), cfg, scale=0.5,
                                        origins=req_origins[r], fmt=fmt, **logit_options)
            for r in range(len(lengths))]
    logit_options = {name: value.to(device) if name == "sinks" else value for name, value in logit_options.items()}
    done, num_steps, mixed_steps = [0] * len(lengths), 0, 0
    while any(d < n for d, n in zip(done, lengths)):
        steps = []
        for r in rng.sample(range(len(lengths)), len(lengths)):
            if done[r] < lengths[r] and rng.random() < 0.8:
                take = 1 if decode_only or rng.random() < 0.4 else rng.randint(1, 2 * cfg.window + 3)
                steps.append((r, done[r], min(lengths[r], done[r] + take)))
        if not steps:
            continue
        for r, lo, hi in steps:
            pager.drop_outside_window(r, lo)
            pager.free_outside_lookback(r, lo)
            pager.allocate(r, hi)
        if decode_plan:  # vLLM's order for the backend (reorder_batch_threshold): one-token requests first
            steps.sort(key=lambda step: step[2] - step[1] != 1)
        batch = pager.batch(steps)
        num_decodes = sum(hi - lo == 1 for _, lo, hi in steps)
        if decode_plan and 0 < num_decodes < len(steps):
            plan = build_mixed_plan(batch, num_decodes, cfg, origins, bias=ops.needs_bias, native=ops.native_plans)
            mixed_steps += 1
        elif decode_plan and num_decodes == len(steps):
            plan = build_decode_plan(torch.tensor(batch.seq_lens, device=device), batch.block_table, batch.block_size,
                                     batch.raw_block_table, batch.raw_block_size, cfg, origins, bias=ops.needs_bias,
                                     grid_shifts=torch.tensor(batch.grid_shifts, device=device),
                                     native=ops.native_plans)
        else:
            plan = build_plan(batch, cfg, origins, bias=ops.needs_bias)
        cat = lambda xs: torch.cat([xs[r][lo:hi] for r, lo, hi in steps]).to(device)  # noqa: E731
        query = cat(q)  # [n, Hq, D]
        step_rows = torch.cat([cat(k), cat(v)], dim=-1)  # [n, Hkv, D + Dv]
        page = {} if fmt is None else {"fmt": fmt}
        stored = step_rows if fmt is None else fp8.quantise(step_rows, fmt)  # what the backend writes
        ops.write_raw(pager.raw, stored, pager.raw_slots(steps), plan.raw_writes)
        assert not pager.read(pager.raw[0]).isfinite().any(), "a row was written to the null page"
        _write_chunks(ops, pager, stored, plan.writes, cfg, head_size, tol)
        out = query.new_full((query.shape[0], query.shape[1], head_size_v), float("nan"))  # unwritten fails
        got = ops.attend(query, stored, pager.comp, pager.raw, plan, 0.5, out=out, **logit_options, **page,
                         **(attend_kwargs or {}))
        assert got is out, "attend did not write into out="
        for (r, lo, hi), rows in zip(steps, torch.split(out, [hi - lo for _, lo, hi in steps])):
            pager.check_pages_complete(r, lo, hi)
            torch.testing.assert_close(rows.float().cpu(), want[r][lo:hi], atol=tol, rtol=tol)
            done[r] = hi
        num_steps += 1
    if decode_plan and not decode_only:
        assert mixed_steps, "no step mixed decodes with prefill pieces"
    return num_steps


def _fits(cfg: ChunkedKVConfig, block_size: int) -> bool:
    try:
        layout.check_block_size(cfg, block_size)
    except ValueError:
        return False
    return True


def _write_chunks(ops, pager: Pager, step_rows, writes, cfg: ChunkedKVConfig, head_size: int, tol: float) -> None:
    """``ops.write_chunks``; for other ops than PyTorch's, checked against it."""
    page = {} if pager.fmt is None else {"fmt": pager.fmt}
    if ops.name == "torch":
        ops.write_chunks(pager.comp, pager.raw, step_rows, writes, cfg, head_size, **page)
        return
    want = pager.comp.clone()
    dispatch.ops("torch").write_chunks(want, pager.raw, step_rows, writes, cfg, head_size, **page)
    pager.comp[writes.dst_blocks, writes.heads[:, None], writes.dst_offsets] = pager.poison
    ops.write_chunks(pager.comp, pager.raw, step_rows, writes, cfg, head_size, **page)
    # Page 0 is the null page: a decode plan's empty entries write there, in any order; nothing reads it.
    # Pages freed behind a model sliding window are NaN in both.
    if pager.fmt is not None:
        _check_fp8_pages(pager.comp[1:], want[1:])
        pager.comp.copy_(want)  # attention is then checked on the reference's pages
        return
    torch.testing.assert_close(pager.read(pager.comp[1:]).float(), pager.read(want[1:]).float(), atol=tol, rtol=tol,
                               equal_nan=True)


def _check_fp8_pages(got: torch.Tensor, want: torch.Tensor) -> None:
    """FP8 pages written by two implementations: the same bytes, except that a
    pooled element whose fp32 sum lies within rounding of the midpoint of two
    codes may take either (adjacent codes of one sign, one element in 500 at most),
    and a zero may take either sign."""
    unsigned_zero = lambda pages: pages.masked_fill(pages == 0x80, 0)  # noqa: E731
    got, want = unsigned_zero(got), unsigned_zero(want)
    differ = got != want
    if not differ.any():
        return
    a, b = got[differ].int(), want[differ].int()
    assert ((a - b).abs() == 1).all() and ((a ^ b) & 0x80 == 0).all(), (
        f"FP8 pages differ beyond one code: {a[:8].tolist()} vs {b[:8].tolist()}")
    written = (want != NAN_BYTE).sum()  # unwritten elements hold the harness's poison
    assert differ.sum() * 500 <= written, f"{int(differ.sum())} of {int(written)} FP8 elements differ"


# A model's logit options, as `run_schedule` takes them (Gemma 2's cap; GPT-OSS's sinks), and a layer's own
# sliding window.
LOGIT_OPTIONS = {"softcap": dict(softcap=4.0), "sinks": dict(sinks=True), "softcap-sinks": dict(softcap=4.0, sinks=True),
                 # a layer's own sliding window (Mistral, Gemma's local layers compressed): 11 tokens
                 "window": dict(lookback=11), "window-sinks": dict(lookback=11, sinks=True)}


def prefill_pages(cfg: ChunkedKVConfig, stored: torch.Tensor, head_size: int,
                  fmt: fp8.PageFormat | None = None) -> tuple[Pager, StepPlan]:
    """One request's prefill of the stored rows ``[n, Hkv, Dk + Dv]`` (FP8 bytes with
    `fmt`), every KV head's grid at 0: its pages written as the backend writes them
    (raw rows, then the chunks they complete) and its plan."""
    from vllm_chunked_kv.ops.kernels import compressed, shared

    n, hkv, row = stored.shape
    pager = Pager(cfg, [0] * hkv, cfg.hop * 4, 1, num_kv_heads=hkv, row=row, dtype=stored.dtype, fmt=fmt)
    pager.allocate(0, n)
    step = [(0, 0, n)]
    plan = build_plan(pager.batch(step), cfg, [0] * hkv, bias=True)
    shared.write_raw(pager.raw, stored, pager.raw_slots(step), plan.raw_writes)
    compressed.write_chunks(pager.comp, pager.raw, stored, plan.writes, cfg, head_size,
                            **({} if fmt is None else {"fmt": fmt}))
    return pager, plan


def call_returning(module: str, name: str, *args, **kwargs) -> tuple:
    """Call ``module.name(*args, **kwargs)`` and return ``args``: how an
    in-place op run in another process hands its written tensors back."""
    import importlib

    getattr(importlib.import_module(module), name)(*args, **kwargs)
    return args
