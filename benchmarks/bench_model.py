"""A random-weight Llama for the benchmarks, built locally (no model hub).

Larger than the test models and with a 32k position range, so that long
contexts fit and attention is a visible part of a step:

    path = build_bench_model(Path("runs/bench-llama"), layers=4, hidden=512)
"""

from __future__ import annotations

from pathlib import Path

from vllm_chunked_kv.models.tiny import save_word_tokenizer, vocabulary


def build_bench_model(path: Path, *, layers: int = 4, hidden: int = 512, heads: int = 8, kv_heads: int = 2,
                      max_positions: int = 32768) -> Path:
    """Build (or reuse) the benchmark model under `path`; returns the directory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (path / "model.safetensors").exists() and (path / "tokenizer.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    vocab = vocabulary()
    config = AutoConfig.for_model(
        "llama", vocab_size=len(vocab), num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=vocab.index("<bos>"),
        eos_token_id=vocab.index("<eos>"), pad_token_id=vocab.index("<pad>"), torch_dtype="float32",
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(path))
    save_word_tokenizer(path, vocab)
    return path
