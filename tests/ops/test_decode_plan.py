"""Contract of vllm_chunked_kv.ops.plans.decode_plan: the device-side plan of a
uniform decode batch is the Python plan of `step_plan.build_plan`.

- On random decode schedules for every config of the schedule harness
  (each mitigation, pooling, sinks, staggered grids), at every step: the
  same raw writes; the same chunk writes and zeroed slots once the entries
  aimed at the null page are set aside; for every request the same stored
  raw rows in the same order, the same number of visible slots and the same
  pages for them, with the dense bias (one entry per slot) and without it
  (the block table as it is, expanded by `KeySet.slot_tables`).
- The C++ extension's plan (`native`: the loaded extension) equals the
  tensor-op plan entry for entry, and on CPU without a bias it is built
  in one extension call per plan.
- Mixed steps (decodes first, then prefill pieces) planned by
  `build_mixed_plan` give the reference's outputs through the PyTorch path
  and the C++ kernels; it refuses decodes that do not come first.
- Through the schedule harness, decode steps planned on the device give the
  reference's outputs (PyTorch path, with the dense bias).
- Building it performs no host synchronisation: no ``.cpu()``, ``.item()``,
  ``.tolist()``, ``.numpy()``, truth value or ``nonzero`` of a tensor.
- A padding request (sequence length 0) writes nothing and reads nothing.
"""

from __future__ import annotations

import random

import pytest
import torch

from vllm_chunked_kv.core import layout
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops.plans.decode_plan import build_decode_plan, build_mixed_plan
from vllm_chunked_kv.ops.plans.policy import decode_plan_on_device
from vllm_chunked_kv.ops.plans.step_plan import NULL_PAGE, build_plan

from .schedule import CONFIGS, Pager, run_schedule

torch.set_num_threads(1)


def _write_entries(writes, device_plan: bool) -> set:
    keep = writes.dst_blocks[:, 0] != NULL_PAGE if device_plan else torch.ones(len(writes.heads), dtype=torch.bool)
    rows = zip(*(x[keep].tolist() for x in (writes.heads, writes.src_blocks, writes.src_offsets, writes.src_step,
                                            writes.dst_blocks, writes.dst_offsets)))
    return {tuple(map(lambda v: tuple(v) if isinstance(v, list) else v, row)) for row in rows}


def _zero_entries(writes, device_plan: bool) -> set:
    keep = writes.zero_blocks != NULL_PAGE if device_plan else torch.ones(len(writes.zero_heads), dtype=torch.bool)
    return set(zip(*(x[keep].tolist() for x in (writes.zero_heads, writes.zero_blocks, writes.zero_offsets))))


def _per_request(keys) -> list[tuple]:
    out = []
    for r in range(keys.query_index.shape[0]):
        n, s = int(keys.num_raw[r]), int(keys.num_slots[r])
        blocks, offsets = keys.slot_tables()
        out.append((keys.raw_positions[r, :n].tolist(), keys.raw_blocks[r, :n].tolist(),
                    keys.raw_offsets[r, :n].tolist(), s, blocks[r, :s].tolist(),
                    offsets[r, :s].tolist(), keys.query_positions[r].tolist(), keys.origins[r].tolist()))
    return out


# Dynamic boundaries plan their unit writes on the host only.
FIXED = [name for name, settings in CONFIGS.items() if settings.get("boundaries") != "dynamic"]


@pytest.mark.parametrize("bias, native", [(True, False), (False, False), (False, True)],
                         ids=["bias", "page-tables", "cpp"])
@pytest.mark.parametrize("name", FIXED)
def test_equals_the_python_plan(name, bias, native):
    cfg = ChunkedKVConfig(**CONFIGS[name])
    origins = cfg.origins(0, 2)
    rng = random.Random(len(name))
    lengths = [rng.randint(1, 6 * cfg.window + 20) for _ in range(4)]
    pager = Pager(cfg, origins, cfg.hop * rng.choice([2, 4]), len(lengths), num_kv_heads=2, row=4)
    pager.grid_shifts = [cfg.grid_shift(rng.randint(1, n)) for n in lengths]  # all 0 unless `align`
    checked = 0
    for step in range(max(lengths)):
        steps = [(r, step, step + 1) for r in range(len(lengths)) if step < lengths[r]]
        for r, _, hi in steps:
            pager.allocate(r, hi)
        batch = pager.batch(steps)
        want = build_plan(batch, cfg, origins)
        got = build_decode_plan(torch.tensor(batch.seq_lens), batch.block_table, batch.block_size,
                                batch.raw_block_table, batch.raw_block_size, cfg, origins, bias=bias,
                                grid_shifts=torch.tensor(batch.grid_shifts), native=_native() if native else None)
        if native:  # the C++ plan is the tensor-op plan, entry for entry (null-page placeholders included)
            _assert_same_plan(got, build_decode_plan(torch.tensor(batch.seq_lens), batch.block_table,
                                                     batch.block_size, batch.raw_block_table, batch.raw_block_size,
                                                     cfg, origins, bias=False, native=None,
                                                     grid_shifts=torch.tensor(batch.grid_shifts)))
        if not bias:  # the kernels' form: the block table itself, no per-slot entries
            assert got.key_sets[0].comp_blocks is batch.block_table and got.key_sets[0].comp_offsets is None
            assert got.key_sets[0].comp_rows_per_page == layout.states_per_block(cfg, batch.block_size)
        assert got.raw_writes.tolist() == want.raw_writes.tolist()
        assert _write_entries(got.writes, True) == _write_entries(want.writes, False)
        assert _zero_entries(got.writes, True) == _zero_entries(want.writes, False)
        (want_keys,), (got_keys,) = want.key_sets, got.key_sets
        assert _per_request(got_keys) == _per_request(want_keys)
        checked += bool(want.writes.heads.numel())
    assert checked > 0  # chunks were completed along the way


def _native():
    """The C++ extension, which builds decode plans in one call."""
    from vllm_chunked_kv.ops.kernels import cpu_ext

    module = cpu_ext.load()
    assert module is not None, cpu_ext.unavailable_reasons()
    return module


def _assert_same_plan(got, want) -> None:
    fields = ("heads", "src_blocks", "src_offsets", "src_step", "dst_blocks", "dst_offsets", "zero_heads",
              "zero_blocks", "zero_offsets")
    for name in fields:
        assert torch.equal(getattr(got.writes, name), getattr(want.writes, name)), name
    (g,), (w,) = got.key_sets, want.key_sets
    for name in ("query_index", "query_positions", "raw_blocks", "raw_offsets", "raw_positions", "num_raw",
                 "comp_blocks", "num_slots", "origins"):
        assert torch.equal(getattr(g, name), getattr(w, name)), name
    assert (g.comp_offsets, g.bias, g.comp_rows_per_page) == (w.comp_offsets, w.bias, w.comp_rows_per_page)
    assert torch.equal(got.raw_writes, want.raw_writes)


def test_cpu_plan_is_one_extension_call():
    """On CPU without a bias the plan comes from the C++ extension it is
    given (`native`), one call per plan; with the bias, from tensor ops."""
    from vllm_chunked_kv.ops.kernels import cpu_ext

    module = cpu_ext.load()
    assert module is not None, cpu_ext.unavailable_reasons()
    cfg = ChunkedKVConfig(mitigation="boundary", chunk_size=4, window=8, sink_tokens=2)
    table = torch.arange(1, 4 * 10 + 1, dtype=torch.int32).view(4, 10)
    before = module.plan_calls()
    plan = build_decode_plan(torch.tensor([40, 1, 0, 77], dtype=torch.int32), table, 16, table, 12, cfg, [0, 1],
                             bias=False, native=module)
    assert module.plan_calls() == before + 1
    _assert_same_plan(plan, build_decode_plan(torch.tensor([40, 1, 0, 77]), table, 16, table, 12, cfg, [0, 1],
                                              bias=False))
    build_decode_plan(torch.tensor([40]), table[:1], 16, table[:1], 12, cfg, [0, 1], bias=True, native=module)
    assert module.plan_calls() == before + 1  # the PyTorch path's dense bias: tensor ops


@pytest.mark.parametrize("name", FIXED)
def test_decode_steps_planned_on_the_device_equal_the_reference(name):
    cfg = ChunkedKVConfig(**CONFIGS[name])
    assert run_schedule(cfg, [63, 100, 17], seed=3, decode_only=True, decode_plan=True) > 0


@pytest.mark.parametrize("impl", ["torch", "cpp"])
@pytest.mark.parametrize("name", FIXED)
def test_mixed_steps_plan_their_decodes_as_a_batch(name, impl):
    """Steps mixing decodes (first) and prefill pieces, planned by
    `build_mixed_plan`, give the reference's outputs through both the
    PyTorch path (dense bias) and the C++ kernels (C++ decode plan)."""
    cfg = ChunkedKVConfig(**CONFIGS[name])
    assert run_schedule(cfg, [63, 100, 17, 40], seed=5, impl=impl, decode_plan=True) > 0


def test_mixed_plan_needs_leading_decodes():
    cfg = ChunkedKVConfig(chunk_size=4, window=8)
    pager = Pager(cfg, [0, 0], 16, 2, num_kv_heads=2, row=4)
    for r, hi in ((0, 30), (1, 5)):
        pager.allocate(r, hi)
    batch = pager.batch([(0, 0, 30), (1, 4, 5)])  # the decode comes second
    with pytest.raises(ValueError, match="leading decodes"):
        build_mixed_plan(batch, 1, cfg, [0, 0])


def test_dynamic_boundaries_are_planned_in_python():
    cfg = ChunkedKVConfig(**CONFIGS["dynamic"])
    assert not decode_plan_on_device(torch.device("cuda"), "cuda", cfg)
    assert not decode_plan_on_device(torch.device("cpu"), "cpp", cfg)
    table = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="planned in Python"):
        build_decode_plan(torch.tensor([40]), table, 8, table, 4, cfg, [0, 0])


class SyncGuard(torch.Tensor):
    """A tensor that fails on every call that would wait for the device."""

    FORBIDDEN = {torch.Tensor.cpu, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__,
                 torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.__float__, torch.Tensor.nonzero,
                 torch.nonzero, torch.Tensor.any, torch.Tensor.all}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls.FORBIDDEN:
            raise AssertionError(f"host synchronisation: {getattr(func, '__name__', func)}")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_building_waits_for_nothing():
    cfg = ChunkedKVConfig(mitigation="boundary", chunk_size=4, window=8, sink_tokens=2)
    seq_lens = torch.tensor([40, 1, 0, 77]).as_subclass(SyncGuard)
    table = torch.arange(1, 4 * 10 + 1).view(4, 10).as_subclass(SyncGuard)
    plan = build_decode_plan(seq_lens, table, 16, table, 12, cfg, [0, 0])
    assert isinstance(plan.key_sets[0].comp_blocks, SyncGuard)  # the guard was there all along


def test_padding_requests_do_nothing():
    cfg = ChunkedKVConfig(chunk_size=4, window=4, sink_tokens=3)
    table = torch.arange(1, 9).view(2, 4)
    plan = build_decode_plan(torch.tensor([0, 9]), table, 8, table, 8, cfg, [0, 0])
    keys = plan.key_sets[0]
    assert keys.num_raw.tolist()[0] == 0 and keys.num_slots.tolist()[0] == 0
    assert (plan.writes.dst_blocks.view(2, 2, -1)[0] == NULL_PAGE).all()
