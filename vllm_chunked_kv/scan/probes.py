"""The three probes (axes) of docs/design.md §7 as lists of requests to send.

- `offset`: every offset item with 0 .. num_offsets-1 filler units put in
  front (after the server's special prefix), accuracy per offset. The items
  share their target position and their length, so offset k moves every
  target and every prompt end to the same position and phase.
- `needle`: position-matched needle items, grouped by the phase of the
  target's position (`position mod hop`); each prompt's length is fixed.
- `length`: every length item with 0 .. num_offsets-1 filler units added
  after its record, before the question: the target stays, the prompt
  length moves; grouped by `prompt length mod hop`.

Probe ids are stable for a given run configuration, which is what lets a
re-run skip the probes already on disk.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_chunked_kv.scan.errors import ScanError
from vllm_chunked_kv.scan.items import Item, grown, prepended
from vllm_chunked_kv.scan.render import Renderer

PROBES = ("offset", "needle", "length")
CHOICES = {"all": list(PROBES), "both": ["offset", "needle"], **{kind: [kind] for kind in PROBES}}


def probe_kinds(choice: str) -> list[str]:
    """`--probe` to the probes it runs: one axis, `both` (offset and needle, as before `length`) or `all`."""
    return CHOICES[choice]


@dataclass(frozen=True)
class Probe:
    probe_id: str
    kind: str  # "offset" | "needle" | "length"
    offset: int | None  # offset probe: filler units prepended
    planned_phase: int | None  # needle probe: the phase the position was drawn for
    item: Item
    extra: int | None = None  # length probe: filler units added after the record


@dataclass(frozen=True)
class ProbePlan:
    hop: int
    num_offsets: int
    prompts: int  # offset and length probes: distinct prompts, each sent at every offset / extra
    per_phase: int  # needle probe: prompts per phase
    seed: int
    target_position: int | None = None  # offset probe: where the targets sit (default: task's)
    needle_range: tuple[int, int] | None = None  # needle probe: [lo, hi] positions


def check_plan(plan: ProbePlan) -> None:
    if plan.hop < 2:
        raise ScanError(f"--hop must be at least 2, got {plan.hop}")
    if plan.num_offsets < 2:
        raise ScanError(f"--offsets must be at least 2, got {plan.num_offsets}")
    if plan.per_phase < 1 or plan.per_phase % plan.hop:
        raise ScanError(f"--per-phase must be a positive multiple of --hop ({plan.hop}), got {plan.per_phase}")
    if plan.prompts < 1:
        raise ScanError(f"--prompts must be positive, got {plan.prompts}")


async def offset_probes(task, renderer: Renderer, plan: ProbePlan) -> list[Probe]:
    items = await task.offset_items(renderer, plan.prompts, plan.seed, plan.target_position)
    filler = task.filler(renderer.units)
    probes = []
    for i, item in enumerate(items):  # prompt-major: a partial run covers every offset evenly
        for offset in range(plan.num_offsets):
            # The filler goes in front of every segment (and after the special prefix).
            probes.append(Probe(f"offset:{offset}:{i}", "offset", offset, None, prepended(item, offset, filler)))
    return probes


async def length_probes(task, renderer: Renderer, plan: ProbePlan) -> list[Probe]:
    items = await task.length_items(renderer, plan.prompts, plan.seed, plan.hop)
    return [  # prompt-major, like the offset probe
        Probe(f"length:{extra}:{i}", "length", None, None, grown(item, extra), extra=extra)
        for i, item in enumerate(items)
        for extra in range(plan.num_offsets)
    ]


async def needle_probes(task, renderer: Renderer, plan: ProbePlan) -> list[Probe]:
    try:
        groups = await task.needle_items(renderer, plan.hop, plan.per_phase, plan.seed, plan.needle_range)
    except ValueError as exc:  # needle_positions_by_phase: range too narrow
        raise ScanError(f"needle probe: {exc}") from None
    count = min(len(items) for items in groups.values())
    return [  # interleaved: a partial run covers every phase evenly
        Probe(f"needle:{phase}:{i}", "needle", None, phase, groups[phase][i])
        for i in range(count)
        for phase in sorted(groups)
    ]


async def build_probes(kinds: list[str], task, renderer: Renderer, plan: ProbePlan) -> list[Probe]:
    check_plan(plan)
    probes: list[Probe] = []
    if "offset" in kinds:
        probes += await offset_probes(task, renderer, plan)
    if "needle" in kinds:
        probes += await needle_probes(task, renderer, plan)
    if "length" in kinds:
        probes += await length_probes(task, renderer, plan)
    return probes
