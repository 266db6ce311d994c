"""The prompts of the real-model tests: chat questions and plain-text
completions cut from standard-library docstrings, as token ids.

    rounds, where = make_rounds(tokenizer)   # [16 fresh prompts, 4 that hit the prefix cache], name -> (round, index)

Round 1 holds 5 chat prompts (the model's chat template applied, one of them
"What is the capital of France?") and 11 completions of 20 to 700 tokens,
mostly short: vLLM on 2 CPU cores runs all of them three times.
Round 2 repeats two round-1 prompts word for word and extends two others,
so each of its prompts starts with a prefix the cache already holds.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import logging
import pathlib
import shutil
import subprocess
import tarfile
import textwrap
import threading
import unittest
import zipfile

CAPITAL_QUESTION = "What is the capital of France?"
COMPLETION_LENGTHS = (20, 24, 30, 40, 50, 64, 80, 100, 128, 200, 700)  # tokens
MAX_PROMPT_TOKENS = 750


def docstring_text() -> str:
    """Ordinary English prose: docstrings of a few standard-library modules and their members."""
    docs = []
    for module in (argparse, collections, json, logging, pathlib, shutil, subprocess, tarfile, textwrap,
                   threading, unittest, zipfile):
        docs.append(inspect.getdoc(module) or "")
        for _, member in inspect.getmembers(module, lambda m: inspect.isclass(m) or inspect.isfunction(m)):
            doc = inspect.getdoc(member)
            if doc and len(doc) > 200 and ">>>" not in doc:
                docs.append(doc)
    return "\n\n".join(dict.fromkeys(docs))  # each docstring once, in order


def chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def make_rounds(tokenizer) -> tuple[list[list[list[int]]], dict[str, tuple[int, int]]]:
    """The two rounds of prompts, and where the named ones are: name -> (round, index)."""
    corpus = tokenizer(docstring_text(), add_special_tokens=False)["input_ids"]
    assert len(corpus) >= 13000, f"only {len(corpus)} tokens of docstrings"
    passage = lambda start, n: tokenizer.decode(corpus[start:start + n])  # noqa: E731
    questions = [
        CAPITAL_QUESTION,
        "Write a haiku about the sea.",
        "Explain in two sentences what a hash table is.",
        "Summarize the following documentation in one sentence.\n\n" + passage(10000, 150),
        "What does the following text describe?\n\n" + passage(11000, 60),
    ]
    chats = [chat_ids(tokenizer, q) for q in questions]
    completions = [corpus[i * 900:i * 900 + n] for i, n in enumerate(COMPLETION_LENGTHS)]
    first = chats + completions
    second = [first[3], first[-2], first[-3] + corpus[12000:12040], first[4][:-2] + corpus[12500:12530]]
    where = {"capital": (0, 0), "long": (0, len(first) - 1), "repeat": (1, 1), "repeated": (0, len(first) - 2)}
    for prompt in first + second:
        assert 20 <= len(prompt) <= MAX_PROMPT_TOKENS, len(prompt)
    return [first, second], where


if __name__ == "__main__":  # print the prompts' lengths for a model directory
    import sys

    from transformers import AutoTokenizer

    rounds, _ = make_rounds(AutoTokenizer.from_pretrained(sys.argv[1]))
    print(json.dumps([[len(p) for p in prompts] for prompts in rounds]))
