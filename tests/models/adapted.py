"""Checks shared by the shipped adapters' tests (`test_<model>_adapted.py`).

- `fetch_adapted(name, cache)`: `models fetch NAME --adapted`, the directory
  it prints last.
- `changed_weights(base_dir, adapted_dir)`: the tensors the merge changed.
- `served_settings(adapted_dir)`: one engine started with
  `attention_backend` alone on the directory; what its log says it serves
  with (the resolved `describe()` JSON of CHUNKED_KV's startup line) and
  where the settings came from, plus the tokens it generated.
- `probe_scores(base_dir, adapted_dir, prompts)`: `adapt.probe` accuracy of
  the base and the adapted model under the adapted model's chunked attention,
  at adapt's own precision.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from vllm_chunked_kv.commands.main import main
from vllm_chunked_kv.core.serve_file import SERVE_FILE, read_serve_config
from vllm_chunked_kv.runner.engine import generate

from .engine import SERVE_DTYPE

PROJECTIONS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")


def fetch_adapted(name: str, cache: Path) -> Path:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["models", "fetch", name, "--adapted", "--cache-dir", str(cache)]) == 0
    return Path(out.getvalue().strip().splitlines()[-1])


def changed_weights(base_dir: Path, adapted_dir: Path) -> set[str]:
    base, merged = load_file(str(base_dir / "model.safetensors")), load_file(str(adapted_dir / "model.safetensors"))
    return {k for k in base if not torch.equal(base[k], merged[k])}


def served_settings(adapted_dir: Path, prompt_ids: list[int]) -> dict:
    """{"settings": the backend's logged settings, "source": the log's settings line, "tokens": generated}."""
    serve = json.loads((adapted_dir / SERVE_FILE).read_text())
    engine = {"attention_backend": serve["attention_backend"], "dtype": SERVE_DTYPE, "kv_cache_memory_bytes": 256 << 20}
    run = generate(str(adapted_dir), engine, [[prompt_ids]], max_tokens=4)
    used = re.search(r"Using CHUNKED_KV attention backend with (\{.*\}), KV pages", run["log"])
    source = re.search(r"chunked_kv: settings from (.*)", run["log"])
    return {"settings": json.loads(used.group(1)) if used else None, "source": source.group(1) if source else None,
            "tokens": run["outputs"][0][0]}


def expected_settings(adapted_dir: Path) -> dict:
    """The serve file's settings, resolved as the backend logs them (a JSON round trip: lists, not tuples)."""
    return json.loads(json.dumps(read_serve_config(adapted_dir).describe()))


def probe_scores(base_dir: Path, adapted_dir: Path, prompts) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from vllm_chunked_kv.adapt import probe, train
    from vllm_chunked_kv.hf.attention import chunked_attention

    cfg = read_serve_config(adapted_dir)
    scores = {}
    for name, path in (("base", base_dir), ("adapted", adapted_dir)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        # adapt's own precision: bf16 where the CPU has it natively, fp32 where bf16 would be emulated
        with torch.no_grad(), train.autocast(train.AdaptOptions()), chunked_attention(model, cfg):
            scores[name] = probe.accuracy(model, prompts)
    return scores
