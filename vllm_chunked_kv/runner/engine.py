"""Run greedy generation in a fresh in-process vLLM engine.

Each configuration gets its own process (vLLM keeps global state per
process), forked by `generate()` from a process that has imported vLLM
already (`zygote.py`):

    outputs = generate(model_dir, {"attention_backend": "chunked_kv"}, [[ids, ids], [ids]])

`rounds` are submitted one after another to the same engine, so a later
round hits the prefix cache filled by an earlier one; the prompts of one
round run concurrently. Returns `outputs` (the generated token ids per
round), `preemptions` (requests the scheduler preempted) and `log`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from vllm_chunked_kv.runner.zygote import run_forked

IN_PROCESS_ENGINE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # vLLM's engine core in the run's own process
ENGINE_DEFAULTS = dict(enforce_eager=True, dtype="float32", max_model_len=1024,
                       kv_cache_memory_bytes=64 << 20, seed=0)


def generate(model: str, engine_kwargs: dict, rounds: list[list[list[int]]], max_tokens: int = 8,
             timeout: float = 600, env: dict[str, str] | None = None) -> dict:
    spec = {"model": str(model), "engine": {**ENGINE_DEFAULTS, **engine_kwargs}, "rounds": rounds,
            "max_tokens": max_tokens}
    return run_engine_process(f"{__name__}:engine_main", spec, timeout, env=env)


def run_engine_process(target: str, spec: dict, timeout: float | None, env: dict[str, str] | None = None) -> dict:
    """``module:function`` called with `spec` in a fresh process forked with vLLM imported
    (`zygote.run_forked`), with vLLM's engine core in that process; its result plus ``log``."""
    return run_forked(target, spec, timeout, env={**IN_PROCESS_ENGINE, **(env or {})})


def run_json_script(argv: list[str], spec: dict, timeout: float | None, env: dict[str, str] | None = None,
                    marker: str = "{") -> dict:
    """Run an engine script in an in-process-engine interpreter, `spec` as JSON on stdin;
    its last stdout line starting with `marker`, parsed, plus `log` (vLLM logs to stdout).
    `timeout` None: no limit (benchmarks)."""
    env = {**os.environ, **IN_PROCESS_ENGINE, **(env or {})}
    proc = subprocess.run(argv, input=json.dumps(spec), capture_output=True, text=True, env=env, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(marker)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"engine run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1])
    result["log"] = proc.stdout + proc.stderr
    return result


def worker_or_main(worker, main) -> None:
    """A benchmark script's entry: with ``--worker`` (how `run_json_script`
    starts it) the spec from stdin through `worker`, its result printed as
    one JSON line; else `main()`."""
    if sys.argv[1:] == ["--worker"]:
        print(json.dumps(worker(json.loads(sys.stdin.read()))), flush=True)
    else:
        main()


def engine_main(spec: dict) -> dict:
    """One engine run (in its own process): `spec` is what `generate` builds."""
    from vllm import LLM, SamplingParams
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # as `vllm serve` does before parsing: CHUNKED_KV named in attention_config resolves
    llm = LLM(spec["model"], **spec["engine"])
    preemptions = _count_preemptions(llm)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    outputs, cached = [], []
    for prompts in spec["rounds"]:
        results = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        outputs.append([list(r.outputs[0].token_ids) for r in results])
        cached.append(sum(r.num_cached_tokens or 0 for r in results))
    return {"outputs": outputs, "preemptions": len(preemptions), "cached_tokens": cached}


def in_process_scheduler(llm):
    """vLLM's scheduler of an `LLM` whose engine core runs in this process (`IN_PROCESS_ENGINE`)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def _count_preemptions(llm) -> list[str]:
    """Wrap the in-process scheduler's preemption: the ids of the requests it preempts, as they happen."""
    scheduler = in_process_scheduler(llm)
    preempt = scheduler._preempt_request
    seen: list[str] = []

    def counting(request, *args, **kwargs):
        seen.append(request.request_id)
        return preempt(request, *args, **kwargs)

    scheduler._preempt_request = counting
    return seen


if __name__ == "__main__":
    print(json.dumps(engine_main(json.loads(sys.stdin.read()))), flush=True)
