"""Checks every kernel implementation runs the same way (`test_cpu_ext`,
`test_cuda_ext`): the shapes and logit options `schedule.run_schedule` is
driven with, caches of other layouts, and single prefill steps with mixed
dtypes whose result is compared with `compressed.attend`'s.
"""

from __future__ import annotations

import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig

from .schedule import CONFIGS, LOGIT_OPTIONS, Pager, kernel_lengths, prefill_pages, run_schedule

# (setting, run_schedule options) every kernel is run with: GQA 3, values
# wider than keys, rows that are not whole vectors (nor whole thread
# blocks), several query tiles per request, split contexts, decode-only
# batches, bf16 and fp16.
KERNEL_SHAPES = [
    ("stagger-heads", dict(group=4, decode_only=True, decode_plan=True)),  # the device-side decode plan
    ("boundary-gated", dict(group=2, decode_only=True, decode_plan=True)),
    ("stagger-list", dict(group=3)),
    ("boundary-gated", dict(group=3, num_kv_heads=3)),
    ("overlap-key_norm", dict(head_size_v=12)),
    ("none", dict(group=1, head_size=72, head_size_v=80)),
    ("none-sinks", dict(group=4, attend_kwargs=dict(block_m=3))),
    ("boundary-key_norm", dict(group=2, attend_kwargs=dict(num_splits=3))),
    ("stagger-heads", dict(group=4, attend_kwargs=dict(num_splits=2, block_m=5))),
    ("boundary-gated", dict(group=4, decode_only=True)),
    ("overlap", dict(group=4, dtype=torch.bfloat16, tol=3e-2)),
    ("stagger-heads", dict(group=2, dtype=torch.float16, tol=1e-2, attend_kwargs=dict(num_splits=2))),
]


# The kernels' shapes checked with each of `schedule.LOGIT_OPTIONS`: a split
# context (the sink in split 0's softmax only), query tiles, bf16.
LOGIT_SHAPES = {
    "boundary-gated": {},
    "stagger-heads": dict(attend_kwargs=dict(num_splits=3, block_m=5)),
    "none-sinks": dict(group=4, dtype=torch.bfloat16, tol=3e-2, attend_kwargs=dict(block_m=5)),
}


def run_logit_shape(name: str, options: str, impl: str, device: str = "cpu") -> int:
    """One of the LOGIT_SHAPES with one of the LOGIT_OPTIONS through ``impl``."""
    cfg = ChunkedKVConfig(**CONFIGS[name])
    shape = {"tol": 1e-4, **LOGIT_SHAPES[name]}
    return run_schedule(cfg, kernel_lengths(cfg, 8), seed=8, impl=impl, device=device, **shape,
                        **LOGIT_OPTIONS[options])


def run_shape(name: str, options: dict, impl: str, device: str = "cpu") -> int:
    """One of the KERNEL_SHAPES (three KV heads with boundary retention get staggered grids)."""
    cfg = ChunkedKVConfig(**CONFIGS[name])
    if cfg.keep_boundary and options.get("num_kv_heads") == 3:
        cfg = ChunkedKVConfig(**CONFIGS[name], stagger=[[3, 1, 0]])
    options = {"tol": 1e-4, **options}
    return run_schedule(cfg, kernel_lengths(cfg, 7), seed=7, impl=impl, device=device, **options)


def wrap_pager_caches(monkeypatch, wrap) -> None:
    """Every Pager's caches replaced by ``wrap(cache)`` (same contents), through
    a pytest ``monkeypatch``."""
    init = Pager.__init__

    def wrapped_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.comp, self.raw = wrap(self.comp), wrap(self.raw)

    monkeypatch.setattr(Pager, "__init__", wrapped_init)


CACHE_LAYOUTS = {  # a cache wrapper, the config and GQA group it runs with, the tolerance
    "strided": (lambda cache: strided(cache), "boundary-gated", 2, 1e-4),
    "bf16 caches, fp32 queries": (lambda cache: cache.to(torch.bfloat16), "overlap-key_norm", 4, 3e-2),
}


def run_cache_layout(monkeypatch, layout_name: str, impl: str) -> int:
    """A schedule over caches of another layout (`CACHE_LAYOUTS`) against the reference."""
    wrap, name, group, tol = CACHE_LAYOUTS[layout_name]
    wrap_pager_caches(monkeypatch, wrap)
    return run_schedule(ChunkedKVConfig(**CONFIGS[name]), [63, 100], seed=group, impl=impl, group=group, tol=tol)


def strided(cache: torch.Tensor) -> torch.Tensor:
    """The cache laid out head-major, rows padded with NaN columns: only the strides say where rows are."""
    blocks, heads, rows, width = cache.shape
    storage = cache.new_full((heads, blocks, rows, width + 3), float("nan"))
    view = storage.permute(1, 0, 2, 3)[..., :width]  # [blocks, heads, rows, width]
    view.copy_(cache)
    return view


def mixed_dtypes_step(attend) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 queries with fp32 step rows into an fp16 ``out`` (NaN before):
    (out after ``attend(query, step_rows, comp, raw, plan, scale, out=out)``,
    `compressed.attend`'s fp32 result from the queries in fp32)."""
    from vllm_chunked_kv.ops.kernels import compressed

    cfg = ChunkedKVConfig(**CONFIGS["none-sinks"])
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(40, 4, 8, generator=gen).to(torch.bfloat16)  # [n, Hq, D]
    step_rows = torch.randn(40, 2, 16, generator=gen)  # [n, Hkv, D + Dv] fp32
    pager, plan = prefill_pages(cfg, step_rows, 8)
    want = compressed.attend(query.float(), step_rows, pager.comp, pager.raw, plan, 0.5)  # [n, Hq, Dv] fp32
    out = torch.full((40, 4, 8), float("nan"), dtype=torch.float16)
    assert attend(query, step_rows, pager.comp, pager.raw, plan, 0.5, out=out) is out
    return out, want


def bf16_prefill_step(head_size: int) -> tuple[tuple, torch.Tensor]:
    """One prefill of 100 tokens, bf16 queries, rows and caches, GQA 4:
    (the arguments of ``attend(query, step_rows, comp, raw, plan, scale)``,
    `compressed.attend`'s fp32 result from the same values in fp32)."""
    from vllm_chunked_kv.ops.kernels import compressed

    cfg = ChunkedKVConfig(**CONFIGS["boundary-gated"])
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(100, 8, head_size, generator=gen).to(torch.bfloat16)  # [n, Hq, D]
    step_rows = torch.randn(100, 2, 2 * head_size, generator=gen).to(torch.bfloat16)  # [n, Hkv, D + Dv]
    pager, plan = prefill_pages(cfg, step_rows, head_size)
    args = (query, step_rows, pager.comp, pager.raw, plan, head_size ** -0.5)
    want = compressed.attend(query.float(), step_rows.float(), pager.comp.float(), pager.raw.float(), plan,
                             head_size ** -0.5)  # [n, Hq, Dv] fp32
    return args, want
