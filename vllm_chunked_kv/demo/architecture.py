"""The demo model's architecture: a tiny Llama (RoPE, grouped-query attention).

2 layers, hidden 128, 4 query heads of 32, 2 KV heads, MLP 512, tied
embeddings over the 256-word task vocabulary: about 0.5M parameters, 2 MB in
fp32. vLLM serves it with any attention backend (head size 32 is accepted by
the CPU backend).
"""

from __future__ import annotations

from vllm_chunked_kv.demo.tokenizer import special_token_ids
from vllm_chunked_kv.tasks.kv_retrieval import VOCAB

MAX_POSITIONS = 1024


def demo_config():
    """The `LlamaConfig` of the demo model."""
    from transformers import LlamaConfig

    ids = special_token_ids()
    return LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        torch_dtype="float32",
    )


def build_model(seed: int):
    """A freshly initialised demo model; its weights depend only on `seed`."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(demo_config())
    model.config.use_cache = False
    return model
