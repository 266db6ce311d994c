"""Low-rank adapters on a model's linear projections: add, switch off, save, load
(merging a saved one into a checkpoint is `models.merge`).

`adapt` trains only these: for each target linear layer ``W`` (by default
q/k/v/o of every decoder layer; `--targets` may add the MLP's
gate/up/down) a pair ``A [rank, in]``, ``B [out, rank]`` adds
``scale * B @ A`` to it, ``scale = alpha / rank``. ``B`` starts at zero, so
training starts from the model itself. Merged, the adapter is an ordinary
weight update: the adapted model is a plain checkpoint that `vllm serve`
loads with no plugin code.

Files of an adapter directory:

- `adapter.safetensors`: ``<module path>.lora_a`` / ``.lora_b`` tensors (bf16);
- `adapter.json`: rank, alpha, targets, the base model it was trained on;
- `chunked_kv_serve.json`: how to serve the merged model (see `core.serve_file`).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from vllm_chunked_kv.models.merge import ADAPTER_META, ADAPTER_WEIGHTS

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """``base(x) + scale * (x @ A^T) @ B^T``; the base layer stays frozen."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.base = base
        self.rank, self.alpha = rank, alpha
        self.scale = alpha / rank
        self.enabled = True
        a = torch.randn(rank, base.in_features, generator=generator) / base.in_features**0.5  # [r, in]
        self.lora_a = nn.Parameter(a)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))  # [out, r]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        out = self.base(x)
        if not self.enabled:
            return out
        return out + (x @ self.lora_a.to(x.dtype).T @ self.lora_b.to(x.dtype).T) * self.scale

    def delta(self) -> torch.Tensor:
        """The weight update ``[out, in]`` this adapter stands for, fp32."""
        return (self.lora_b.float() @ self.lora_a.float()) * self.scale


def parse_targets(text: str) -> tuple[str, ...]:
    """`"q_proj,k_proj,..."` -> the target names, each one of TARGETS or MLP_TARGETS."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in TARGETS + MLP_TARGETS]
    if not names or unknown:
        raise ValueError(f"targets: expected names among {','.join(TARGETS + MLP_TARGETS)}, got {text!r}")
    return names


def add_lora(model: nn.Module, rank: int, alpha: float, seed: int, targets=TARGETS) -> dict[str, LoRALinear]:
    """Freeze `model` and wrap every target projection; returns {module path: adapter}."""
    for p in model.parameters():
        p.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    adapters: dict[str, LoRALinear] = {}
    for path, module in list(model.named_modules()):  # sorted by construction: deterministic init order
        for name in targets:
            child = getattr(module, name, None)
            if isinstance(child, nn.Linear):
                wrapped = LoRALinear(child, rank, alpha, generator)
                setattr(module, name, wrapped)
                adapters[f"{path}.{name}" if path else name] = wrapped
    if not adapters:
        raise ValueError(f"no {'/'.join(targets)} linear layers found to adapt")
    return adapters


@contextlib.contextmanager
def disabled(adapters: dict[str, LoRALinear]) -> Iterator[None]:
    """Run the base model (the distillation teacher) inside the block."""
    for a in adapters.values():
        a.enabled = False
    try:
        yield
    finally:
        for a in adapters.values():
            a.enabled = True


def adapter_state(adapters: dict[str, LoRALinear]) -> dict[str, torch.Tensor]:
    """{path.lora_a / path.lora_b: weights}, on the CPU whatever device trained them."""
    state = {}
    for path, a in adapters.items():
        state[f"{path}.lora_a"] = a.lora_a.detach().cpu()
        state[f"{path}.lora_b"] = a.lora_b.detach().cpu()
    return state


def save_adapter(adapters: dict[str, LoRALinear], out_dir: Path, meta: dict) -> None:
    """Write `adapter.safetensors` (bf16) and `adapter.json` into `out_dir`."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in adapter_state(adapters).items()}
    save_file(state, str(out_dir / ADAPTER_WEIGHTS))
    first = next(iter(adapters.values()))
    meta = {"rank": first.rank, "alpha": first.alpha, "targets": sorted({p.rsplit(".", 1)[1] for p in adapters}), **meta}
    (out_dir / ADAPTER_META).write_text(json.dumps(meta, indent=2) + "\n")


def load_into(adapters: dict[str, LoRALinear], adapter_dir: Path) -> list[float] | None:
    """Start `adapters` from a saved adapter (to train it further); returns the
    slot gains it was adapted with (`adapter.json`), or None if it pools by the mean.

    The saved rank may be lower than this run's if the scale ``alpha / rank``
    is the same: it fills the first components (A's first rows, B's first
    columns) and the others keep their fresh start (B zero), so the adapted
    model is unchanged until training moves them (growing the rank). The saved
    adapter may cover only some of this run's layers (adding targets, e.g. the
    MLPs to an attention adapter): the others keep their fresh start."""
    from safetensors.torch import load_file

    meta = json.loads((adapter_dir / ADAPTER_META).read_text())
    first = next(iter(adapters.values()))
    saved_rank = int(meta["rank"])
    if saved_rank > first.rank or not math.isclose(meta["alpha"] / saved_rank, first.scale):
        raise ValueError(f"{adapter_dir}: rank {saved_rank}, alpha {meta['alpha']}; this run has rank "
                         f"{first.rank}, alpha {first.alpha} (a saved rank can only grow, at the same alpha / rank)")
    state = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    if not set(state) <= set(adapter_state(adapters)):
        raise ValueError(f"{adapter_dir}: its adapted layers are not among this run's")
    for path, a in adapters.items():
        if f"{path}.lora_a" not in state:
            continue
        a.lora_a.data[:saved_rank].copy_(state[f"{path}.lora_a"])  # [saved_rank, in]
        a.lora_b.data[:, :saved_rank].copy_(state[f"{path}.lora_b"])  # [out, saved_rank]
    return meta.get("slot_gains")
