"""Train the demo retrieval model from scratch on CPU, deterministically from a seed.

    python -m vllm_chunked_kv.demo.train --out DIR --seed 0 [--steps-scale 0.1]

The curriculum (DESIGN.md §8): plain recall training stalls at "guess any
value", so the model first learns to copy (which grows an induction
circuit), then recalls at length 96, then at 288. A last phase fine-tunes
with mean-pooled chunk-4 compression inside the attention (window 32, 4
sinks), interleaved with full-attention steps: a model trained with full
attention only collapses to chance under compression applied afterwards,
while the fine-tuned one answers under both and shows the periodic weak spot
cleanly.

Each phase runs up to its step budget and ends early once the running
accuracy on its training batches reaches the phase's target; everything
(weights, data, early stops) follows from the seed. `--steps-scale` scales
every budget, for quick runs. The output directory gets the model
(safetensors, config), the tokenizer and a TRAINING.md with the command,
the time and held-out accuracies.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_chunked_kv.config import ChunkedKVConfig
from vllm_chunked_kv.demo.architecture import build_model
from vllm_chunked_kv.demo.attention import chunked_attention
from vllm_chunked_kv.demo.data import IGNORE, batch

# The compression the model is fine-tuned under (DESIGN.md §8).
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
    compressed: bool = False  # train under FINETUNE_COMPRESSION
    decay: bool = False  # cosine-decay the learning rate over the phase


CURRICULUM = (
    Phase("copy-96", (("copy", 32),), 96, 1500, 1e-3, target_accuracy=0.995, min_steps=1000),
    Phase("recall-96", (("copy", 8), ("recall", 24)), 96, 1500, 1e-3, num_queries=4, target_accuracy=0.98, min_steps=200),
    Phase("recall-288", (("copy", 4), ("recall", 12)), 288, 800, 5e-4, num_queries=8, target_accuracy=0.99, min_steps=100),
    Phase("finetune-chunked", (("recall", 16),), 288, 600, 5e-4, num_queries=8, compressed=True, decay=True),
)
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


def run_phase(model, optimizer, phase: Phase, rng: random.Random, step0: int, log) -> int:
    """Train one phase; returns the number of steps taken."""
    running = 0.0
    for step in range(phase.max_steps):
        global_step = step0 + step
        lr = phase.lr * min(1.0, (global_step + 1) / WARMUP_STEPS)
        if phase.decay:
            lr *= 0.5 * (1 + math.cos(math.pi * step / phase.max_steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        parts = [batch(rng, task, count, phase.length, phase.num_queries) for task, count in phase.mix]
        ids = torch.cat([p[0] for p in parts])  # [batch, length]
        labels = torch.cat([p[1] for p in parts])  # [batch, length]
        with chunked_attention(model, FINETUNE_COMPRESSION if phase.compressed else None):
            out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        goal = len(ids) - phase.mix[-1][1]  # first row of the goal task
        accuracy = _accuracy(out.logits[goal:].detach(), labels[goal:])
        running = accuracy if step == 0 else EMA * running + (1 - EMA) * accuracy
        if step % 50 == 0 or step == phase.max_steps - 1:
            log(f"{phase.name} step {step:5d} loss {out.loss.item():.4f} acc {accuracy:.3f} running {running:.3f}")
        if step + 1 >= phase.min_steps and running >= phase.target_accuracy:
            log(f"{phase.name} reached running accuracy {running:.3f} at step {step}")
            return step + 1
    return phase.max_steps


def train(seed: int, steps_scale: float = 1.0, log=print):
    """The trained model and a per-phase record [(name, steps, seconds)]."""
    torch.manual_seed(seed)
    model = build_model(seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98), weight_decay=0.01)
    record = []
    step0 = 0
    for index, phase in enumerate(CURRICULUM):
        phase = scaled(phase, steps_scale)
        rng = random.Random(f"{seed}/{phase.name}")
        start = time.perf_counter()
        steps = run_phase(model, optimizer, phase, rng, step0, log)
        step0 += steps
        record.append((phase.name, steps, time.perf_counter() - start))
    model.eval()
    return model, record


def save(model, out_dir: Path) -> None:
    """Write the model (fp32 safetensors), its generation config and the tokenizer."""
    from vllm_chunked_kv.demo.tokenizer import save_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.use_cache = True
    model.generation_config.do_sample = False
    model.generation_config.max_new_tokens = 1
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output model directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps-scale", type=float, default=1.0, help="multiply every phase's step budget")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 keeps runs reproducible)")
    parser.add_argument("--eval-prompts", type=int, default=200, help="held-out prompts per accuracy in TRAINING.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    start = time.perf_counter()
    model, record = train(args.seed, args.steps_scale, log=lambda msg: print(msg, flush=True))
    seconds = time.perf_counter() - start
    save(model, args.out)
    from vllm_chunked_kv.demo.report import write_training_report

    write_training_report(model, args, record, seconds)
    print(f"saved to {args.out} after {seconds:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
