"""A byte-level tokenizer and a tiny random Llama over bytes, for fast adapt tests."""

from __future__ import annotations

import pytest
import torch


class ByteTokenizer:
    """encode/decode UTF-8 bytes as token ids 0..255 (what `adapt` needs of a tokenizer)."""

    bos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.fixture
def byte_tokenizer():
    return ByteTokenizer()


def tiny_byte_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, use_cache=False, initializer_range=0.2)
    return LlamaForCausalLM(cfg).float()
