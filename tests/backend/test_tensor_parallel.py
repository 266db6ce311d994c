"""Tensor parallelism on the CPU build: `--tensor-parallel-size 2` serves the
same greedy tokens as one rank.

The tiny Llama has 2 KV heads, so each rank holds one: with `stagger` the
two ranks use different grid origins, which they must take from the
model-wide head index (`backend.layer_grid.global_kv_heads`). Prompts are longer than
the window, so compressed rows are read. The CPU workers' threads are bound
one core each (`VLLM_CPU_OMP_THREADS_BIND=a|b` with two cores this process
may use; vLLM refuses to bind two workers on one NUMA node by itself)."""

from __future__ import annotations

import json
import os
import random

import pytest

from vllm_chunked_kv.runner.server import VllmServer

pytestmark = [pytest.mark.server, pytest.mark.slow]

SETTINGS = {
    "stagger": {"mitigation": "stagger", "chunk_size": 4, "window": 16, "sink_tokens": 4},
}


def _answers(model, settings: dict, tp: int) -> list[str]:
    args = ["--attention-backend", "chunked_kv", "--additional-config", json.dumps({"chunked_kv": settings}),
            "--tensor-parallel-size", str(tp)]
    cores = sorted(os.sched_getaffinity(0))[:tp]  # the cores this process may use, one per rank
    env = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c) for c in cores)}
    rng = random.Random(0)
    prompts = [" ".join(f"w{rng.randint(0, 249)}" for _ in range(rng.randint(60, 300))) for _ in range(6)]
    with VllmServer(model, args, env=env) as server:
        client = server.openai_client()
        name = client.models.list().data[0].id
        return [client.completions.create(model=name, prompt=p, max_tokens=12, temperature=0).choices[0].text
                for p in prompts]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two cores")
@pytest.mark.parametrize("mode", list(SETTINGS))
def test_two_ranks_equal_one(mode, tiny_llama):
    assert _answers(tiny_llama, SETTINGS[mode], 2) == _answers(tiny_llama, SETTINGS[mode], 1)
