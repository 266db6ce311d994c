"""Which KV heads read a far-back fact: attention mass on its pooled rows, by layer and head.

For an adapted model (a directory with `chunked_kv_serve.json`), this builds
`adapt`'s retrieval rows (`adapt.data.retrieval_row`, one question each, the
asked code at least `--min-distance` tokens before its answer, so only
pooled rows hold it) and runs them teacher-forced under the chunked
attention the model is served with (`hf.attention`, the reference visible
set). At every answer digit it measures, for each layer and KV head, the
attention probability on the code's tokens: each extended row (raw token or
pooled chunk) counts with the share of its tokens that belong to the code,
computed by pooling a 0/1 marker exactly like the values. The mass is
averaged over the head's query heads, the answer digits and the rows.

The heads with the most mass are the ones that copy the code out of the
compressed cache; their grid origins (`ChunkedKVConfig.origins`) decide
which neighbouring digits share a pooled row for them
(docs/experiments/adapt.md). `mass_by_origin` sums the mass
of the heads on each grid origin, over `--origin-layers` (all by default;
the copying layers 17-23 of SmolLM2 in benchmarks/README.md).

    python benchmarks/copy_heads.py DIR --rows 32 --origin-layers 17-23 --json X.json
    python benchmarks/copy_heads.py --from-json X.json --origin-layers 17-23  # recompute mass_by_origin only
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from vllm_chunked_kv.adapt import data
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.hf.attention import chunked_attention
from vllm_chunked_kv.ops.masked import extended_kv
from vllm_chunked_kv.core.serve_file import read_serve_settings


def span_mass(model, cfg: ChunkedKVConfig, ids: list[int], span: list[int],
              queries: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean attention mass of the `queries` positions on the tokens in `span`, [layers, kv_heads],
    and the forward's logits [T, vocab]."""
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    mass = torch.full((layers, kv_heads), float("nan"))

    def observe(layer_idx, probs, folded_k, origins):  # probs [1, Hkv, G, T, T+N], folded_k [T, Hkv, D]
        marker = torch.zeros(folded_k.shape[0], folded_k.shape[1], 1)  # [T, Hkv, 1]
        marker[span] = 1.0
        share = extended_kv(folded_k.float(), marker, cfg, origins).values  # [T+N, Hkv, 1]: code share a row
        on_span = probs[0][:, :, queries] @ share.permute(1, 0, 2).unsqueeze(1)  # [Hkv, G, A, 1]
        mass[layer_idx] = on_span.mean(dim=(1, 2, 3))

    with torch.no_grad(), chunked_attention(model, cfg, observer=observe):
        logits = model(torch.tensor([ids])).logits[0]  # [T, vocab]
    return mass, logits


def code_rows(tokenizer, count: int, length: int, min_distance: int, seed: int):
    """`count` retrieval rows with one asked code: (ids, code positions, answer-digit positions, labels)."""
    rng = random.Random(seed)
    while count:
        row = data.retrieval_row(tokenizer, rng, length, min_distance=min_distance, questions=(1, 1))
        answer = [p for p, t in enumerate(row.labels) if t != data.IGNORE and tokenizer.decode([t]).isdigit()]
        digits = [row.labels[p] for p in answer]
        starts = [s for s in range(answer[0] - len(digits)) if row.ids[s:s + len(digits)] == digits]
        if len(starts) != 1 or answer[0] - starts[0] < min_distance:
            continue  # the code also occurs elsewhere, or it is the recent fact (read from the raw window)
        count -= 1
        yield row.ids, list(range(starts[0], starts[0] + len(digits))), answer, row.labels


def mass_by_origin(mass: list[list[float]], origins: list[list[int]], layers: range | None = None) -> dict:
    """The code mass of every (layer, KV head) in `layers` (all when None) summed by
    the head's grid origin: {"layers": [first, last], "mass": [origin 0, 1, ...]}."""
    layers = range(len(mass)) if layers is None else layers
    sums = [0.0] * (max(o for layer in origins for o in layer) + 1)
    for layer in layers:
        for m, origin in zip(mass[layer], origins[layer]):
            sums[origin] += m
    return {"layers": [layers.start, layers.stop - 1], "mass": [round(x, 4) for x in sums]}


def parse_layers(text: str) -> range | None:
    """'17-23' -> range(17, 24); 'all' -> None."""
    if text == "all":
        return None
    first, _, last = text.partition("-")
    return range(int(first), int(last or first) + 1)


def measure(model, tokenizer, cfg: ChunkedKVConfig, rows: int, length: int = 768, min_distance: int = 300,
            seed: int = 0) -> dict:
    """Mean code mass by layer and KV head over `rows` rows, the heads' origins, and the top heads."""
    total = torch.zeros(model.config.num_hidden_layers, model.config.num_key_value_heads)
    right = 0
    for ids, span, answer, labels in code_rows(tokenizer, rows, length, min_distance, seed):
        mass, logits = span_mass(model, cfg, ids, span, answer)
        total += mass
        right += all(logits[p].argmax().item() == labels[p] for p in answer)
    total /= rows
    heads = model.config.num_key_value_heads
    origins = [cfg.origins(layer, heads) for layer in range(len(total))]  # [layer][kv head]
    ranked = sorted(((total[l, h].item(), l, h) for l in range(len(total)) for h in range(heads)), reverse=True)
    return {
        "rows": rows, "teacher_forced_correct": right, "length": length, "min_distance": min_distance,
        "mass": [[round(x, 4) for x in layer.tolist()] for layer in total],  # [layer][kv head]
        "origins": origins,
        "top": [{"layer": l, "kv_head": h, "origin": origins[l][h], "mass": round(m, 4)} for m, l, h in ranked[:10]],
    }


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, nargs="?", help="a model directory with chunked_kv_serve.json")
    parser.add_argument("--origin-layers", default="all", help="layers summed in mass_by_origin: A-B or all")
    parser.add_argument("--from-json", type=Path, help="recompute mass_by_origin of a result file in place")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--length", type=int, default=768)
    parser.add_argument("--min-distance", type=int, default=300, help="tokens from the code to its answer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    layers = parse_layers(args.origin_layers)
    if args.from_json:
        result = json.loads(args.from_json.read_text())
        result["mass_by_origin"] = mass_by_origin(result["mass"], result["origins"], layers)
        args.from_json.write_text(json.dumps(result, indent=1) + "\n")
        print("mass by origin:", result["mass_by_origin"])
        return
    if args.model is None:
        parser.error("a model directory (or --from-json) is required")
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = read_serve_settings(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    result = measure(model, AutoTokenizer.from_pretrained(args.model), ChunkedKVConfig(**settings),
                     args.rows, args.length, args.min_distance, args.seed)
    result["model"] = str(args.model)
    result["mass_by_origin"] = mass_by_origin(result["mass"], result["origins"], layers)
    for layer, (masses, origins) in enumerate(zip(result["mass"], result["origins"])):
        print(f"layer {layer:2d} origins {origins}: " + " ".join(f"{m:.3f}" for m in masses))
    print("mass by origin:", result["mass_by_origin"])
    print("top:", ", ".join(f"L{t['layer']}h{t['kv_head']} (origin {t['origin']}) {t['mass']:.3f}" for t in result["top"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
