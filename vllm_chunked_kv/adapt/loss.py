"""`adapt`'s loss: distillation from the model's own full attention plus cross-entropy on the answers.

    loss = KL(teacher || student) averaged over the scored positions
           + ce_weight * cross-entropy of the student on the answer tokens

The teacher is the model with its adapters off, under full attention; the
student is the adapted model, its chunked rows under the chunked attention it
will be served with, its last `full_rows` rows under full attention.

Two options make a large vocabulary affordable on a CPU (Gemma 3's 262,144
rows of output layer: full logits of 4 rows x 2,048 tokens are 8.6 GB in
fp32, twice over for teacher and student):

- `kl_positions` = P > 0 scores P positions per step, drawn uniformly from
  the row (the same for every row of the batch, as transformers' `logits_to_keep`
  takes them), plus every answer position; the output layer runs only there.
  The mean KL over them estimates the mean over every token. 0: every position.
- `kl_top_k` = K > 0 keeps the teacher's K most likely tokens at each scored
  position and lumps the rest into one outcome: KL over K + 1 outcomes
  (Hinton-style distillation on the teacher's top-k). 0: the full distribution.

The draws follow from (seed, step), so a resumed run scores the same positions.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from vllm_chunked_kv.adapt import lora
from vllm_chunked_kv.adapt.data import IGNORE
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.hf.attention import chunked_attention


def positions(labels: torch.Tensor, count: int, seed: str) -> torch.Tensor | None:
    """The sorted positions [P] to score: `count` drawn from the row (without
    repeats) and every answer position of any row; None (every position) when
    `count` is 0 or covers the row. labels [rows, length]."""
    length = labels.shape[1]
    if count <= 0 or count >= length:
        return None
    drawn = set(random.Random(f"kl-positions:{seed}").sample(range(length), count))
    answers = set((labels != IGNORE).any(0).nonzero().flatten().tolist())
    return torch.tensor(sorted(drawn | answers), device=labels.device)


def logits(model, ids: torch.Tensor, cfg: ChunkedKVConfig | None, gains: torch.Tensor | None = None,
           keep: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [rows, P, vocab] at positions `keep` [P] (all when None) under chunked
    attention `cfg` (with gain logits `gains`, if any), or full (sdpa) when None."""
    extra = {} if keep is None else {"logits_to_keep": keep}
    if cfg is None:
        model.set_attn_implementation("sdpa")
        return model(input_ids=ids, **extra).logits
    with chunked_attention(model, cfg, gains):
        return model(input_ids=ids, **extra).logits


def top_k_kl(student: torch.Tensor, teacher: torch.Tensor, k: int) -> torch.Tensor:
    """KL(teacher || student) over the teacher's top `k` tokens and one outcome for
    the rest, averaged over positions; both are log-probabilities [N, vocab]."""
    top, index = teacher.topk(k, dim=-1)  # [N, k]
    mine = student.gather(-1, index)  # [N, k]
    rest_t = torch.log1p(-top.exp().sum(-1).clamp(max=1 - 1e-6))  # [N]
    rest_s = torch.log1p(-mine.exp().sum(-1).clamp(max=1 - 1e-6))  # [N]
    kl = (top.exp() * (top - mine)).sum(-1) + rest_t.exp() * (rest_t - rest_s)  # [N]
    return kl.mean()


def loss_terms(model, adapters, ids: torch.Tensor, labels: torch.Tensor, cfg: ChunkedKVConfig, opts,
               gains: torch.Tensor | None = None, seed: str = "") -> tuple[torch.Tensor, float, float]:
    """(loss to minimise, KL value, CE value) for one batch ids/labels [rows, length];
    `gains`: learned slot-gain logits or None; `seed`: the step's draw of positions."""
    keep = positions(labels, opts.kl_positions, seed)
    if keep is not None:
        labels = labels[:, keep]  # [rows, P]
    split = ids.shape[0] - opts.full_rows  # rows [0, split) chunked
    with torch.no_grad(), lora.disabled(adapters):
        teacher = logits(model, ids, None, keep=keep).float().log_softmax(-1)  # [rows, P, vocab]
    parts = [(ids[:split], cfg), (ids[split:], None)]  # chunked rows, then full-attention rows; either may be empty
    student = torch.cat([logits(model, part, part_cfg, gains, keep) for part, part_cfg in parts if part.shape[0]])
    student = student.float().log_softmax(-1)  # [rows, P, vocab]
    if opts.kl_top_k > 0:
        kl = top_k_kl(student.flatten(0, 1), teacher.flatten(0, 1), opts.kl_top_k)
    else:
        kl = F.kl_div(student.flatten(0, 1), teacher.flatten(0, 1), log_target=True, reduction="batchmean")
    answer = labels != IGNORE
    ce = F.nll_loss(student[answer], labels[answer]) if bool(answer.any()) else student.new_zeros(())
    return kl + opts.ce_weight * ce, float(kl.detach()), float(ce.detach())
