"""The metadata builder hands `forward` a step that is ready.

In a real in-process engine (tiny Llama, prompts past the window, chunked
prefill pieces, decode and mixed steps):

- every plan is made while vLLM builds the step's metadata (a caller of
  `plan_step` is `ChunkedKVMetadataBuilder.complete`), none inside
  `ChunkedKVImpl.forward`;
- each step's metadata carries a plan for every layer by the time the model
  runs, and layers with the same grid share one plan object;
- the kernels are chosen once per process (`dispatch.choose` from the
  builder only, never from the impl) and the metadata carries them.
"""

from __future__ import annotations

import inspect
import random

import pytest

from vllm_chunked_kv.models.tiny import vocabulary
from vllm_chunked_kv.runner.engine import ENGINE_DEFAULTS, run_engine_process

pytestmark = pytest.mark.engine


def probe(spec: dict) -> dict:
    """One engine run with plan_step, dispatch.choose and forward watched (its own process)."""
    from vllm import LLM, SamplingParams

    from vllm_chunked_kv.backend import attention
    from vllm_chunked_kv.ops import dispatch

    seen = {"plan_callers": set(), "choose_callers": set(), "forward_layers": 0, "unready": 0, "shared": 0,
            "steps": 0}
    plan_step, choose, forward = attention.plan_step, dispatch.choose, attention.ChunkedKVImpl.forward

    def watched_plan_step(*args, **kwargs):
        seen["plan_callers"].update(frame.function for frame in inspect.stack()[1:6])
        return plan_step(*args, **kwargs)

    def watched_choose(*args, **kwargs):
        seen["choose_callers"].add(inspect.stack()[1].function)
        return choose(*args, **kwargs)

    def watched_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *rest, **kwargs):
        if attn_metadata is not None:
            seen["forward_layers"] += 1
            seen["unready"] += layer.layer_name not in attn_metadata.layers
            plans = [step.plan for step in attn_metadata.layers.values()]
            seen["shared"] = max(seen["shared"], len(plans) - len({id(plan) for plan in plans}))
        return forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *rest, **kwargs)

    attention.plan_step, dispatch.choose = watched_plan_step, watched_choose
    attention.ChunkedKVImpl.forward = watched_forward
    llm = LLM(spec["model"], **spec["engine"])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids} for ids in spec["prompts"]], params, use_tqdm=False)
    return {key: sorted(value) if isinstance(value, set) else value for key, value in seen.items()}


@pytest.fixture(scope="module")
def watched(tiny_llama):
    rng = random.Random(3)
    vocab = vocabulary()
    words = [i for i, w in enumerate(vocab) if w.startswith("w")]
    prompts = [[vocab.index("<bos>")] + rng.choices(words, k=n) for n in (90, 41, 150)]
    settings = {"chunk_size": 4, "window": 16, "sink_tokens": 2}  # one grid for every layer
    engine = {**ENGINE_DEFAULTS, "attention_backend": "chunked_kv",
              "additional_config": {"chunked_kv": settings}, "max_num_batched_tokens": 64}
    return run_engine_process(f"{__name__}:probe", {"model": str(tiny_llama), "engine": engine, "prompts": prompts},
                              600)


def test_plans_are_made_while_the_metadata_is_built(watched):
    assert watched["forward_layers"] > 0
    assert "complete" in watched["plan_callers"] and "build" in watched["plan_callers"]
    assert "forward" not in watched["plan_callers"] and "watched_forward" not in watched["plan_callers"]


def test_every_layer_finds_its_plan_ready_and_one_grid_one_plan(watched):
    assert watched["unready"] == 0
    assert watched["shared"] >= 1  # the layers share their grid, so their plan


def test_kernels_are_chosen_by_the_builder_only(watched):
    assert watched["choose_callers"] == ["__init__"]  # ChunkedKVMetadataBuilder.__init__
