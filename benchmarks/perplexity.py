"""Perplexity on held-out English text through vLLM: the default backend
against CHUNKED_KV under every mitigation, from one run.

The text is `tasks.english_text.held_out_text()` (Python standard-library
docstrings that training never sees; it depends on the Python version, which
the JSON records), tokenized with the model's tokenizer and cut into
`--num-docs` consecutive documents of `--max-tokens-per-doc` tokens (plus
the tokenizer's own start tokens, if it adds any). Each document is one
prompt scored with ``SamplingParams(max_tokens=1, prompt_logprobs=0)``: the
log-probability vLLM gives every actual next token. Perplexity is
exp(mean NLL) over all scored tokens, and also over the tokens whose query
position is at least ``sink_tokens + window + chunk_size`` ("beyond
window"): every such query attends to compressed rows, so that column is
where compression acts. Ratios are a mode's perplexity over the default
backend's.

`--kv-cache-dtype fp8` stores every mode's KV cache in FP8 pages.

Each mode runs in a fresh in-process engine in its own interpreter
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, eager, no prefix caching).

    python benchmarks/perplexity.py --model /tmp/smollm2-135m --json benchmarks/results/perplexity_smollm2.json

Without `--model` it measures the directory `vllm-chunked-kv models fetch
smollm2-135m` made.

`perplexity(model_dir, chunked_kv)` computes one mode and is importable;
mode ``served`` uses the settings of the model directory's
`chunked_kv_serve.json` (how an adapted model is meant to be served).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from vllm_chunked_kv.demo.modes import MITIGATION_MODES
from vllm_chunked_kv.core.serve_file import SERVE_FILE, read_serve_config, serve_settings
from vllm_chunked_kv.runner.engine import worker_or_main

DEFAULT_SETTINGS = {"chunk_size": 4, "window": 128, "sink_tokens": 4}
# Mode -> settings over DEFAULT_SETTINGS (None: vLLM's default backend).
MODES: dict[str, dict | None] = {
    "default": None,
    **MITIGATION_MODES,
    "key_norm": {"mitigation": "none", "pooling": "key_norm"},
    "served": None,  # replaced by the model directory's chunked_kv_serve.json
}
DEFAULT_MODES = [m for m in MODES if m != "served"]
ENGINE_DEFAULTS = dict(enforce_eager=True, enable_prefix_caching=False, max_num_batched_tokens=2048,
                       kv_cache_memory_bytes=1 << 30, seed=0)


def fetched_model(name: str = "smollm2-135m") -> str | None:
    """The directory `vllm-chunked-kv models fetch NAME` made, if there is one."""
    try:
        from vllm_chunked_kv.models.cache import is_complete, model_dir
    except ImportError:
        return None
    path = model_dir(name)
    return str(path) if is_complete(path) else None


def served_settings(model_dir: str | Path) -> dict:
    """The chunked_kv settings a model directory's `chunked_kv_serve.json` asks for."""
    path = Path(model_dir) / SERVE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"mode 'served' needs {path}")
    return serve_settings(read_serve_config(model_dir))


def mode_settings(mode: str, model_dir: str | Path, base: dict | None = None) -> dict | None:
    """The chunked_kv settings of `mode` (None for the default backend)."""
    if mode == "served":
        return served_settings(model_dir)
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (known: {', '.join(MODES)})")
    extra = MODES[mode]
    return None if extra is None else {**(base or DEFAULT_SETTINGS), **extra}


def beyond_position(settings: dict | None) -> int:
    """First query position counted as "beyond window": sinks + window + chunk_size."""
    from vllm_chunked_kv.core.config import ChunkedKVConfig

    cfg = ChunkedKVConfig(**(settings or DEFAULT_SETTINGS))
    return cfg.sink_tokens + cfg.window + cfg.chunk_size


def held_out_documents(model_dir: str | Path, num_docs: int = 4, tokens_per_doc: int = 2048) -> list[list[int]]:
    """`num_docs` consecutive pieces of the held-out text, `tokens_per_doc` tokens each,
    each led by the tokens the tokenizer adds itself (none for SmolLM2, <bos> for Llama 3)."""
    from transformers import AutoTokenizer

    from vllm_chunked_kv.tasks.english_text import held_out_text

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    lead = tokenizer("", add_special_tokens=True).input_ids
    needed, min_chars = num_docs * tokens_per_doc, 4 * num_docs * tokens_per_doc
    while True:
        text = held_out_text(min_chars)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) >= needed:
            break
        if len(text) < min_chars:
            raise ValueError(f"the held-out text has {len(ids)} tokens, fewer than {needed}")
        min_chars *= 2
    return [lead + ids[i * tokens_per_doc:(i + 1) * tokens_per_doc] for i in range(num_docs)]


POSITION_BUCKETS = (0, 256, 512, 1024, 2048)  # query positions: how perplexity grows with what lies behind


def by_position(logprobs: list[list[float]], edges: tuple[int, ...] = POSITION_BUCKETS) -> dict[str, float]:
    """Perplexity of the tokens predicted at query positions in [edges[i], edges[i+1])
    (the last bucket open-ended), keyed "lo-hi"; empty buckets are left out."""
    out = {}
    for i, lo in enumerate(edges):
        hi = edges[i + 1] if i + 1 < len(edges) else None
        nll = [-lp for doc in logprobs for t, lp in enumerate(doc) if t >= lo and (hi is None or t < hi)]
        if nll:
            out[f"{lo}-{hi if hi is not None else ''}"] = math.exp(sum(nll) / len(nll))
    return out


REPEAT_NGRAM = 4  # a token "repeats" when it ends an n-gram of this many tokens seen earlier in its document


def repeat_kind(doc: list[int], window: int, n: int = REPEAT_NGRAM) -> list[str]:
    """For each scored token `doc[t + 1]` (predicted at query position t): "far" if the
    n-gram it ends, `doc[t + 2 - n : t + 2]`, occurred earlier in the document and its
    latest earlier occurrence starts more than `window` positions before the query
    (only pooled rows can show it), "near" if it occurred within them (the raw window
    reads it exactly), else "new". Copying text seen before is where full attention
    gains most from context and where pooling hides exact tokens."""
    last_start: dict[tuple[int, ...], int] = {}  # n-gram -> start of its latest occurrence so far
    kinds = []
    for t in range(len(doc) - 1):
        end = t + 2  # the n-gram doc[end - n : end] ends at the scored token
        gram = tuple(doc[end - n:end]) if end >= n else None
        seen = last_start.get(gram) if gram is not None else None
        kinds.append("new" if seen is None else "far" if t - seen > window else "near")
        if gram is not None:
            last_start[gram] = end - n
    return kinds


def by_repeat(documents: list[list[int]], logprobs: list[list[float]], window: int) -> dict[str, dict]:
    """Perplexity and token count of each `repeat_kind`, over all documents."""
    nll: dict[str, list[float]] = {"new": [], "near": [], "far": []}
    for doc, lps in zip(documents, logprobs):
        for kind, lp in zip(repeat_kind(doc, window), lps):
            nll[kind].append(-lp)
    return {k: {"ppl": math.exp(sum(v) / len(v)), "tokens": len(v), "nll_sum": sum(v)} for k, v in nll.items() if v}


def summarise(documents: list[list[int]], logprobs: list[list[float]], beyond: int,
              window: int = DEFAULT_SETTINGS["window"]) -> dict:
    """NLL and perplexity overall, beyond the window and by query position, from the
    next-token log-probs (`logprobs[d][t]` scores `documents[d][t + 1]`, predicted at
    query position t)."""
    nll = [-lp for doc in logprobs for lp in doc]
    far = [-lp for doc in logprobs for t, lp in enumerate(doc) if t >= beyond]
    mean = sum(nll) / len(nll)
    far_mean = sum(far) / len(far) if far else float("nan")
    return {"nll": mean, "ppl": math.exp(mean), "tokens": len(nll),
            "nll_beyond": far_mean, "ppl_beyond": math.exp(far_mean), "tokens_beyond": len(far),
            "beyond_position": beyond, "ppl_by_position": by_position(logprobs),
            "per_doc_nll": [-sum(doc) / len(doc) for doc in logprobs],
            "ppl_by_repeat": by_repeat(documents, logprobs, window)}


def perplexity(model_dir: str | Path, chunked_kv: dict | None, *, documents: list[list[int]] | None = None,
               num_docs: int = 4, tokens_per_doc: int = 2048, dtype: str = "bfloat16", beyond: int | None = None,
               engine: dict | None = None, threads: int | None = None, timeout: float = 3600,
               window: int | None = None) -> dict:
    """Perplexity of `model_dir` served by vLLM's default backend (`chunked_kv` None)
    or by CHUNKED_KV with the settings `chunked_kv`, on `documents` (token-id
    prompts; default: `held_out_documents`). `beyond` defaults to
    `beyond_position(chunked_kv)` and `window` (of the repeat split, `by_repeat`) to
    the settings' window. Runs one engine in a fresh interpreter."""
    documents = documents if documents is not None else held_out_documents(model_dir, num_docs, tokens_per_doc)
    kwargs = {**ENGINE_DEFAULTS, "dtype": dtype, "max_model_len": max(map(len, documents)) + 8, **(engine or {})}
    if chunked_kv is not None:
        kwargs.update(attention_backend="chunked_kv", additional_config={"chunked_kv": chunked_kv})
    spec = {"model": str(model_dir), "engine": kwargs, "documents": documents}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker"], input=json.dumps(spec),
                          capture_output=True, text=True, env=env, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"logprobs"')]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"perplexity worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    logprobs = json.loads(lines[-1])["logprobs"]
    window = window if window is not None else (chunked_kv or DEFAULT_SETTINGS).get("window", DEFAULT_SETTINGS["window"])
    result = summarise(documents, logprobs, beyond if beyond is not None else beyond_position(chunked_kv), window)
    return {**result, "settings": chunked_kv, "seconds": time.perf_counter() - start}


def worker(spec: dict) -> dict:
    """Runs in a fresh interpreter: the log-prob of every actual next token of each document."""
    from vllm import LLM, SamplingParams

    llm = LLM(spec["model"], **spec["engine"])
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    documents = spec["documents"]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in documents], params, use_tqdm=False)
    logprobs = []
    for ids, out in zip(documents, outputs):
        scored = out.prompt_logprobs  # [None, {token: Logprob}, ...], one entry per prompt position
        logprobs.append([scored[p][ids[p]].logprob for p in range(1, len(ids))])
    return {"logprobs": logprobs}


def format_table(rows: list[dict]) -> str:
    lines = ["| mode | ppl | ppl beyond window | ratio to default | ratio beyond window | tokens scored (beyond) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ratio = f"{r['ppl_ratio']:.3f}" if "ppl_ratio" in r else "-"
        far_ratio = f"{r['ppl_beyond_ratio']:.3f}" if "ppl_beyond_ratio" in r else "-"
        lines.append(f"| {r['mode']} | {r['ppl']:.3f} | {r['ppl_beyond']:.3f} | {ratio} | {far_ratio} "
                     f"| {r['tokens']:,} ({r['tokens_beyond']:,}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=fetched_model(),
                        help="model directory (default: the one `vllm-chunked-kv models fetch smollm2-135m` made)")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help="comma-separated subset of: " + ", ".join(MODES))
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_SETTINGS["chunk_size"])
    parser.add_argument("--window", type=int, default=DEFAULT_SETTINGS["window"])
    parser.add_argument("--sinks", type=int, default=DEFAULT_SETTINGS["sink_tokens"])
    parser.add_argument("--num-docs", type=int, default=4)
    parser.add_argument("--max-tokens-per-doc", type=int, default=2048, help="text tokens per document")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="vLLM's --kv-cache-dtype for every mode (fp8, fp8_e4m3, fp8_e5m2: FP8 pages)")
    parser.add_argument("--threads", type=int, default=0, help="OMP threads per engine (0: vLLM's choice)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.model is None:
        parser.error("--model is required (no fetched smollm2-135m found)")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    base = {"chunk_size": args.chunk_size, "window": args.window, "sink_tokens": args.sinks}
    settings = {mode: mode_settings(mode, args.model, base) for mode in modes}  # fail fast on a bad mode
    beyond = beyond_position(base)
    documents = held_out_documents(args.model, args.num_docs, args.max_tokens_per_doc)

    rows = []
    for mode in modes:
        row = {"mode": mode, "kv_cache_dtype": args.kv_cache_dtype,
               **perplexity(args.model, settings[mode], documents=documents, dtype=args.dtype, beyond=beyond,
                            threads=args.threads or None, window=args.window,
                            engine={"kv_cache_dtype": args.kv_cache_dtype})}
        rows.append(row)
        print(f"{mode}: ppl {row['ppl']:.3f}, beyond window {row['ppl_beyond']:.3f} ({row['seconds']:.0f} s)",
              file=sys.stderr, flush=True)
    reference = next((r for r in rows if r["mode"] == "default"), None)
    if reference is not None:
        for r in rows:
            r["ppl_ratio"] = r["ppl"] / reference["ppl"]
            r["ppl_beyond_ratio"] = r["ppl_beyond"] / reference["ppl_beyond"]
    print(f"model={args.model} dtype={args.dtype} kv_cache_dtype={args.kv_cache_dtype} documents={len(documents)}x{args.max_tokens_per_doc} tokens "
          f"chunked_kv={json.dumps(base)} beyond: query position >= {beyond} python={platform.python_version()}")
    print(format_table(rows))
    report = {"args": {**vars(args), "json": str(args.json) if args.json else None},
              "python_version": platform.python_version(), "documents": len(documents),
              "document_tokens": [len(d) for d in documents], "beyond_position": beyond, "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    worker_or_main(worker, main)
