"""Tiny random-weight decoder models, built locally for tests (no model hub).

Six architectures are built, each small enough to load in a second:

- `tiny-llama`: LlamaForCausalLM, 2 layers, 4 query heads, 2 KV heads (GQA 2).
- `tiny-qwen`:  Qwen2ForCausalLM, 2 layers, 8 query heads, 2 KV heads (GQA 4),
  with q/k/v biases as Qwen2 has them.
- `tiny-gemma2`: Gemma2ForCausalLM, a sliding-window layer (window 16) then a
  global one, 4 query heads of 32, 2 KV heads, attention logits soft-capped
  at 2 (low enough to bite).
- `tiny-gemma3`: Gemma3ForCausalLM, two sliding-window layers (window 16)
  then a global one, 4 query heads of 32, 2 KV heads.
- `tiny-mistral`: MistralForCausalLM, 2 layers, each with a sliding window
  of 16, 4 query heads of 32, 2 KV heads.
- `tiny-gptoss`: GptOssForCausalLM, a sliding-window layer (window 16) then
  a global one, 4 experts (2 per token), 4 query heads of 32, 2 KV heads,
  learned attention sinks drawn large enough to matter.

Both use a word-level tokenizer (one token per whitespace-separated word) and
a chat template, so `/v1/completions` and `/v1/chat/completions` both work.
Weights are drawn with a large init scale so that greedy decoding has clear
logit margins: token-identical comparisons between backends then test the
attention math, not float rounding.

    vllm-chunked-kv build-test-models --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

NUM_WORDS = 250
SPECIALS = ["<pad>", "<unk>", "<bos>", "<eos>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} : {{ message['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}assistant : {% endif %}"
)

ARCHS: dict[str, dict] = {
    "tiny-llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", num_attention_heads=4,
        num_key_value_heads=2, hidden_size=128, intermediate_size=256,
    ),
    "tiny-qwen": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", num_attention_heads=8,
        num_key_value_heads=2, hidden_size=256, intermediate_size=384, use_sliding_window=False,
    ),
    "tiny-gemma2": dict(
        architectures=["Gemma2ForCausalLM"], model_type="gemma2", num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, hidden_size=128, intermediate_size=256,
        attn_logit_softcapping=2.0, final_logit_softcapping=None,
        layer_types=["sliding_attention", "full_attention"], sliding_window=16,
        embed_scale=128 ** -0.5,  # Gemma multiplies embeddings by sqrt(hidden)
    ),
    "tiny-gemma3": dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, hidden_size=128, intermediate_size=256,
        num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=16, embed_scale=128 ** -0.5,
    ),
    "tiny-mistral": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, hidden_size=128, intermediate_size=256, sliding_window=16,
    ),
    "tiny-gptoss": dict(  # vLLM gives even layers the window, whatever layer_types says: these agree
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, hidden_size=128, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"], sliding_window=16, tie_word_embeddings=False,
        sinks_std=2.0,
    ),
}


def vocabulary() -> list[str]:
    """Special tokens, chat-template words, then `w0 .. w{NUM_WORDS-1}`."""
    return SPECIALS + ["user", "assistant", "system", ":", "?", "."] + [f"w{i}" for i in range(NUM_WORDS)]


def save_word_tokenizer(path: Path, vocab: list[str], chat_template: str | None = CHAT_TEMPLATE) -> None:
    """Save a word-level fast tokenizer that prepends <bos>, loadable offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    ids = {word: i for i, word in enumerate(vocab)}
    tok = Tokenizer(models.WordLevel(vocab=ids, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", ids["<bos>"])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>"
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    # transformers 5 records its generic backend class name, which older
    # loaders (and vLLM's tokenizer probe) cannot resolve: name the fast class.
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2))


def build_model(name: str, path: str | Path, *, seed: int = 0, init_std: float = 0.25) -> Path:
    """Build (or reuse) the tiny model `name` under `path`; returns the directory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if (path / "model.safetensors").exists() and (path / "tokenizer.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    vocab = vocabulary()
    arch = dict(ARCHS[name])
    model_type = arch.pop("model_type")
    embed_scale = arch.pop("embed_scale", 1.0)
    sinks_std = arch.pop("sinks_std", None)
    settings = dict(
        vocab_size=len(vocab), num_hidden_layers=2, max_position_embeddings=4096, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=vocab.index("<bos>"), eos_token_id=vocab.index("<eos>"),
        pad_token_id=vocab.index("<pad>"), torch_dtype="float32", initializer_range=init_std,
    )
    config = AutoConfig.for_model(model_type, **{**settings, **arch})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, init_std)  # Qwen2 q/k/v biases: make them matter
        model.get_input_embeddings().weight.mul_(embed_scale)
        for name, param in model.named_parameters():
            if sinks_std is not None and name.endswith(".sinks"):  # GPT-OSS's learned sink logits [H]
                param.normal_(0.0, sinks_std)
    model.save_pretrained(str(path))
    save_word_tokenizer(path, vocab)
    return path


def build_tiny_llama(path: str | Path) -> Path:
    return build_model("tiny-llama", path)


def build_tiny_qwen(path: str | Path) -> Path:
    return build_model("tiny-qwen", path, seed=1)


def build_tiny_gemma2(path: str | Path) -> Path:
    return build_model("tiny-gemma2", path, seed=2)


def build_tiny_gemma3(path: str | Path) -> Path:
    return build_model("tiny-gemma3", path, seed=4)


def build_tiny_mistral(path: str | Path) -> Path:
    return build_model("tiny-mistral", path, seed=5)


def build_tiny_gptoss(path: str | Path) -> Path:
    return build_model("tiny-gptoss", path, seed=3)


def random_prompt(rng, num_words: int) -> str:
    """A prompt of `num_words` random vocabulary words (one token each)."""
    return " ".join(f"w{rng.randrange(NUM_WORDS)}" for _ in range(num_words))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/test-models", help="directory to build the models under")


def run(args: argparse.Namespace) -> int:
    for name in ARCHS:
        print(build_model(name, Path(args.out) / name))
    return 0
