"""SmolLM2-135M, fetched for real, served by vLLM (CPU, in-process engine, in
bf16 where the CPU computes it natively, else fp32: `engine.SERVE_DTYPE`):

- the fetched directory is a plain bf16 Llama checkpoint with a loadable
  tokenizer and a README; fetching it again is instant (pip is not run);
- with the default backend the model answers "What is the capital of
  France?" with Paris;
- CHUNKED_KV in two configurations that keep every token's key exact
  (chunk 1 / window 1, and chunk 4 with a window longer than every prompt)
  gives the default backend's greedy tokens on 20 prompts (5 chats, 11
  completions of 20-700 tokens, 4 prefix-cache hits; chunked prefill in
  256-token pieces). In bf16 two tokens' logits are often exactly equal
  or one rounding step apart, and different (correct) attention arithmetic
  may break such a tie the other way; so a prompt passes when its tokens
  are equal up to a step where the default's best two tokens are within
  TIE_GAP and the chunked run took the second of them, with the default
  token's logprob within LOGPROB_TOL in both runs at every step up to there
  (at the split itself the chunked run's own top-2 may instead be within
  TIE_GAP: a near tie of three tokens, seen on an AVX2-only CPU),
  and at least half the prompts must be equal throughout;
- prefix-cache hits are counted by vLLM (num_cached_tokens) with the default
  backend and with chunk 4 / window 1024 (chunk 1 / window 1 reports none:
  its raw-page group, a 1-token sliding window, never keeps a page for a
  hit to find), and the 700-token prompt was split by the scheduler;
- at the same KV memory, vLLM's own KV capacity with chunk 4 / window 128 for
  8192-token requests is at least 0.9 of the theoretical gain over the
  default backend (8192 tokens over 8192/4 pooled rows, the raw window and
  the raw tails a step keeps for later prefix hits) and at most the
  compression ratio (4x). (At 1024 tokens the raw
  pages, about two windows per request, weigh more: 1.9x measured.)

Needs the network (or $CHUNKED_KV_CACHE holding the model) and a few
minutes of 2 CPU cores: four engine start-ups, three of them running the
prompts.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from vllm_chunked_kv.core import layout
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.backend.raw_cache import kept_tail_rows
from vllm_chunked_kv.serving.kv_footprint import footprint, uncompressed_bytes_per_token

from .engine import run
from .prompts import CAPITAL_QUESTION, make_rounds

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.download, pytest.mark.timeout(5400)]

MAX_MODEL_LEN = 1024
STEP_TOKENS = 256  # max_num_batched_tokens: the 700-token prompt takes 3+ steps
BLOCK = 32
MAX_TOKENS = 8
ENGINE = dict(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=STEP_TOKENS, block_size=BLOCK,
              enable_prefix_caching=True, kv_cache_memory_bytes=256 << 20)
EXACT = {  # chunked configurations that must equal full attention
    "chunk 1, window 1": {"chunk_size": 1, "window": 1},
    "chunk 4, window 1024": {"chunk_size": 4, "window": 1024},
}
COMPRESSED = {"chunk_size": 4, "window": 128}  # for the capacity figure
CAPACITY_LEN = 8192  # the model's context: capacity for full-length requests
TIE_GAP = 0.25  # logprob: two bf16 rounding steps (0.125 each) of a logit between 16 and 32
LOGPROB_TOL = 0.3  # seen up to 0.15 between the two backends at a tie


def chunked(settings: dict) -> dict:
    return {**ENGINE, "attention_backend": "CHUNKED_KV", "additional_config": {"chunked_kv": settings}}


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return make_rounds(tokenizer)


@pytest.fixture(scope="module")
def runs(smollm2_dir, prompts):
    rounds, _ = prompts
    results = {"default": run(smollm2_dir, ENGINE, rounds, MAX_TOKENS)}
    for name, settings in EXACT.items():
        results[name] = run(smollm2_dir, chunked(settings), rounds, MAX_TOKENS)
    for name, result in results.items():
        print(f"{name}: rounds took {result['round_seconds']} s; round-2 cached tokens {result['cached'][1]}")
    return results


def test_fetched_directory(smollm2_dir, models_cache, tmp_path):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["num_key_value_heads"],
            config["head_dim"], config["dtype"]) == ("llama", 30, 3, 64, "bfloat16")
    assert "quantization_config" not in config
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)  # as the GGUF has it: no BOS added (the adapter
    assert tokenizer("Hello").input_ids[:1] != [tokenizer.bos_token_id]  # was trained so)
    readme = (smollm2_dir / "README.md").read_text()
    assert "Apache-2.0" in readme and "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70" in readme
    # Cached: no pip (an index with nothing would fail it), no torch import, the directory last on stdout.
    (tmp_path / "empty").mkdir()
    probe = ("import sys; from vllm_chunked_kv.commands.main import main; code = main(sys.argv[1:]); "
             "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", probe, "models", "fetch", "smollm2-135m", "--cache-dir",
                           str(models_cache)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path / "empty")})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == str(smollm2_dir) and proc.stderr == ""


def test_default_backend_knows_paris(runs, prompts, tokenizer, smollm2_dir):
    """The default backend serves the real model: greedy, it answers the capital
    question with Paris. Checked in fp32: in bf16 on an AMX CPU
    the greedy answer of this 135M model turned into "L'Étoile, la Mar" (the
    bf16 run here still must not use CHUNKED_KV)."""
    rounds, where = prompts
    r, i = where["capital"]
    assert CAPITAL_QUESTION in tokenizer.decode(rounds[r][i])
    fp32 = run(smollm2_dir, {"dtype": "float32"}, [[rounds[r][i]]], MAX_TOKENS)
    answer = tokenizer.decode(fp32["outputs"][0][0])
    print(f"{CAPITAL_QUESTION!r} -> {answer!r} (fp32); bf16: {tokenizer.decode(runs['default']['outputs'][r][i])!r}")
    assert "Paris" in answer
    assert "Using CHUNKED_KV attention backend" not in runs["default"]["log"]


def compare(default: dict, other: dict, r: int, i: int) -> str:
    """'equal', 'tie at step k', or why the two greedy continuations disagree."""
    mine, theirs = default["outputs"][r][i], other["outputs"][r][i]
    k = next((j for j, (a, b) in enumerate(zip(mine, theirs)) if a != b), len(mine))
    for j in range(min(k + 1, len(mine))):
        token, logprob = default["top2"][r][i][j][0]
        seen = dict((t, lp) for t, lp in other["top2"][r][i][j])
        if token in seen and abs(seen[token] - logprob) <= LOGPROB_TOL:
            continue
        # where they split, a near tie of three tokens may leave the default's out of the other's top-2
        if not (j == k and max(seen.values()) - min(seen.values()) <= TIE_GAP):
            return f"step {j}: default token {token} logprob {logprob:.3f}, other top-2 {seen}"
    if k == len(mine):
        return "equal"
    (_, best), (second_token, second) = default["top2"][r][i][k]
    if best - second > TIE_GAP or theirs[k] != second_token:
        return f"step {k}: {theirs[k]} instead of {mine[k]} (default top-2 {default['top2'][r][i][k]})"
    return f"tie at step {k}"


@pytest.mark.parametrize("name", list(EXACT))
def test_exact_chunked_configs_match_default(name, runs, prompts):
    rounds, _ = prompts
    default, other = runs["default"], runs[name]
    assert "Using CHUNKED_KV attention backend" in other["log"]
    verdicts = [compare(default, other, r, i) for r, prompts_ in enumerate(rounds) for i in range(len(prompts_))]
    equal = verdicts.count("equal")
    print(f"{name}: {equal}/{len(verdicts)} prompts equal throughout; "
          f"{[v for v in verdicts if v != 'equal']}")
    assert len(verdicts) >= 20
    assert all(v == "equal" or v.startswith("tie at") for v in verdicts), verdicts
    assert equal >= len(verdicts) / 2, verdicts


@pytest.mark.parametrize("name", ["default", "chunk 4, window 1024"])
def test_prefix_cache_hits_are_counted(name, runs, prompts):
    """Round 2 starts with prefixes round 1 computed: vLLM must report them as
    cached (whole blocks), not only produce equal tokens."""
    rounds, where = prompts
    cached = runs[name]["cached"]
    print(f"{name}: cached tokens per prompt {cached}")
    assert all(n == 0 for n in cached[0])  # round 1 is fresh
    r, i = where["repeat"]
    assert rounds[r][i] == rounds[where["repeated"][0]][where["repeated"][1]]
    assert cached[r][i] == (len(rounds[r][i]) - 1) // BLOCK * BLOCK  # all but the last, partial block
    assert all(n >= BLOCK for n in cached[1])


def test_long_prompt_is_split_by_chunked_prefill(runs, prompts):
    rounds, where = prompts
    r, i = where["long"]
    length = len(rounds[r][i])
    for name, result in runs.items():
        pieces = result["pieces"][r][i]
        prefill = pieces[: len(pieces) - (MAX_TOKENS - 1)]
        print(f"{name}: the {length}-token prompt was computed in pieces {prefill}")
        assert sum(pieces) == length + MAX_TOKENS - 1 and max(pieces) <= STEP_TOKENS
        assert len(prefill) >= math.ceil(length / STEP_TOKENS) and sum(prefill) == length


def test_chunked_capacity_is_near_theory(smollm2_dir, runs):
    """Full attention's capacity is its pages' tokens whatever the request
    length, so the default run's figure holds at CAPACITY_LEN too; the
    chunked engine starts (no prompts) at CAPACITY_LEN and the same memory."""
    default = runs["default"]
    assert default["capacity_tokens"] == default["num_gpu_blocks"] * default["block_size"]
    compressed = run(smollm2_dir, {**chunked(COMPRESSED), "max_model_len": CAPACITY_LEN}, rounds=[])
    cfg = ChunkedKVConfig(**COMPRESSED)
    config = json.loads((smollm2_dir / "config.json").read_text())
    layers, kv_heads, head_dim = config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]
    rows = (CAPACITY_LEN / cfg.tokens_per_state + layout.raw_window(cfg)
            + layout.model_forever_raw(cfg, layers * kv_heads)  # per full-length request
            + kept_tail_rows(cfg, BLOCK, STEP_TOKENS, 0))  # prefix caching: raw tails kept for later hits
    theory = CAPACITY_LEN / float(rows)
    asymptotic = footprint(uncompressed_bytes_per_token(layers, kv_heads, head_dim, 2), cfg.tokens_per_state,
                           None).compression_ratio  # an endless request: tokens per stored row
    measured = compressed["capacity_tokens"] / default["capacity_tokens"]
    print(f"KV capacity at {ENGINE['kv_cache_memory_bytes'] >> 20} MiB: default {default['capacity_tokens']} "
          f"tokens; chunk 4 / window 128 {compressed['capacity_tokens']} tokens for {CAPACITY_LEN}-token "
          f"requests: {measured:.2f}x (theory {theory:.2f}x, at most {asymptotic:.0f}x)")
    assert theory > 3.3
    assert 0.9 * theory <= measured <= asymptotic
