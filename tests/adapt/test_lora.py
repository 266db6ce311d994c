"""Contract of the low-rank adapters (`adapt.lora`).

- Wrapping changes nothing until trained (B starts at zero) and freezes
  every base parameter: only the adapters train.
- `disabled` runs the base model exactly (the distillation teacher).
- Saved and merged into a plain copy of the model, the adapter gives the
  adapted model's logits (so the merged checkpoint `vllm serve` loads is the
  model that was trained), and the merge touches exactly the target layers.
- A saved adapter that names a layer the model does not have is refused.
- `load_into` starts new adapters from a saved one (training it further);
  a higher rank at the same alpha / rank grows it (same logits, the new
  components train); a lower rank or another scale is refused. An adapter
  of the attention projections loads into a run that adds the MLPs (same
  logits; the MLP adapters start fresh and train).
- `parse_targets` accepts the attention and MLP projection names only.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from vllm_chunked_kv.adapt import lora
from vllm_chunked_kv.models import merge
from tests.adapt.conftest import tiny_byte_llama

IDS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))


def _trained_like(adapters):
    g = torch.Generator().manual_seed(1)
    for a in adapters.values():
        a.lora_b.data = torch.randn(a.lora_b.shape, generator=g) * 0.05


def test_wrapping_is_identity_and_freezes_the_base():
    model = tiny_byte_llama()
    before = model(input_ids=IDS).logits
    adapters = lora.add_lora(model, rank=4, alpha=8, seed=0)
    assert len(adapters) == 2 * 4  # 2 layers x q/k/v/o
    assert torch.equal(model(input_ids=IDS).logits, before)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_a", "lora_b")) for n in trainable)


def test_disabled_is_the_base_model():
    model = tiny_byte_llama()
    base = model(input_ids=IDS).logits
    adapters = lora.add_lora(model, rank=4, alpha=8, seed=0)
    _trained_like(adapters)
    adapted = model(input_ids=IDS).logits
    assert not torch.allclose(adapted, base)
    with lora.disabled(adapters):
        assert torch.equal(model(input_ids=IDS).logits, base)


def test_merge_gives_the_adapted_model(tmp_path):
    model = tiny_byte_llama()
    plain = copy.deepcopy(model)
    adapters = lora.add_lora(model, rank=4, alpha=8, seed=0)
    _trained_like(adapters)
    for a in adapters.values():  # the saved file is bf16: compare with bf16-rounded adapters
        a.lora_a.data = a.lora_a.data.to(torch.bfloat16).float()
        a.lora_b.data = a.lora_b.data.to(torch.bfloat16).float()
    adapted = model(input_ids=IDS).logits
    lora.save_adapter(adapters, tmp_path, {"base_model": "tiny"})
    meta = json.loads((tmp_path / merge.ADAPTER_META).read_text())
    assert meta["rank"] == 4 and meta["targets"] == sorted(lora.TARGETS)
    untouched = {n: p.clone() for n, p in plain.named_parameters() if not n.endswith(tuple(f"{t}.weight" for t in lora.TARGETS))}
    assert merge.merge_into(plain, tmp_path) == 8
    torch.testing.assert_close(plain(input_ids=IDS).logits, adapted, atol=2e-5, rtol=1e-4)
    for name, p in plain.named_parameters():
        if name in untouched:
            assert torch.equal(p, untouched[name]), name


def test_merge_refuses_foreign_adapters(tmp_path):
    model = tiny_byte_llama()
    adapters = lora.add_lora(model, rank=2, alpha=2, seed=0)
    lora.save_adapter(adapters, tmp_path, {})
    other = tiny_byte_llama()
    other.model.layers = other.model.layers[:1]  # a model with one layer fewer
    with pytest.raises(ValueError, match="not a linear layer"):
        merge.merge_into(other, tmp_path)


def _saved_rank4_adapter(path):
    """Save a trained-like rank-4 (alpha 8) adapter into `path`; returns its model's logits."""
    model = tiny_byte_llama()
    adapters = lora.add_lora(model, rank=4, alpha=8, seed=0)
    _trained_like(adapters)
    lora.save_adapter(adapters, path, {})
    return model(input_ids=IDS).logits


def test_load_into_starts_from_a_saved_adapter(tmp_path):
    """A saved adapter loaded into fresh adapters of the same shape gives the same
    logits (up to its bf16 file); one of another rank is refused."""
    trained = _saved_rank4_adapter(tmp_path)
    fresh_model = tiny_byte_llama()
    fresh = lora.add_lora(fresh_model, rank=4, alpha=8, seed=3)
    assert not torch.allclose(fresh_model(input_ids=IDS).logits, trained, atol=1e-3)
    lora.load_into(fresh, tmp_path)
    torch.testing.assert_close(fresh_model(input_ids=IDS).logits, trained, atol=2e-2, rtol=0)
    with pytest.raises(ValueError, match="rank 4"):
        lora.load_into(lora.add_lora(tiny_byte_llama(), rank=2, alpha=8, seed=0), tmp_path)


def test_load_into_grows_the_rank(tmp_path):
    """A rank-4 adapter loaded into rank-8 adapters at the same alpha / rank gives
    the same logits; the new components take part (a gradient reaches them);
    another scale is refused."""
    trained = _saved_rank4_adapter(tmp_path)
    grown_model = tiny_byte_llama()
    grown = lora.add_lora(grown_model, rank=8, alpha=16, seed=3)
    lora.load_into(grown, tmp_path)
    logits = grown_model(input_ids=IDS).logits
    torch.testing.assert_close(logits, trained, atol=2e-2, rtol=0)
    logits.float().square().mean().backward()
    assert all(float(a.lora_b.grad[:, 4:].abs().sum()) > 0 for a in grown.values())
    with pytest.raises(ValueError, match="alpha / rank"):
        lora.load_into(lora.add_lora(tiny_byte_llama(), rank=8, alpha=8, seed=0), tmp_path)


def test_load_into_adds_mlp_targets(tmp_path):
    """A saved q/k/v/o adapter loaded into a run that also adapts gate/up/down gives
    the same logits; the MLP adapters are fresh (B zero) and a gradient reaches them;
    the reverse (a saved layer this run does not adapt) is refused."""
    trained = _saved_rank4_adapter(tmp_path)
    wider_model = tiny_byte_llama()
    wider = lora.add_lora(wider_model, rank=4, alpha=8, seed=3, targets=lora.TARGETS + lora.MLP_TARGETS)
    lora.load_into(wider, tmp_path)
    logits = wider_model(input_ids=IDS).logits
    torch.testing.assert_close(logits, trained, atol=2e-2, rtol=0)
    mlp = {p: a for p, a in wider.items() if p.rsplit(".", 1)[1] in lora.MLP_TARGETS}
    assert mlp and all(float(a.lora_b.abs().sum()) == 0 for a in mlp.values())
    logits.float().square().mean().backward()
    assert all(float(a.lora_b.grad.abs().sum()) > 0 for a in mlp.values())
    with pytest.raises(ValueError, match="not among this run's"):
        lora.load_into(lora.add_lora(tiny_byte_llama(), rank=4, alpha=8, seed=0, targets=("q_proj",)), tmp_path)


def test_parse_targets():
    assert lora.parse_targets("q_proj, v_proj,down_proj") == ("q_proj", "v_proj", "down_proj")
    for bad in ("", "q_proj,lm_head", "embed_tokens"):
        with pytest.raises(ValueError, match="targets"):
            lora.parse_targets(bad)
