"""Contract of probe planning.

- The offset and length probes send every prompt at every offset / extra
  0..N-1, prompt-major (so a partial run covers all of them evenly); the
  needle probe sends per_phase prompts per phase, interleaved across phases.
- Probe ids are unique and the same for the same plan (what resuming relies on).
- Impossible plans are one-line errors.
"""

from __future__ import annotations

import asyncio

import pytest

from vllm_chunked_kv.scan.errors import ScanError
from vllm_chunked_kv.scan.probes import ProbePlan, build_probes
from vllm_chunked_kv.scan.render import Fill, Renderer
from vllm_chunked_kv.scan.tasks import KVTask

PLAN = ProbePlan(hop=4, num_offsets=8, prompts=3, per_phase=8, seed=1)


def _probes(plan=PLAN, kinds=("offset", "needle", "length")):
    return asyncio.run(build_probes(list(kinds), KVTask(haystack_len=60, num_records=8), Renderer(), plan))


def test_counts_order_and_ids():
    probes = _probes()
    offsets = [p for p in probes if p.kind == "offset"]
    needles = [p for p in probes if p.kind == "needle"]
    assert len(offsets) == 3 * 8 and len(needles) == 4 * 8
    assert [p.offset for p in offsets[:8]] == list(range(8))
    assert [p.planned_phase for p in needles[:4]] == [0, 1, 2, 3]
    assert len({p.probe_id for p in probes}) == len(probes)
    assert all(p.item.segments[0] == Fill(p.offset, " ") for p in offsets)  # characters: spaces
    lengths = [p for p in probes if p.kind == "length"]
    assert len(lengths) == 3 * 8 and [p.extra for p in lengths[:8]] == list(range(8))
    assert all(p.item.segments[p.item.slot] == Fill(p.extra, " ") for p in lengths)


def test_same_plan_same_probes():
    assert _probes() == _probes()
    assert _probes() != _probes(ProbePlan(hop=4, num_offsets=8, prompts=3, per_phase=8, seed=2))


@pytest.mark.parametrize(
    "plan, message",
    [
        (ProbePlan(hop=1, num_offsets=8, prompts=3, per_phase=8, seed=0), "--hop"),
        (ProbePlan(hop=4, num_offsets=8, prompts=3, per_phase=6, seed=0), "multiple of --hop"),
        (ProbePlan(hop=4, num_offsets=8, prompts=0, per_phase=8, seed=0), "--prompts"),
        (ProbePlan(hop=4, num_offsets=8, prompts=3, per_phase=8, seed=0, needle_range=(10, 12)), "too narrow"),
        (ProbePlan(hop=4, num_offsets=8, prompts=3, per_phase=8, seed=0, target_position=500), "outside the haystack"),
    ],
)
def test_impossible_plans(plan, message):
    with pytest.raises(ScanError, match=message):
        _probes(plan)
