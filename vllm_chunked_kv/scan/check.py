"""The one-request check (seeds guide §9, "append perturbation"): does one prompt's answer move with the grid?

The prompt is asked greedily as is and with 1 .. 2·hop−1 filler units
(`Fill`, in the scan's units) put

- in **front** (after the server's special prefix): the whole prompt, the
  facts it holds and its end, shifts by that many positions;
- at the **end** (or just before the last occurrence of `end_before`, e.g.
  the question): only the prompt length changes.

A side is stable when every answer equals its own unpadded one. A change
that repeats one hop later (at `k` and `k ± hop`) is what a chunk grid
does; changes that do not repeat point to something else.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass

from vllm_chunked_kv.scan.client import EndpointClient
from vllm_chunked_kv.scan.errors import ScanError
from vllm_chunked_kv.scan.render import Fill, Renderer, Segment, Text

SIDES = ("front", "end")


@dataclass(frozen=True)
class Asked:
    side: str  # "front" | "end"
    extra: int  # filler units added
    length: int  # prompt length in units
    completion: str


@dataclass(frozen=True)
class CheckPlan:
    prompt: str
    model: str
    hop: int
    filler: str
    end_before: str | None  # the end filler goes before the last occurrence of this text
    max_tokens: int


def segments(plan: CheckPlan, side: str, extra: int) -> tuple[Segment, ...]:
    if side == "front":
        return (Fill(extra, plan.filler), Text(plan.prompt))
    cut = plan.prompt.rfind(plan.end_before) if plan.end_before else len(plan.prompt)
    if cut < 0:
        raise ScanError(f"--end-before {plan.end_before!r} does not occur in the prompt")
    return (Text(plan.prompt[:cut]), Fill(extra, plan.filler), Text(plan.prompt[cut:]))


async def ask_all(client: EndpointClient, renderer: Renderer, plan: CheckPlan) -> list[Asked]:
    """Every side at extras 0 .. 2·hop−1; identical prompts are sent once."""
    jobs = [(side, extra) for side in SIDES for extra in range(2 * plan.hop)]
    rendered = [await renderer.render(segments(plan, side, extra)) for side, extra in jobs]
    unique: dict[str, str | list[int]] = {repr(r.prompt): r.prompt for r in rendered}

    async def complete(prompt) -> str:
        answer = await client.complete(plan.model, prompt, max_tokens=plan.max_tokens, temperature=0.0, seed=None)
        return answer.text

    texts = dict(zip(unique, await asyncio.gather(*(complete(p) for p in unique.values()))))
    return [Asked(side, extra, r.length, texts[repr(r.prompt)]) for (side, extra), r in zip(jobs, rendered)]


def _same(a: str, b: str) -> bool:
    return " ".join(a.split()) == " ".join(b.split())


def side_verdict(asked: list[Asked], hop: int) -> dict:
    """One side's answers against its unpadded one: which extras change it, at which phases, periodic or not."""
    baseline = next(a for a in asked if a.extra == 0)
    changed = [a for a in asked if not _same(a.completion, baseline.completion)]
    extras = {a.extra for a in changed}
    return {
        "baseline": baseline.completion,
        "answers": [asdict(a) for a in asked],
        "changed_extras": sorted(extras),
        "phases": sorted({e % hop for e in extras}),  # filler units mod hop
        "length_phases": sorted({a.length % hop for a in changed}),  # prompt length mod hop
        "periodic": bool(extras) and all(e + hop in extras or e - hop in extras for e in extras),
    }


def verdict(asked: list[Asked], hop: int) -> dict:
    sides = {side: side_verdict([a for a in asked if a.side == side], hop) for side in SIDES}
    changed = [side for side in SIDES if sides[side]["changed_extras"]]
    if not changed:
        conclusion = "stable"
    elif all(sides[side]["periodic"] for side in changed):
        conclusion = "periodic"  # changes repeat every hop: a chunk-boundary effect
    else:
        conclusion = "unstable"  # changes that do not repeat with the hop
    return {"stable": not changed, "conclusion": conclusion, **sides}
