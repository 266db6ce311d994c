"""The two cache groups of one step, joined so that the builder plans the step.

A CHUNKED_KV layer's step plan needs its own (compressed) pages' block
table and its raw pages' one: the companion layer's cache group
(`raw_cache.py`). vLLM builds each cache group's metadata separately, one
group after another, all before the step's forward, and both builders are
ours. It hands every group of one step the same `query_start_loc_cpu`
tensor, a new one each step (model runner V1 and V2 alike): that tensor
names the step. Whichever of the two builders runs second completes the
compressed metadata (`ChunkedKVMetadataBuilder.complete`), so `forward`
finds its plan ready. Micro-batching splits a step's metadata per group and
is refused at startup (`startup_checks`).
"""

from __future__ import annotations

import weakref
from typing import Protocol


class Completes(Protocol):
    def complete(self, metadata, raw_by_layer: dict) -> bool:
        """Plan `metadata` if every raw group it needs is in `raw_by_layer`; whether it did."""


class StepLink:
    """The raw pages' metadata of the current step, by companion layer name,
    and the compressed metadata still waiting for some of it."""

    def __init__(self) -> None:
        self._step = None  # the step's query_start_loc_cpu (held, so a later step's is another object)
        self._raw: dict = {}
        self._waiting: list[tuple[Completes, object]] = []

    def _enter(self, common) -> None:
        step = common.query_start_loc_cpu
        if step is not self._step:
            self._step, self._raw, self._waiting = step, {}, []

    def raw_built(self, common, layer_names: list[str], metadata) -> None:
        """The raw pages' builder built `metadata` for `layer_names` (companions)."""
        self._enter(common)
        self._raw.update(dict.fromkeys(layer_names, metadata))
        self._waiting = [(builder, m) for builder, m in self._waiting if not builder.complete(m, self._raw)]

    def chunked_built(self, common, builder: Completes, metadata) -> None:
        """The compressed pages' `builder` built `metadata`: plan it now, or when its raw groups arrive."""
        self._enter(common)
        if not builder.complete(metadata, self._raw):
            self._waiting.append((builder, metadata))


_links: dict[int, tuple[weakref.ref, StepLink]] = {}  # id(VllmConfig) -> (the config, its link)


def link_for(vllm_config) -> StepLink:
    """The link shared by the builders of one engine config (one per worker process)."""
    held = _links.get(id(vllm_config))
    if held is None or held[0]() is not vllm_config:
        held = (weakref.ref(vllm_config), StepLink())
        _links[id(vllm_config)] = held
    return held[1]
