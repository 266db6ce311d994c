"""Accuracy of the demo model in transformers, with full or chunked attention.

    python -m vllm_chunked_kv.demo.evaluate --model DIR [--per-phase 256] [--chunked JSON ...]

- `predict`: greedy next word of each prompt (one forward pass, argmax at
  the last position), in batches of equal-length prompts.
- `accuracy`: held-out prompts at the demo context length.
- `needle_sweep`: the position-matched needle-phase sweep of docs/design.md §7
  (targets grouped by `position mod hop`, equal mean and variance of
  position), with Wilson intervals per phase and the best - worst gap
  (`scan.stats.compare_groups`).

Chunked attention is the reference's (`hf.attention`), so these numbers
are what vLLM's compressed backend should reproduce.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.demo import DEFAULT_MODEL_DIR
from vllm_chunked_kv.hf.attention import chunked_attention
from vllm_chunked_kv.scan.stats import Comparison, compare_groups, wilson
from vllm_chunked_kv.tasks.kv_retrieval import VOCAB, KVPrompt, is_correct, make_prompt, needle_positions_by_phase

# Needle positions of the sweep: past the sinks, and sealed (older than the
# raw window of 32 before the query) in the default 243-token prompt.
NEEDLE_RANGE = (8, 200)
_ID = {word: i for i, word in enumerate(VOCAB)}


def load_model(model_dir: str | Path = DEFAULT_MODEL_DIR):
    """The demo model in transformers (fp32, eval mode)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def encode(prompts: list[KVPrompt]) -> torch.Tensor:
    """Token ids [n, T] of equal-length prompts, <bos> first (as the tokenizer does)."""
    rows = [[_ID["<bos>"]] + [_ID[w] for w in p.text.split()] for p in prompts]
    if len({len(r) for r in rows}) != 1:
        raise ValueError("prompts of one batch must have the same length")
    return torch.tensor(rows)  # [n, T]


@torch.no_grad()
def predict(model, prompts: list[KVPrompt], cfg: ChunkedKVConfig | None = None, batch_size: int = 64) -> list[str]:
    """Greedy next word after each prompt, with full attention (cfg None) or chunked `cfg`."""
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(p.num_tokens, []).append(i)
    words = [""] * len(prompts)
    with chunked_attention(model, cfg):
        for indices in by_length.values():
            for start in range(0, len(indices), batch_size):
                part = indices[start : start + batch_size]
                logits = model(input_ids=encode([prompts[i] for i in part])).logits  # [n, T, vocab]
                for i, token in zip(part, logits[:, -1].argmax(-1).tolist()):
                    words[i] = VOCAB[token]
    return words


def accuracy(model, num_prompts: int, seed: int = 0, cfg: ChunkedKVConfig | None = None, **prompt_kw) -> tuple[int, int]:
    """(correct, total) over `num_prompts` held-out prompts (random target positions)."""
    rng = random.Random(f"held-out/{seed}")
    prompts = [make_prompt(rng, **prompt_kw) for _ in range(num_prompts)]
    answers = predict(model, prompts, cfg)
    return sum(is_correct(a, p.answer) for a, p in zip(answers, prompts)), num_prompts


def needle_sweep(
    model,
    cfg: ChunkedKVConfig | None,
    *,
    hop: int = 4,
    per_phase: int = 256,
    seed: int = 0,
    needle_range: tuple[int, int] = NEEDLE_RANGE,
    **prompt_kw,
) -> Comparison:
    """Accuracy by needle phase (position mod hop), position-matched; the same prompts for every cfg."""
    rng = random.Random(f"needles/{seed}")
    positions = needle_positions_by_phase(hop, per_phase, *needle_range, rng)
    prompts = {phase: [make_prompt(rng, target_position=p, **prompt_kw) for p in ps] for phase, ps in positions.items()}
    flat = [p for phase in range(hop) for p in prompts[phase]]
    answers = predict(model, flat, cfg)
    hits = [is_correct(a, p.answer) for a, p in zip(answers, flat)]
    correct = [sum(hits[phase * per_phase : (phase + 1) * per_phase]) for phase in range(hop)]
    return compare_groups(list(range(hop)), correct, [per_phase] * hop, seed=seed)


def format_percent(k: int, n: int) -> str:
    """`k/n` as a percentage with its Wilson 95% interval."""
    lo, hi = wilson(k, n)
    return f"{100 * k / n:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def format_sweep(result: Comparison) -> str:
    """One line per phase and the gap, as percentages with 95% intervals."""
    lines = [f"  phase {g.label}: {format_percent(g.correct, g.n)}" for g in result.groups]
    gap = result.gap
    lines.append(
        f"  gap (best {gap.best} - worst {gap.worst}): {100 * gap.value:.1f} "
        f"[{100 * gap.ci_low:.1f}, {100 * gap.ci_high:.1f}], no-effect p95 {100 * gap.null_p95:.1f}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--per-phase", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--chunked", action="append", default=None,
        help='ChunkedKVConfig fields as JSON (repeatable); default: {"chunk_size": 4, "window": 32, "sink_tokens": 4}',
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    configs = [json.loads(c) for c in (args.chunked or ['{"chunk_size": 4, "window": 32, "sink_tokens": 4}'])]
    print(f"full attention, held-out: {format_percent(*accuracy(model, 4 * args.per_phase, args.seed))}")
    for fields in [None] + configs:
        cfg = None if fields is None else ChunkedKVConfig(**fields)
        hop = 4 if cfg is None else cfg.hop
        print(f"{'full attention' if cfg is None else json.dumps(fields)}, needle phase mod {hop}:")
        print(format_sweep(needle_sweep(model, cfg, hop=hop, per_phase=args.per_phase, seed=args.seed)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
