"""Contract of `backend.step_link.StepLink`: the compressed metadata of a
step is planned as soon as the raw pages' metadata of the same step exists,
whichever of the two vLLM builds first; the step is named by the
`query_start_loc_cpu` object vLLM hands every group of it, so a later step
(a new object, even with equal values) never reads the raw metadata of an
earlier one; a group whose raw metadata never arrives stays unplanned (and
`forward` then fails loudly); `link_for` gives one link per engine config."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_chunked_kv.backend.step_link import StepLink, link_for


class Builder:
    """Plans a metadata dict once its raw companions are all there."""

    def __init__(self, needs: list[str]) -> None:
        self.needs = needs

    def complete(self, metadata: dict, raw_by_layer: dict) -> bool:
        if any(name not in raw_by_layer for name in self.needs):
            return False
        metadata["raw"] = [raw_by_layer[name] for name in self.needs]
        return True


def _step():
    return SimpleNamespace(query_start_loc_cpu=torch.tensor([0, 1, 2]))


def test_planned_whichever_group_is_built_first():
    link, builder = StepLink(), Builder(["a.raw", "b.raw"])
    step = _step()
    first, second = {}, {}
    link.raw_built(step, ["a.raw", "b.raw"], "R1")
    link.chunked_built(step, builder, first)  # raw first: planned at once
    assert first["raw"] == ["R1", "R1"]
    step = _step()
    link.chunked_built(step, builder, second)  # compressed first: waits
    assert "raw" not in second
    link.raw_built(step, ["a.raw"], "R2")
    assert "raw" not in second  # one of two raw groups
    link.raw_built(step, ["b.raw"], "R3")
    assert second["raw"] == ["R2", "R3"]


def test_a_later_step_never_reads_an_earlier_steps_raw_metadata():
    link, builder = StepLink(), Builder(["a.raw"])
    link.raw_built(_step(), ["a.raw"], "old")
    metadata = {}
    link.chunked_built(_step(), builder, metadata)  # equal values, another object: another step
    assert "raw" not in metadata


class Config:  # an engine config: any object
    pass


def test_one_link_per_engine_config():
    config, other = Config(), Config()
    assert link_for(config) is link_for(config) and link_for(config) is not link_for(other)
