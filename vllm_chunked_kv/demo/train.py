"""Train the demo retrieval model from scratch on CPU, deterministically from a seed.

    python -m vllm_chunked_kv.demo.train --out DIR [--gated-out DIR2] --seed 0 [--steps-scale 0.1]

The curriculum (docs/design.md §8): plain recall training stalls at "guess any
value", so the model first learns to copy a segment placed anywhere in a
96-token sequence (which grows an induction circuit that works at every
position; a fixed-offset copy is learned by position instead and does not
transfer), then recalls at length 96, then at 288, with some copy examples
mixed in. A last phase fine-tunes with mean-pooled chunk-4 compression
inside the attention (window 32, 4 sinks); a quarter of each of its batches
keeps full attention, without which full-attention accuracy on recent
records decays. A model trained with full attention only collapses under
compression applied afterwards; the fine-tuned one answers under both and
shows the periodic weak spot.

With `--gated-out`, a copy of the model before the fine-tune is fine-tuned
the same way (same batches) but with learned per-slot pooling gains instead
of mean pooling, and saved with its gains (`chunked_kv_gains.json`) for
`pooling="gated"`.

Each phase runs up to its step budget and ends early once the running
accuracy on its training batches reaches the phase's target; everything
(weights, data, early stops) follows from the seed (bit-identical with the
same torch build and thread count). `--steps-scale` scales every budget, for
quick runs. The output directory gets the model (fp32 safetensors, config),
the tokenizer and a TRAINING.md with the command, the time and held-out
accuracies. `demo.finetune` continues training a saved model under staggered
grids with the last phase's recipe.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.demo.architecture import build_model
from vllm_chunked_kv.hf.attention import GAINS_LR_SCALE, chunked_attention, gain_weights
from vllm_chunked_kv.demo.data import IGNORE, batch

# The compression the model is fine-tuned under (docs/design.md §8).
FINETUNE_COMPRESSION = ChunkedKVConfig(chunk_size=4, window=32, sink_tokens=4)


@dataclass(frozen=True)
class Phase:
    name: str
    mix: tuple[tuple[str, int], ...]  # (task, examples per batch); the last task is the phase's goal
    length: int  # tokens per example
    max_steps: int
    lr: float
    num_queries: int = 1
    target_accuracy: float = 2.0  # running accuracy on the goal task that ends the phase early (> 1: never)
    min_steps: int = 0
    compressed: bool = False  # train under the run's compression (FINETUNE_COMPRESSION unless given)
    full_rows: int = 0  # with compressed: the last rows of each batch run with full attention
    decay: bool = False  # cosine-decay the learning rate over the phase


CURRICULUM = (
    Phase("copy-96", (("copy", 32),), 96, 1500, 1e-3, target_accuracy=0.995, min_steps=1000),
    Phase("recall-96", (("copy", 8), ("recall", 24)), 96, 1500, 1e-3, num_queries=4, target_accuracy=0.98, min_steps=200),
    Phase("recall-288", (("copy", 4), ("recall", 12)), 288, 800, 5e-4, num_queries=8, target_accuracy=0.99, min_steps=100),
    Phase("finetune-chunked", (("recall", 16),), 288, 1200, 1e-3, num_queries=8, compressed=True, decay=True, full_rows=4),
)
GAINS_FILE = "chunked_kv_gains.json"
WARMUP_STEPS = 100
EMA = 0.95  # smoothing of the running accuracy


def scaled(phase: Phase, scale: float) -> Phase:
    """`phase` with its step budgets multiplied by `scale` (at least one step)."""
    return Phase(**{
        **phase.__dict__,
        "max_steps": max(1, round(phase.max_steps * scale)),
        "min_steps": round(phase.min_steps * scale),
    })


def _accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of labelled tokens predicted right (labels shifted as in the loss)."""
    predicted = logits[:, :-1].argmax(-1)  # [b, T-1]
    target = labels[:, 1:]  # [b, T-1]
    keep = target != IGNORE
    return float((predicted[keep] == target[keep]).float().mean())


def run_phase(
    model, optimizer, phase: Phase, rng: random.Random, step0: int, log, gains=None,
    compression: ChunkedKVConfig = FINETUNE_COMPRESSION,
) -> int:
    """Train one phase; returns the number of steps taken. `gains`: learned
    slot-gain logits; `compression`: the chunked attention of a compressed phase."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    running = 0.0
    for step in range(phase.max_steps):
        global_step = step0 + step
        lr = phase.lr * min(1.0, (global_step + 1) / WARMUP_STEPS)
        if phase.decay:
            lr *= 0.5 * (1 + math.cos(math.pi * step / phase.max_steps))
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        parts = [batch(rng, task, count, phase.length, phase.num_queries) for task, count in phase.mix]
        ids = torch.cat([p[0] for p in parts])  # [batch, length]
        labels = torch.cat([p[1] for p in parts])  # [batch, length]
        split = len(ids) - phase.full_rows if phase.compressed else 0  # rows [0, split) compressed
        logits, loss = [], 0.0
        for rows, cfg in ((slice(0, split), compression), (slice(split, None), None)):
            if rows.start == len(ids) or rows.stop == 0:
                continue
            with chunked_attention(model, cfg, gains):
                out = model(input_ids=ids[rows], labels=labels[rows])
            loss = loss + out.loss * len(ids[rows]) / len(ids)
            logits.append(out.logits.detach())
        logits = torch.cat(logits)  # [batch, length, vocab]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        goal = len(ids) - phase.mix[-1][1]  # first row of the goal task
        accuracy = _accuracy(logits[goal:], labels[goal:])
        running = accuracy if step == 0 else EMA * running + (1 - EMA) * accuracy
        if step % 50 == 0 or step == phase.max_steps - 1:
            log(f"{phase.name} step {step:5d} loss {loss.item():.4f} acc {accuracy:.3f} running {running:.3f}")
        if step + 1 >= phase.min_steps and running >= phase.target_accuracy:
            log(f"{phase.name} reached running accuracy {running:.3f} at step {step}")
            return step + 1
    return phase.max_steps


@dataclass
class Trained:
    model: object  # fine-tuned with mean pooling
    record: list[tuple[str, int, float]]  # (phase, steps, seconds)
    gated_model: object | None = None  # fine-tuned with learned slot gains
    gains: list[float] | None = None  # the learned slot gains, normalised


def train(seed: int, steps_scale: float = 1.0, log=print, gated: bool = False) -> Trained:
    """Run the curriculum; with `gated`, also fine-tune a copy of the
    full-attention model with learned per-slot gains instead of mean pooling."""
    torch.manual_seed(seed)
    model = build_model(seed)
    model.train()
    optimizer = make_optimizer(model)
    record = []
    step0 = 0
    for phase in CURRICULUM:
        phase = scaled(phase, steps_scale)
        if phase.compressed and gated:
            gated_model = copy.deepcopy(model)
            gated_optimizer = _copy_optimizer(optimizer, gated_model)
        rng = random.Random(f"{seed}/{phase.name}")
        start = time.perf_counter()
        steps = run_phase(model, optimizer, phase, rng, step0, log)
        record.append((phase.name, steps, time.perf_counter() - start))
        if phase.compressed and gated:
            logits = torch.zeros(FINETUNE_COMPRESSION.chunk_size, requires_grad=True)  # start at mean pooling
            gated_optimizer.add_param_group({"params": [logits], "weight_decay": 0.0, "lr_scale": GAINS_LR_SCALE})
            rng = random.Random(f"{seed}/{phase.name}")  # the same batches as the mean fine-tune
            start = time.perf_counter()
            gated_steps = run_phase(gated_model, gated_optimizer, phase, rng, step0, log, gains=logits)
            record.append((phase.name + "-gated", gated_steps, time.perf_counter() - start))
        step0 += steps
    model.eval()
    if not gated:
        return Trained(model, record)
    gains = gain_weights(logits)
    log(f"learned slot gains {gains}")
    return Trained(model, record, gated_model.eval(), gains)


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98), weight_decay=0.01)


def _copy_optimizer(optimizer, model):
    """A new optimizer over `model`'s parameters (a deep copy of the model
    `optimizer` optimises, parameters in the same order) with its state."""
    twin = make_optimizer(model)
    twin.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return twin


def gated_config(gains: list[float]) -> ChunkedKVConfig:
    """FINETUNE_COMPRESSION with learned gains as `pooling="gated"` (how vLLM serves them)."""
    cfg = FINETUNE_COMPRESSION
    return ChunkedKVConfig(
        chunk_size=cfg.chunk_size, window=cfg.window, sink_tokens=cfg.sink_tokens, pooling="gated", slot_gains=gains
    )


def save(model, out_dir: Path, gains: list[float] | None = None) -> None:
    """Write the model (fp32 safetensors), its generation config, the tokenizer
    and, for the gated variant, `chunked_kv_gains.json`."""
    from vllm_chunked_kv.demo.tokenizer import save_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.use_cache = True
    model.generation_config.do_sample = False
    model.generation_config.max_new_tokens = 1
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer(out_dir)
    if gains is not None:
        cfg = FINETUNE_COMPRESSION
        meta = {
            "pooling": "gated",
            "slot_gains": gains,
            "trained_with": {"chunk_size": cfg.chunk_size, "window": cfg.window, "sink_tokens": cfg.sink_tokens},
        }
        (out_dir / GAINS_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def parse_run_arguments(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Add the options every training command shares, parse, and set torch
    up for a reproducible run."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps-scale", type=float, default=1.0, help="multiply every phase's step budget")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 keeps runs reproducible)")
    parser.add_argument("--eval-prompts", type=int, default=200,
                        help="held-out prompts per accuracy in TRAINING.md (a multiple of 4)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    return args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output model directory (mean-pooling fine-tune)")
    parser.add_argument("--gated-out", type=Path, default=None,
                        help="also fine-tune with learned per-slot gains and save that variant here")
    args = parse_run_arguments(parser, argv)
    start = time.perf_counter()
    trained = train(args.seed, args.steps_scale, log=lambda msg: print(msg, flush=True), gated=args.gated_out is not None)
    seconds = time.perf_counter() - start
    from vllm_chunked_kv.demo.report import write_training_report

    save(trained.model, args.out)
    modes = {"chunked mean-4": FINETUNE_COMPRESSION}
    write_training_report(trained.model, args.out, args, trained.record, seconds, modes)
    if args.gated_out is not None:
        save(trained.gated_model, args.gated_out, trained.gains)
        modes = {"chunked gated-4 (learned gains)": gated_config(trained.gains), **modes}
        write_training_report(trained.gated_model, args.gated_out, args, trained.record, seconds, modes)
    print(f"saved after {seconds:.0f} s of training", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
