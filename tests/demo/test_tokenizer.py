"""Contract of the demo tokenizer, as saved to disk and loaded back by transformers.

- every vocabulary word is exactly one token, with id = its index in VOCAB;
- encoding puts <bos> in front; decoding (skipping specials) gives the text back;
- tokenizer_config.json names PreTrainedTokenizerFast (not transformers 5's
  TokenizersBackend), so older and newer loaders agree;
- the chat template turns one user message into the same tokens as the plain prompt.
"""

from __future__ import annotations

import json
import random

import pytest

from vllm_chunked_kv.demo.tokenizer import save_tokenizer
from vllm_chunked_kv.tasks.kv_retrieval import VOCAB, make_prompt


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(saved):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(saved)


def test_one_token_per_word(tokenizer):
    words = [w for w in VOCAB if not w.startswith("<")]
    ids = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]
    assert ids == [VOCAB.index(w) for w in words]


def test_bos_in_front_and_round_trip(tokenizer):
    prompt = make_prompt(random.Random(0))
    ids = tokenizer(prompt.text)["input_ids"]
    assert ids[0] == VOCAB.index("<bos>") == tokenizer.bos_token_id
    assert len(ids) == prompt.num_tokens
    assert ids[prompt.target_position] == VOCAB.index(prompt.answer)
    assert tokenizer.decode(ids, skip_special_tokens=True) == prompt.text


def test_unknown_word_is_unk(tokenizer):
    assert tokenizer("k1 zebra", add_special_tokens=False)["input_ids"] == [VOCAB.index("k1"), VOCAB.index("<unk>")]


def test_config_names_fast_tokenizer(saved):
    config = json.loads((saved / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["bos_token"] == "<bos>" and config["eos_token"] == "<eos>"


def test_chat_template_gives_prompt_tokens(tokenizer):
    prompt = make_prompt(random.Random(1))
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt.text}], tokenize=True, add_generation_prompt=True
    )
    chat_ids = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
    assert list(chat_ids) == tokenizer(prompt.text)["input_ids"]
