"""Fine-tune a trained demo model with staggered grids (docs/design.md §10) inside its attention.

    python -m vllm_chunked_kv.demo.finetune --from vllm_chunked_kv/demo/model --stagger heads \\
        --out vllm_chunked_kv/demo/model_stagger --seed 0

Continues training the model in `--from` with the recipe of the curriculum's
last phase (recall at length 288, 8 queries per example, a quarter of each
batch at full attention, up to 1,200 steps at lr 1e-3 with warm-up and cosine
decay, a fresh optimizer) under
the compression it was fine-tuned with (`train.FINETUNE_COMPRESSION`: mean
pooling, chunk 4, window 32, 4 sinks) with the given `stagger` setting; the
phase ends early once the running training accuracy reaches its target.

The output directory gets the model, the tokenizer, `chunked_kv_serve.json`
(the backend and `additional_config` to serve it with: a model fine-tuned
staggered is meant to be served staggered) and a TRAINING.md with the
needle-phase sweep under the staggered and the aligned compression, for the
fine-tuned model and for the model it started from.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import torch

from vllm_chunked_kv.core.config import ADDITIONAL_CONFIG_KEY, ChunkedKVConfig
from vllm_chunked_kv.core.serve_file import SERVE_FILE, serve_settings, write_serve_file
from vllm_chunked_kv.demo.train import (
    CURRICULUM,
    FINETUNE_COMPRESSION,
    make_optimizer,
    parse_run_arguments,
    run_phase,
    save,
    scaled,
)

# The curriculum's compressed fine-tune phase, ending early on a running accuracy of 98%.
STAGGER_PHASE = dataclasses.replace(CURRICULUM[-1], name="finetune-stagger", target_accuracy=0.98, min_steps=200)


def staggered_compression(stagger: str | list[list[int]], stagger_groups: int = 2) -> ChunkedKVConfig:
    """FINETUNE_COMPRESSION with staggered grids (`stagger` as in ChunkedKVConfig)."""
    base = FINETUNE_COMPRESSION
    extra = {"stagger_groups": stagger_groups} if stagger == "heads" else {}
    return ChunkedKVConfig(
        chunk_size=base.chunk_size, window=base.window, sink_tokens=base.sink_tokens, stagger=stagger, **extra
    )


def load_for_training(model_dir: Path):
    """The model in `model_dir` (fp32) in training mode, without a KV cache."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    return model.train()


def finetune(model, compression: ChunkedKVConfig, seed: int, steps_scale: float = 1.0, log=print):
    """Fine-tune `model` in place under `compression`; returns the record [(phase, steps, seconds)]."""
    torch.manual_seed(seed)
    phase = scaled(STAGGER_PHASE, steps_scale)
    rng = random.Random(f"{seed}/{phase.name}")
    start = time.perf_counter()
    steps = run_phase(model, make_optimizer(model), phase, rng, 0, log, compression=compression)
    model.eval()
    return [(phase.name, steps, time.perf_counter() - start)]


def _intro(start_dir: Path, cfg: ChunkedKVConfig) -> str:
    settings = json.dumps({ADDITIONAL_CONFIG_KEY: serve_settings(cfg)})
    return f"""Fine-tuned from `{start_dir}` (see its TRAINING.md) with staggered grids
inside the attention. **Serve it staggered**: `--attention-backend chunked_kv
--additional-config '{settings}'` (the same
settings are in `{SERVE_FILE}`). The rows named "start" are the model it
started from, under the same compressions."""


def _parse_stagger(text: str) -> str | list[list[int]]:
    return json.loads(text) if text.lstrip().startswith("[") else text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="start", type=Path, required=True, help="trained demo model directory")
    parser.add_argument("--out", type=Path, required=True, help="output model directory")
    parser.add_argument("--stagger", type=_parse_stagger, default="heads",
                        help="'heads' or a JSON list of per-layer lists of per-KV-head origins")
    parser.add_argument("--stagger-groups", type=int, default=2, help="distinct origins for --stagger heads")
    args = parse_run_arguments(parser, argv)
    compression = staggered_compression(args.stagger, args.stagger_groups)
    model = load_for_training(args.start)
    compression.check_model(model.config.num_hidden_layers, model.config.num_key_value_heads)
    start = time.perf_counter()
    record = finetune(model, compression, args.seed, args.steps_scale, log=lambda msg: print(msg, flush=True))
    seconds = time.perf_counter() - start
    from vllm_chunked_kv.demo.report import write_training_report

    save(model, args.out)
    write_serve_file(args.out, compression)
    modes = {"chunked mean-4, staggered": compression, "chunked mean-4, aligned": FINETUNE_COMPRESSION}
    write_training_report(
        model, args.out, args, record, seconds, modes, program="vllm_chunked_kv.demo.finetune",
        intro=_intro(args.start, compression), baseline=("start", load_for_training(args.start).eval()),
    )
    print(f"saved after {seconds:.0f} s of fine-tuning", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
