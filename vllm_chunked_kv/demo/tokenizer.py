"""The demo model's word-level tokenizer: one token per word of the task vocabulary.

Built with `tokenizers` (WordLevel model, whitespace pre-tokenizer, a
post-processor that puts `<bos>` in front) and saved as a
`PreTrainedTokenizerFast`, so vLLM and transformers load it offline from the
model directory. transformers 5 records its own class name
(`TokenizersBackend`) in tokenizer_config.json; the saved file names
`PreTrainedTokenizerFast`, which every transformers version resolves.

The chat template writes `<bos>` and then the messages' contents joined
with spaces (chat requests are tokenized without special tokens), so a user
message holding a task prompt gives exactly the tokens of the completion
prompt and `/v1/chat/completions` works on the demo model.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_chunked_kv.tasks.kv_retrieval import VOCAB

BOS, EOS, PAD, UNK = "<bos>", "<eos>", "<pad>", "<unk>"
CHAT_TEMPLATE = (
    "{{ bos_token }} "
    "{% for message in messages %}"
    "{% if not loop.first %} {% endif %}{{ message['content'] }}"
    "{% endfor %}"
)


def build_tokenizer():
    """A `PreTrainedTokenizerFast` over `VOCAB` (word i has id i)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        add_bos_token=True,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tokenizer(out_dir: str | Path) -> None:
    """Write tokenizer.json, tokenizer_config.json (class PreTrainedTokenizerFast) and the chat template."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save_pretrained(out_dir)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def special_token_ids() -> dict[str, int]:
    """Ids of the special tokens, for the model config."""
    return {name: VOCAB.index(tok) for name, tok in [("bos", BOS), ("eos", EOS), ("pad", PAD)]}
