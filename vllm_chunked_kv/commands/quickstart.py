"""`vllm-chunked-kv quickstart`: serve the shipped demo model with
`--attention-backend chunked_kv` and ask it one question whose answer is known.

The demo model (0.5M parameters, trained on the key-value lookup of
`tasks/kv_retrieval.py`) ships inside the package, so it is found wherever
the package is installed (`vllm_chunked_kv.demo.DEFAULT_MODEL_DIR`); an
install without it is an error, never a silent stand-in.

The question is one short lookup: a 51-token prompt (with `<bos>`) that ends
`? k68`, whose record `k68 v30` sits at positions 9-10. With the demo's
settings (chunk 4, window 32, 4 sinks) the last prompt token (position 50)
reads the sinks and positions 16-50 raw, and positions 4-15 as three pooled
rows: the answer comes from the row of chunk [8, 12). The README's first code block sends the same
prompt with `curl`. One prompt shows the product working, not its accuracy:
`vllm-chunked-kv demo` measures that over thousands of needles.

Prints the question, the answer next to the expected one, and whether the
server's log shows CHUNKED_KV running. Exit status 0 only when the answer is
the expected one and CHUNKED_KV ran. With `--model DIR` (another model) it
asks a chat question with no known answer, and only the backend is checked.

The server is a real `vllm serve` subprocess on 127.0.0.1, stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

# The demo's chunked settings (vllm-chunked-kv demo): chunk 4, window 32, 4 sinks.
DEMO_SETTINGS = {"chunk_size": 4, "window": 32, "sink_tokens": 4}
# The lookup asked of the demo model: seed, haystack length, records, the value's position.
QUESTION_SPEC = {"seed": 9, "haystack_len": 48, "num_records": 10, "target_position": 10}
CHAT_QUESTION = "Name one colour."  # for a model other than the demo model: no known answer
BACKEND_LOG_LINE = "Using CHUNKED_KV attention backend"


def demo_question() -> tuple[str, str]:
    """The prompt sent to the demo model and its correct answer (e.g. 'v30')."""
    from vllm_chunked_kv.tasks.kv_retrieval import make_prompt

    spec = dict(QUESTION_SPEC)
    prompt = make_prompt(random.Random(spec.pop("seed")), **spec)
    return prompt.text, prompt.answer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: the shipped demo model, which has a known answer)")
    parser.add_argument("--chunked-kv", default=json.dumps(DEMO_SETTINGS),
                        help="JSON for --additional-config's chunked_kv entry (default: the demo's settings)")


def run(args: argparse.Namespace) -> int:
    from vllm_chunked_kv.demo import shipped_model
    from vllm_chunked_kv.runner import companions
    from vllm_chunked_kv.runner.server import VllmServer

    problem = companions.problem()
    if problem is not None:  # `vllm serve` would die on import with a traceback: say why instead
        print(f"error: {problem}", file=sys.stderr)
        return 1
    try:
        demo = shipped_model()
    except FileNotFoundError as exc:  # an install without the package data: say so, start nothing
        print(f"error: {exc}", file=sys.stderr)
        return 1
    model = Path(args.model) if args.model else demo
    is_demo = model.resolve() == demo.resolve()
    question, expected = demo_question() if is_demo else (CHAT_QUESTION, None)
    extra = ["--attention-backend", "chunked_kv", "--additional-config",
             json.dumps({"chunked_kv": json.loads(args.chunked_kv)})]
    print(f"starting: vllm serve {model} {' '.join(extra)}", file=sys.stderr)
    with VllmServer(model, extra) as server:
        print(f"server up at {server.base_url} (log: {server.log_path})", file=sys.stderr)
        client = server.openai_client()
        name = client.models.list().data[0].id
        if is_demo:  # the demo model reads raw task text: a plain completion, one token
            reply = client.completions.create(model=name, prompt=question, max_tokens=1, temperature=0)
            answer = reply.choices[0].text.strip()
        else:  # a chat completion, as any chat client would send
            reply = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": question}], max_tokens=16, temperature=0
            )
            answer = (reply.choices[0].message.content or "").strip()
        used = BACKEND_LOG_LINE in server.log()
    print(f"question: {question}")
    print(f"answer:   {answer}" + (f"   (expected {expected})" if expected else ""))
    print(f"backend:  {'CHUNKED_KV' if used else 'NOT CHUNKED_KV (check the server log)'}")
    if expected is not None and answer != expected:
        print(f"error: the demo model answered {answer!r}, expected {expected!r}", file=sys.stderr)
        return 1
    if not used:
        print(f"error: the server log has no {BACKEND_LOG_LINE!r} line", file=sys.stderr)
        return 1
    return 0
