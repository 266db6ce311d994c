"""The shipped demo model served by vLLM (default CPU attention backend, offline).

- vLLM loads `vllm_chunked_kv/demo/model` with its tokenizer, from disk only;
- its greedy next word (max_tokens=1, temperature 0) is the right value for
  held-out retrieval prompts, and agrees with transformers' greedy answer;
- a chat request holding the prompt as one user message gets the same answer
  (the chat template reproduces the prompt's tokens).

vLLM runs in a child interpreter (its global state stays out of the test
process), in-process engine, eager mode.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from vllm_chunked_kv.demo.evaluate import DEFAULT_MODEL_DIR, load_model, predict
from vllm_chunked_kv.tasks.kv_retrieval import is_correct, make_prompt

pytestmark = pytest.mark.engine

NUM_PROMPTS = 16

_RUNNER = r"""
import json, sys
from vllm import LLM, SamplingParams
spec = json.loads(sys.stdin.read())
llm = LLM(spec["model"], enforce_eager=True, dtype="float32", max_model_len=512,
          kv_cache_memory_bytes=64 << 20, seed=0)
params = SamplingParams(temperature=0.0, max_tokens=1)
plain = llm.generate(spec["prompts"], params, use_tqdm=False)
chat = llm.chat([[{"role": "user", "content": p}] for p in spec["prompts"]], params, use_tqdm=False)
print(json.dumps({
    "text": [r.outputs[0].text for r in plain],
    "prompt_ids": [list(r.prompt_token_ids) for r in plain],
    "chat_text": [r.outputs[0].text for r in chat],
    "chat_prompt_ids": [list(r.prompt_token_ids) for r in chat],
}), flush=True)
"""


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random("vllm-test")
    return [make_prompt(rng) for _ in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def served(prompts):
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    spec = {"model": str(DEFAULT_MODEL_DIR), "prompts": [p.text for p in prompts]}
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER], input=json.dumps(spec), capture_output=True, text=True, env=env, timeout=600
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1])


def test_vllm_tokenizes_like_the_task(served, prompts):
    for ids, prompt in zip(served["prompt_ids"], prompts):
        assert len(ids) == prompt.num_tokens
    assert served["chat_prompt_ids"] == served["prompt_ids"]


def test_vllm_answers_held_out_prompts(served, prompts):
    correct = sum(is_correct(text, p.answer) for text, p in zip(served["text"], prompts))
    assert correct >= NUM_PROMPTS - 1, served["text"]


def test_vllm_agrees_with_transformers(served, prompts):
    import torch

    torch.set_num_threads(1)
    expected = predict(load_model(), prompts)
    assert [t.strip() for t in served["text"]] == expected
    assert [t.strip() for t in served["chat_text"]] == expected
