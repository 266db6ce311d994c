"""Contract of vllm_chunked_kv.ops.kernels.compressed (with ops.step_plan and layout):
stored the way the backend stores it, chunked attention equals the reference.

Through `schedule.run_schedule` (a simulated vLLM pager; reading a dropped
raw row, even masked, fails): sequences fed in random step splits (prefill,
chunked prefill, single-token decodes, mixed batches) give, at every step,
the outputs of `reference_chunked_attention` over the whole sequence within
1e-5, for every mitigation, pooling mode, sinks and staggered grids, and
with a model's logit cap and learned sink logits (`LOGIT_OPTIONS`); also
with every row given its page (prefix caching on), where every row a step
computes must land in its page (a later request may hit it).

vLLM's padding slots (-1 in dummy batches) never reach a live page: every
implementation stores raw rows through `shared.write_raw`, which sends
them to the null page and writes real rows where their slots say.

The layers of a step share its plan and writes, so what the kernels derive
from the writes is made once; the pooling gains are derived per gains
(`step_gains`): two layers with their own slot gains (per-layer gains) get
their own, while layers with the same gains share one tensor.
"""

from __future__ import annotations

import random

import pytest
import torch

from vllm_chunked_kv.core import layout
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops import dispatch
from vllm_chunked_kv.ops.kernels import compressed, shared
from vllm_chunked_kv.ops.plans.step_plan import NULL_PAGE

from .schedule import CONFIGS, LOGIT_OPTIONS, run_schedule


def test_step_gains_are_made_once_per_gains():
    none = torch.zeros(0, dtype=torch.long)
    writes = compressed.ChunkWrites(*[none] * 9)  # no chunks: only the memo matters
    cfg = ChunkedKVConfig(pooling="gated", slot_gains=[[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]])
    first, second = (shared.step_gains(writes, cfg.for_layer(layer), "cpu") for layer in (0, 1))
    assert first.tolist() == [1.0, 0.0, 0.0, 0.0] and second.tolist() == [0.0, 0.5, 0.5, 0.0]
    assert shared.step_gains(writes, cfg.for_layer(1), "cpu") is second
    key_norm = shared.step_gains(writes, ChunkedKVConfig(pooling="key_norm"), "cpu")
    assert key_norm.tolist() == [0.0] * 4

torch.set_num_threads(1)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paged_steps_equal_reference(name, seed):
    cfg = ChunkedKVConfig(**CONFIGS[name])
    lengths = [random.Random(seed).randint(1, 60) for _ in range(3)] + [4 * cfg.window + 9]
    run_schedule(cfg, lengths, seed)


@pytest.mark.parametrize("options", list(LOGIT_OPTIONS))
@pytest.mark.parametrize("name", ["boundary-gated", "stagger-heads", "none-sinks"])
def test_logit_cap_and_sinks_equal_reference(name, options):
    cfg = ChunkedKVConfig(**CONFIGS[name])
    assert run_schedule(cfg, [37, 2 * cfg.window + 11, 4 * cfg.window + 9], seed=3, **LOGIT_OPTIONS[options]) > 4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_row_paged_for_prefix_caching(name):
    cfg = ChunkedKVConfig(**CONFIGS[name])
    run_schedule(cfg, [63, 100, 4 * cfg.window + 9], seed=11, cache_all=True)


def test_one_token_steps_only():
    """Pure decoding from the first token on: every seal happens in a decode step."""
    cfg = ChunkedKVConfig(mitigation="boundary", chunk_size=4, window=4, sink_tokens=3)
    run_schedule(cfg, [37, 22], seed=5, decode_only=True)


def test_stored_rows_per_token():
    """Compressed pages hold exactly tokens / tokens_per_state rows (docs/design.md §4)."""
    for name, settings in CONFIGS.items():
        cfg = ChunkedKVConfig(**settings)
        block_size = 4 * cfg.hop
        assert layout.states_per_block(cfg, block_size) * cfg.tokens_per_state == block_size, name


@pytest.mark.parametrize("impl", dispatch.IMPLS)
def test_pad_slots_never_reach_a_live_page(impl):
    """Every implementation's raw-row store: the PyTorch one, or the C++ CPU
    kernels' own (which must then be the one `ops` hands out)."""
    write_raw = dispatch.ops(impl).write_raw
    if impl == "cpp":
        if dispatch.available("cpp", "cpu"):
            pytest.skip("the C++ CPU kernels cannot run here")
        from vllm_chunked_kv.ops.kernels import cpu_ext

        assert write_raw is cpu_ext.write_raw
    else:
        assert write_raw is shared.write_raw
    raw = torch.zeros(4, 2, 8, 6)  # [blocks, Hkv, rows, Dk + Dv]
    step_rows = torch.arange(1, 5, dtype=torch.float32).view(4, 1, 1).expand(4, 2, 6).clone()  # [n, Hkv, Dk + Dv]
    slots = torch.tensor([-1, 8 * 2 + 3, -1, 8 * 1 + 0])  # tokens 0 and 2 are padding (-1 // 8 is the last page)
    write_raw(raw, step_rows, slots, torch.arange(4))
    assert torch.all(raw[2, :, 3] == 2) and torch.all(raw[1, :, 0] == 4)
    live = [b for b in range(4) if b != NULL_PAGE]
    assert int((raw[live] != 0).sum()) == 2 * 2 * 6  # the two real rows, nothing from the padding
