"""Contract of the transformers-side chunked attention hook (`hf.attention`).

- With compression, a batched forward equals the reference's
  `reference_chunked_attention` applied to each sequence alone (the batch
  folding changes nothing), with and without staggered origins.
- With nothing sealed (window longer than the sequence), the model's logits
  equal full attention's; with a short window they differ. So too for a
  model with a logit cap (tiny-gemma2), one with sliding-window layers
  (tiny-gemma3) and one with both learned sinks and a sliding-window layer
  (tiny-gptoss), against transformers' own eager attention, which applies
  them: a sliding-window layer keeps exactly its window (`window_attention`).
- Gradients flow through the pooled rows (training under compression works).
- Leaving the context restores the model's attention implementation and
  each layer's chunked settings as they were before it (none on a fresh
  model, an outer block's after a nested one), so an observer is not kept
  alive past its block; also when entering fails half-way.
"""

from __future__ import annotations

import random

import pytest
import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.demo.architecture import build_model
from vllm_chunked_kv.hf.attention import chunked_attention, chunked_attention_forward
from vllm_chunked_kv.demo.data import batch
from vllm_chunked_kv.ops.reference import reference_chunked_attention


class _Layer(torch.nn.Module):
    def __init__(self, cfg, layer_idx=0):
        super().__init__()
        self.chunked_kv_config = cfg
        self.layer_idx = layer_idx


@pytest.mark.parametrize(
    "fields",
    [
        {"chunk_size": 4, "window": 8, "sink_tokens": 2},
        {"chunk_size": 4, "window": 8, "mitigation": "boundary"},
        {"chunk_size": 4, "window": 6, "mitigation": "overlap"},
        {"chunk_size": 4, "window": 8, "stagger": "heads"},
    ],
)
def test_batched_equals_reference_per_sequence(fields):
    torch.manual_seed(0)
    cfg = ChunkedKVConfig(**fields)
    batch_size, heads, kv_heads, seq_len, dim = 3, 4, 2, 37, 8
    q = torch.randn(batch_size, heads, seq_len, dim)
    k = torch.randn(batch_size, kv_heads, seq_len, dim)
    v = torch.randn(batch_size, kv_heads, seq_len, dim)
    out, _ = chunked_attention_forward(_Layer(cfg), q, k, v, None, scaling=dim**-0.5)  # [b, T, H, D]
    for i in range(batch_size):
        expected = reference_chunked_attention(
            q[i].transpose(0, 1), k[i].transpose(0, 1), v[i].transpose(0, 1), cfg,
            scale=dim**-0.5, origins=cfg.origins(0, kv_heads),
        )  # [T, H, D]
        torch.testing.assert_close(out[i], expected, rtol=1e-5, atol=1e-5)


def _full_unsealed_sealed(model, ids):
    """Logits with full attention (eager), chunked with a window over the whole
    sequence, and chunked with a window of 8."""
    with torch.no_grad():
        with chunked_attention(model, None):
            full = model(input_ids=ids).logits
        with chunked_attention(model, ChunkedKVConfig(chunk_size=4, window=ids.shape[1])):
            unsealed = model(input_ids=ids).logits
        with chunked_attention(model, ChunkedKVConfig(chunk_size=4, window=8)):
            sealed = model(input_ids=ids).logits
    return full, unsealed, sealed


def test_model_with_nothing_sealed_equals_full_attention():
    torch.set_num_threads(1)
    ids, _ = batch(random.Random(0), "recall", 2, 48, 2)
    full, unsealed, sealed = _full_unsealed_sealed(build_model(0).eval(), ids)
    torch.testing.assert_close(unsealed, full, rtol=1e-5, atol=1e-5)
    assert (sealed - full).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["tiny-gemma2", "tiny-gemma3", "tiny-gptoss"])
def test_cap_sinks_and_windows_with_nothing_sealed_equal_eager_attention(name, tmp_path):
    from transformers import AutoModelForCausalLM

    from vllm_chunked_kv.models import tiny

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(tiny.build_model(name, tmp_path / name), dtype=torch.float32).eval()
    ids = torch.randint(10, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    full, unsealed, sealed = _full_unsealed_sealed(model, ids)
    torch.testing.assert_close(unsealed, full, rtol=1e-4, atol=1e-4)
    assert (sealed - full).abs().max() > 1e-3


def test_gradients_flow_and_implementation_is_restored():
    model = build_model(0)
    before = model.config._attn_implementation
    ids, labels = batch(random.Random(1), "recall", 2, 48, 2)
    with chunked_attention(model, ChunkedKVConfig(chunk_size=4, window=8, sink_tokens=1)):
        model(input_ids=ids, labels=labels).loss.backward()
    assert model.config._attn_implementation == before
    grads = [p.grad for p in model.model.layers[0].self_attn.k_proj.parameters()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_leaving_restores_each_layers_settings():
    model = build_model(0)
    ids, _ = batch(random.Random(2), "recall", 1, 40, 2)
    outer, inner = ChunkedKVConfig(chunk_size=4, window=8), ChunkedKVConfig(chunk_size=2, window=8)
    seen = []
    with chunked_attention(model, outer):
        with chunked_attention(model, inner, observer=lambda layer, *_: seen.append(layer)):
            model(input_ids=ids)
        assert all(layer.self_attn.chunked_kv_config is outer for layer in model.model.layers)
        assert seen == list(range(len(model.model.layers)))
        model(input_ids=ids)  # the outer block has no observer
        assert len(seen) == len(model.model.layers)
    attn = model.model.layers[0].self_attn
    assert not hasattr(attn, "chunked_kv_config") and not hasattr(attn, "chunked_kv_observer")


def test_a_failed_entry_leaves_nothing_set(monkeypatch):
    model = build_model(0)
    previous = model.config._attn_implementation

    switch = model.set_attn_implementation

    def refuse(name):
        if name == "chunked_kv":
            raise RuntimeError(f"cannot switch to {name}")
        switch(name)

    monkeypatch.setattr(model, "set_attn_implementation", refuse)
    with pytest.raises(RuntimeError, match="cannot switch"):
        with chunked_attention(model, ChunkedKVConfig(chunk_size=4, window=8)):
            pass
    assert all(not hasattr(layer.self_attn, "chunked_kv_config") for layer in model.model.layers)
    assert model.config._attn_implementation == previous


def test_learned_gains_equal_reference_gated_pooling():
    torch.manual_seed(1)
    mean_cfg = ChunkedKVConfig(chunk_size=4, window=8, sink_tokens=1)
    logits = torch.randn(4, requires_grad=True)
    weights = logits.softmax(-1).tolist()
    gated_cfg = ChunkedKVConfig(chunk_size=4, window=8, sink_tokens=1, pooling="gated", slot_gains=weights)
    model = build_model(0).eval()
    ids, labels = batch(random.Random(2), "recall", 2, 40, 2)
    with chunked_attention(model, mean_cfg, gains=logits):
        learned = model(input_ids=ids, labels=labels)
    with torch.no_grad(), chunked_attention(model, gated_cfg):
        gated = model(input_ids=ids).logits
    torch.testing.assert_close(learned.logits.detach(), gated, rtol=1e-4, atol=1e-5)
    learned.loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
