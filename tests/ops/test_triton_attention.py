"""Contract of vllm_chunked_kv.ops.kernels.triton_attention (with triton_pool's
`write_chunks`), run under Triton's CPU interpreter.

Through `schedule.run_schedule` with ``impl="triton"`` (a simulated vLLM
pager, random steps mixing prefill, chunked prefill, decodes; dropped raw
rows are NaN): at every step the compressed pages written equal
`compressed.write_chunks` (target slots NaN before the call) and every
query's output equals `reference_chunked_attention` within 1e-4 (output NaN
before the call), for:

- every setting of `schedule.CONFIGS` (each mitigation and pooling mode,
  sinks, staggered grids, chunk 1) with GQA ratios 1 and 4, lengths 63 and
  100 among the requests;
- GQA 3 (not a power of two), values wider than keys, several query tiles
  per request, a context split across several programs, decode-only
  batches, bf16 caches (bf16 tolerance);
- a model's logit cap and learned sink logits (`LOGIT_OPTIONS`), with a
  split context and query tiles;

and the kernels as `attend`/`write_chunks` launch them compile ahead of time
for sm_80/sm_90 (not run). The interpreter is slow (10-20 s a schedule on 2
cores), so the fast tier runs every setting at GQA 4 and the logit options
combined (softcap or window, with sinks); GQA 1 and each option alone are in
the slow tier. The split count, a kernel constant, takes
power-of-two values only (a bounded number of compiled variants).
"""


import pytest
import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig

from .schedule import CONFIGS, LOGIT_OPTIONS, kernel_lengths


@pytest.mark.parametrize("group", [pytest.param(1, marks=pytest.mark.slow), 4])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_steps_equal_reference(triton_ops, name, group):
    cfg = ChunkedKVConfig(**CONFIGS[name])
    steps = triton_ops.schedule.run_schedule(cfg, kernel_lengths(cfg, group), seed=group, impl="triton", group=group,
                                             tol=1e-4)
    assert steps > 4


@pytest.mark.parametrize(
    "name, options",
    [
        ("stagger-list", dict(group=3)),
        ("boundary-gated", dict(group=3, num_kv_heads=3)),
        ("overlap-key_norm", dict(head_size_v=12)),
        ("none-sinks", dict(group=4, attend_kwargs=dict(block_m=3))),
        ("boundary-key_norm", dict(group=2, attend_kwargs=dict(num_splits=3))),
        ("stagger-heads", dict(group=4, attend_kwargs=dict(num_splits=2, block_m=5))),
        ("boundary-gated", dict(group=4, decode_only=True)),
        ("boundary-gated", dict(group=2, decode_only=True, decode_plan=True)),  # the device-side decode plan
        ("stagger-heads", dict(group=4, decode_only=True, decode_plan=True, attend_kwargs=dict(num_splits=2))),
        ("overlap", dict(group=4, dtype=torch.bfloat16, tol=3e-2)),
    ],
)
@pytest.mark.slow
def test_shapes_tiles_splits_and_dtypes(triton_ops, name, options):
    cfg = ChunkedKVConfig(**CONFIGS[name])
    if cfg.keep_boundary and options.get("num_kv_heads") == 3:
        cfg = ChunkedKVConfig(**CONFIGS[name], stagger=[[3, 1, 0]])
    options.setdefault("tol", 1e-4)
    triton_ops.schedule.run_schedule(cfg, kernel_lengths(cfg, 7), seed=7, impl="triton", **options)


@pytest.mark.parametrize("options", [o if o.endswith("-sinks") else pytest.param(o, marks=pytest.mark.slow)
                                     for o in LOGIT_OPTIONS])  # the fast tier: the combined options
@pytest.mark.parametrize("name, shape", [
    ("boundary-gated", dict(group=2)),
    ("stagger-heads", dict(group=4, attend_kwargs=dict(num_splits=2, block_m=5))),  # the sink in split 0 only
])
def test_logit_cap_and_sinks_equal_reference(triton_ops, name, shape, options):
    cfg = ChunkedKVConfig(**CONFIGS[name])
    assert triton_ops.schedule.run_schedule(cfg, kernel_lengths(cfg, 9), seed=9, impl="triton", tol=1e-4, **shape,
                                            **LOGIT_OPTIONS[options]) > 4


def test_split_counts_are_bucketed(triton_ops):
    buckets = [triton_ops.attention.split_bucket(n) for n in range(0, 40)]
    assert set(buckets) == {1, 2, 4, 8, 16, 32}
    assert all(b <= max(n, 1) < 2 * b for n, b in enumerate(buckets))


@pytest.mark.parametrize(
    "dtype, settings, group, tile_m, splits, arch",
    [
        ("bf16", dict(chunk_size=4, window=128, mitigation="boundary", pooling="key_norm"), 8, 1, 4, 90),  # decode
        ("fp16", dict(chunk_size=4, window=128, mitigation="overlap"), 1, 1, 1, 80),  # decode, padded rows
        ("bf16", dict(chunk_size=4, window=128, mitigation="stagger"), 4, 16, 1, 90),  # prefill tile
    ],
)
@pytest.mark.slow
def test_attention_compiles_for_a_gpu(compile_for_gpu, dtype, settings, group, tile_m, splits, arch):
    """The attention kernel as `attend` launches it compiles for sm_80 / sm_90 (not run)."""
    _compile_attention(compile_for_gpu, dtype, settings, group, tile_m, splits, arch, head=128)


@pytest.mark.parametrize("head, tile_m, arch", [
    (64, 16, 80), (64, 16, 90), (256, 16, 80), (256, 16, 90), (256, 1, 90),  # 128: the test above
])
@pytest.mark.slow
def test_attention_compiles_at_every_head_size(compile_for_gpu, head, tile_m, arch):
    """bf16 operands at head sizes 64 and 256 (128 above), GQA 4, prefill tiles (the largest) and a
    decode tile, sm_80 and sm_90, within the shared memory of both."""
    _compile_attention(compile_for_gpu, "bf16", dict(chunk_size=4, window=128), 4, tile_m, 2, arch, head=head)


@pytest.mark.parametrize("tile_m", [1, 16])
@pytest.mark.slow
def test_attention_with_cap_and_sinks_compiles(compile_for_gpu, tile_m):
    """With a logit cap and sink logits, decode and prefill tiles compile for sm_90."""
    _compile_attention(compile_for_gpu, "bf16", dict(chunk_size=4, window=128), 4, tile_m, 2, 90, head=128,
                       logits=dict(softcap=True, sinks=True))


def _compile_attention(compile_for_gpu, dtype, settings, group, tile_m, splits, arch, *, head, logits=None):
    from vllm_chunked_kv.ops.kernels import triton_attention
    from vllm_chunked_kv.ops.plans.step_plan import StepPlan

    cfg = ChunkedKVConfig(**settings)
    plan = StepPlan(cfg=cfg, raw_writes=None, writes=None, key_sets=[])
    constants = triton_attention.launch_constants(plan, num_heads=8 * group, num_kv_heads=8, head_d=head,
                                                  head_dv=head, tile_m=tile_m, splits=splits, **(logits or {}))
    pointers = {name: f"*{dtype}" for name in ("q_ptr", "step_ptr", "raw_ptr", "comp_ptr", "out_ptr")}
    pointers |= {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "origins_ptr": "*i32", "sinks_ptr": "*fp32"}
    pointers |= {name: "*i64" for name in ("q_index_ptr", "q_pos_ptr", "raw_blocks_ptr", "raw_offsets_ptr",
                                           "raw_pos_ptr", "comp_blocks_ptr", "comp_offsets_ptr", "num_raw_ptr",
                                           "num_slots_ptr")}
    compiled = compile_for_gpu(triton_attention._chunked_kv_attention_kernel, pointers, constants, arch)
    assert compiled.asm["cubin"]
    assert compiled.metadata.shared <= 160 * 1024  # fits an A100's and an H100's shared memory
