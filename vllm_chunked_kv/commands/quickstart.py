"""Serve a local model with `--attention-backend chunked_kv` and ask it one question.

Uses the shipped demo model when it is installed (it answers a key-value
lookup correctly), otherwise builds the tiny random-weight test model. The
server is a real `vllm serve` subprocess on 127.0.0.1, stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path


def demo_model_dir() -> Path | None:
    path = Path(__file__).parent / "demo" / "model"
    return path if (path / "config.json").exists() else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: the shipped demo model, else a tiny test model)")
    parser.add_argument("--chunked-kv", default='{"chunk_size": 4, "window": 32}',
                        help="JSON for --additional-config's chunked_kv entry")


def run(args: argparse.Namespace) -> int:
    from vllm_chunked_kv.runner.server import VllmServer

    model = Path(args.model) if args.model else demo_model_dir()
    if model is None:
        from vllm_chunked_kv.models.tiny import build_tiny_llama

        model = build_tiny_llama(Path("runs") / "tiny-llama")
    question, expected = _question(model)
    extra = ["--attention-backend", "chunked_kv", "--additional-config", json.dumps({"chunked_kv": json.loads(args.chunked_kv)})]
    print(f"starting: vllm serve {model} {' '.join(extra)}", file=sys.stderr)
    with VllmServer(model, extra) as server:
        print(f"server up at {server.base_url} (log: {server.log_path})", file=sys.stderr)
        client = server.openai_client()
        name = client.models.list().data[0].id
        if expected is None:  # a chat completion, as any chat client would send
            reply = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": question}], max_tokens=1, temperature=0
            )
            answer = reply.choices[0].message.content.strip()
        else:  # the demo model reads raw task text: a plain completion
            reply = client.completions.create(model=name, prompt=question, max_tokens=1, temperature=0)
            answer = reply.choices[0].text.strip()
        used = "Using CHUNKED_KV attention backend" in server.log()
    print(f"question: {question[:80]}{' ...' if len(question) > 80 else ''}")
    print(f"answer:   {answer}" + (f"   (expected {expected})" if expected else ""))
    print(f"backend:  {'CHUNKED_KV' if used else 'NOT CHUNKED_KV (check the server log)'}")
    return 0 if used else 1


def _question(model: Path) -> tuple[str, str | None]:
    """A key-value lookup for the demo model; a few words for a test model."""
    if (model / "config.json").exists() and demo_model_dir() == model:
        from vllm_chunked_kv.tasks.kv_retrieval import make_prompt

        prompt = make_prompt(random.Random(0))
        return prompt.text, prompt.answer
    return "w1 w2 w3", None
