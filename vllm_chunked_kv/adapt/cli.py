"""`vllm-chunked-kv adapt MODEL_DIR --out DIR`: teach a model to read its chunked KV cache.

    vllm-chunked-kv adapt MODEL_DIR --out DIR \\
        [--config '{"chunked_kv": {"chunk_size": 4, "window": 128, "sink_tokens": 4, "stagger": "layers"}}'] \\
        [--steps 360] [--seed 0] [--threads 2]

Fine-tunes low-rank adapters on the attention projections (`adapt.train`)
under the chunked attention of `--config` (the `--additional-config` JSON the
model will be served with), then writes into DIR:

- the merged model (config, `model.safetensors` in bf16, tokenizer), which
  `vllm serve DIR` loads like any model;
- `chunked_kv_serve.json`: the backend and settings it was adapted for
  (with `--learn-gains`, pooling "gated" and the learned `slot_gains`);
- `adapter/`: the adapter alone (a few MB; `models fetch NAME --adapted`
  merges a shipped one into the base model);
- `work/`: the checkpoint (a second run with the same DIR resumes) and
  `train_log.jsonl`; `ADAPT.md`: the command, the time and the options.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

DEFAULT_SETTINGS = {"chunk_size": 4, "window": 128, "sink_tokens": 4, "stagger": "layers"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vllm_chunked_kv.adapt.train import AdaptOptions

    parser.add_argument("model_dir", type=Path, help="a Hugging Face decoder model directory (Llama, Qwen2, Gemma 2/3 ...)")
    parser.add_argument("--out", type=Path, required=True, help="output model directory (resumes if it holds a checkpoint)")
    parser.add_argument("--config", default=json.dumps({"chunked_kv": DEFAULT_SETTINGS}),
                        help="the chunked_kv settings to adapt for, as --additional-config JSON (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    defaults = AdaptOptions()
    for f in fields(AdaptOptions):
        default = getattr(defaults, f.name)
        kind = {"action": argparse.BooleanOptionalAction} if isinstance(default, bool) else {"type": type(default)}
        parser.add_argument(f"--{f.name.replace('_', '-')}", default=default, help="(default: %(default)s)", **kind)


def parse_settings(text: str):
    """A ChunkedKVConfig from `{"chunked_kv": {...}}` JSON (the wrapper is required, as vLLM's is)."""
    from vllm_chunked_kv.core.config import ADDITIONAL_CONFIG_KEY, ChunkedKVConfig

    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict) or set(obj) != {ADDITIONAL_CONFIG_KEY}:
        raise ValueError(f'--config: expected {{"{ADDITIONAL_CONFIG_KEY}": {{...}}}}, got keys {sorted(obj) if isinstance(obj, dict) else obj!r}')
    return ChunkedKVConfig.from_additional_config(obj)


def run(args: argparse.Namespace) -> int:
    import torch

    from vllm_chunked_kv.adapt import lora, report, train
    from vllm_chunked_kv.models.merge import merge_adapter
    from vllm_chunked_kv.core.config import ChunkedKVConfigError
    from vllm_chunked_kv.core.serve_file import write_serve_file

    opts = train.AdaptOptions(**{f.name: getattr(args, f.name) for f in fields(train.AdaptOptions)})
    try:
        cfg = parse_settings(args.config)
        train.check_options(cfg, opts)
    except (ValueError, ChunkedKVConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not (args.model_dir / "config.json").exists():
        print(f"error: {args.model_dir} is not a model directory (no config.json)", file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    model.config.use_cache = False
    cfg.check_model(model.config.num_hidden_layers, model.config.num_key_value_heads)
    began = time.perf_counter()
    adapted = train.train(model, tokenizer, cfg, opts, args.out / "work", log=report.progress_printer(opts.steps))
    adapter_dir = args.out / "adapter"
    meta = {"base_model": str(args.model_dir), "options": asdict(opts), "slot_gains": adapted.gains}
    lora.save_adapter(adapted.adapters, adapter_dir, meta)
    served = train.serve_config(cfg, adapted.gains)
    write_serve_file(adapter_dir, served)
    merge_adapter(args.model_dir, adapter_dir, args.out)
    report.write_report(args.out, sys.argv, served, opts, time.perf_counter() - began, args.out / "work" / "train_log.jsonl")
    print(args.out)
    return 0
