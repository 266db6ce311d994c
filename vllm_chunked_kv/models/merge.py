"""Merge a saved low-rank adapter into a checkpoint: the adapted model is then a
plain checkpoint that `vllm serve` loads with no plugin code.

An adapter directory (written by `adapt`, shipped under `models/adapters/`):

- `adapter.safetensors`: ``<module path>.lora_a`` ``[rank, in]`` / ``.lora_b``
  ``[out, rank]`` tensors; the update of linear layer ``W`` is
  ``alpha / rank * B @ A``;
- `adapter.json`: rank, alpha, targets, the base model it was trained on;
- `chunked_kv_serve.json`: how to serve the merged model (`core.serve_file`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from torch import nn

from vllm_chunked_kv.core.serve_file import SERVE_FILE

ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_META = "adapter.json"


def merge_into(model: nn.Module, adapter_dir: Path) -> int:
    """Add the saved adapter's updates to `model`'s plain linear weights; returns how many were merged."""
    from safetensors.torch import load_file

    meta = json.loads((adapter_dir / ADAPTER_META).read_text())
    scale = meta["alpha"] / meta["rank"]
    state = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    modules = dict(model.named_modules())
    paths = sorted({key.rsplit(".", 1)[0] for key in state})
    for path in paths:
        linear = modules.get(path)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"adapter names {path}, which is not a linear layer of this model")
        delta = state[f"{path}.lora_b"].float() @ state[f"{path}.lora_a"].float() * scale  # [out, in]
        linear.weight.data = (linear.weight.data.float() + delta).to(linear.weight.dtype)
    return len(paths)


def merge_adapter(model_dir: Path, adapter_dir: Path, out_dir: Path) -> None:
    """Write `model_dir` with `adapter_dir` merged into `out_dir`: weights in the base
    checkpoint's dtype (the merge itself in fp32), tokenizer, serve file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    stored = model.dtype
    merge_into(model.float(), Path(adapter_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(stored).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
    for name in ("tokenizer_config.json",):  # keep the base's tokenizer class (see models.fetch)
        if (Path(model_dir) / name).exists():
            shutil.copy(Path(model_dir) / name, out_dir / name)
    shutil.copy(Path(adapter_dir) / SERVE_FILE, out_dir / SERVE_FILE)
