"""Greedy generation with a real model in a fresh in-process vLLM engine.

`run(model, engine_kwargs, rounds)` runs `engine_main` in a process of its
own (vLLM keeps global state per process; `engine_run.run_engine_process`
forks it with vLLM imported, engine core in-process) and returns, per round
(rounds run one after another on the same engine, so a later round can hit
the prefix cache an earlier one filled):

- `outputs`: generated token ids per prompt;
- `cached`: vLLM's `num_cached_tokens` per prompt (prefix-cache hits, tokens);
- `pieces`: the tokens the scheduler gave each prompt in each engine step
  (a prompt split by chunked prefill shows several prefill pieces);
- `top2`: per generated token, the two best (token id, logprob) pairs;

and once: `capacity_tokens` (vLLM's own KV capacity figure), `num_gpu_blocks`,
`block_size`, `alignment_tokens` (vLLM's prefix-hit granularity), `seconds` and `round_seconds` (wall time of the rounds) and `log` (vLLM's output).

`timeout` only guards against a hang: a run of the SmolLM2 test took 1.5-2
minutes on 2 cores shared with other jobs (load ~7), over 10 at load ~17.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

from vllm_chunked_kv.ops.dispatch import native_bf16
from vllm_chunked_kv.runner.engine import in_process_scheduler, run_engine_process

# The checkpoint's bf16 where the CPU computes it natively; fp32 where bf16 is emulated (AVX2 only:
# three SmolLM2 runs took 8.5 minutes in bf16 there).
SERVE_DTYPE = "bfloat16" if native_bf16() else "float32"
ENGINE_DEFAULTS = dict(enforce_eager=True, dtype=SERVE_DTYPE, max_model_len=1024, kv_cache_memory_bytes=256 << 20,
                       seed=0)


def run(model: str | Path, engine_kwargs: dict, rounds: list[list[list[int]]], max_tokens: int = 16,
        timeout: float = 1800) -> dict:
    spec = {"model": str(model), "engine": {**ENGINE_DEFAULTS, **engine_kwargs}, "rounds": rounds,
            "max_tokens": max_tokens}
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return run_engine_process(f"{__name__}:engine_main", spec, timeout, env=offline)


def _record_schedules(llm) -> dict[str, list[int]]:
    """Wrap the in-process scheduler: request id -> tokens scheduled per step."""
    scheduler = in_process_scheduler(llm)
    pieces: dict[str, list[int]] = defaultdict(list)
    schedule = scheduler.schedule

    def recording_schedule(*args, **kwargs):
        output = schedule(*args, **kwargs)
        for req_id, n in output.num_scheduled_tokens.items():
            pieces[req_id].append(int(n))
        return output

    scheduler.schedule = recording_schedule
    return pieces


def engine_main(spec: dict) -> dict:
    """One engine run, in its own process."""
    from vllm import LLM, SamplingParams

    from vllm_chunked_kv.serving.kv_footprint import capacity_tokens

    llm = LLM(spec["model"], **spec["engine"])
    pieces = _record_schedules(llm)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, logprobs=2)
    result = defaultdict(list)
    start = time.monotonic()
    for prompts in spec["rounds"]:
        round_start = time.monotonic()
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        result["outputs"].append([list(r.outputs[0].token_ids) for r in outs])
        result["cached"].append([int(r.num_cached_tokens or 0) for r in outs])
        result["pieces"].append([next(v for k, v in pieces.items() if k == r.request_id or
                                      k.startswith(f"{r.request_id}-")) for r in outs])
        result["top2"].append([[sorted(((t, lp.logprob) for t, lp in step.items()), key=lambda x: -x[1])[:2]
                                for step in r.outputs[0].logprobs] for r in outs])
        result["round_seconds"].append(round(time.monotonic() - round_start, 2))
    cache_config = llm.llm_engine.vllm_config.cache_config
    result.update(capacity_tokens=capacity_tokens(cache_config), num_gpu_blocks=cache_config.num_gpu_blocks,
                  block_size=cache_config.block_size, alignment_tokens=cache_config.cache_hit_alignment_tokens,
                  seconds=round(time.monotonic() - start, 2))
    return {"outputs": result.pop("outputs", []), **result}
