"""Cut rules for dynamic chunk boundaries on the shipped demo model, offline.

Runs the demo model in transformers with the reference chunked attention
(`demo.evaluate.needle_sweep`: position-matched needles, accuracy by needle
phase) under the fixed grid (`none`) and under `boundaries: dynamic` with
each cut rule below swapped in for `boundaries.frame_cuts`. The rule
"frame end" cuts where the fixed grid does, so it isolates the storage
(one slot per unit, units sealing one by one) from the moving of chunks.

    python benchmarks/dynamic_rules.py --per-phase 128
"""

from __future__ import annotations

import argparse

import torch

from vllm_chunked_kv.core import boundaries
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.demo.evaluate import load_model, needle_sweep


def _pick(cfg: ChunkedKVConfig, score: torch.Tensor) -> torch.Tensor:
    """The candidate cut with the highest score ``[..., candidates]``, ties to the later one."""
    cand = boundaries.candidates(cfg).to(score.device)
    return cand[cand.numel() - 1 - score.flip(-1).argmax(-1)]


def _adjacent(cfg: ChunkedKVConfig, frame_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cand = boundaries.candidates(cfg).to(frame_keys.device)
    keys = frame_keys.float()
    return keys[..., cand, :], keys[..., cand + 1, :]  # [..., candidates, D] each


def frame_end(cfg, frame_keys):
    return torch.full(frame_keys.shape[:-2], cfg.chunk_size - 1, dtype=torch.long, device=frame_keys.device)


def l2_change(cfg, frame_keys):
    here, after = _adjacent(cfg, frame_keys)
    return _pick(cfg, (after - here).norm(dim=-1))


def smallest_change(cfg, frame_keys):
    here, after = _adjacent(cfg, frame_keys)
    return _pick(cfg, torch.nn.functional.cosine_similarity(here, after, dim=-1))


RULES = {"cosine change (shipped)": boundaries.frame_cuts, "frame end": frame_end, "L2 change": l2_change,
         "smallest change": smallest_change}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-phase", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_model()
    common = dict(chunk_size=4, window=32, sink_tokens=4)
    runs = {"none (fixed grid)": (ChunkedKVConfig(**common), boundaries.frame_cuts)}
    dynamic = ChunkedKVConfig(**common, boundaries="dynamic", min_chunk=2)
    runs.update({f"dynamic, {name}": (dynamic, rule) for name, rule in RULES.items()})
    print(f"| mode | phase 0 | phase 1 | phase 2 | phase 3 | gap [95% CI] |  ({args.per_phase} needles per phase)")
    shipped = boundaries.frame_cuts
    try:
        for name, (cfg, rule) in runs.items():
            boundaries.frame_cuts = rule
            result = needle_sweep(model, cfg, per_phase=args.per_phase)
            phases = " | ".join(f"{100 * g.accuracy:.1f}" for g in result.groups)
            gap = result.gap
            print(f"| {name} | {phases} | {100 * gap.value:.1f} [{100 * gap.ci_low:.1f}, {100 * gap.ci_high:.1f}] |",
                  flush=True)
    finally:
        boundaries.frame_cuts = shipped


if __name__ == "__main__":
    main()
