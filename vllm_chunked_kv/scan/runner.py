"""Send the probes with bounded concurrency, record each answer as it arrives, post feedback.

An `Endpoint` is one server with its own store, request settings and
feedback; an A/B scan (`--compare-url`) answers the same probes on two of
them from one queue (`run_jobs`), `concurrency` requests in flight per
endpoint. The first request that fails for good (after the client's
retries) stops the run: requests in flight are cancelled, every answer
already received is on disk, and the error propagates as one `ScanError` line.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass

from vllm_chunked_kv.scan.client import EndpointClient, HTTPFailure
from vllm_chunked_kv.scan.errors import ScanError
from vllm_chunked_kv.scan.probes import Probe
from vllm_chunked_kv.scan.progress import Progress
from vllm_chunked_kv.scan.records import Record, RecordStore
from vllm_chunked_kv.scan.render import Renderer


@dataclass(frozen=True)
class RequestSettings:
    model: str
    hop: int
    max_tokens: int
    temperature: float
    seed: int | None  # per-request sampling seed; irrelevant when greedy


class FeedbackPoster:
    """Posts `{"request_id", "correct"}` to the server's feedback route while it has one."""

    def __init__(self, client: EndpointClient, enabled: bool):
        self.client = client
        self.enabled = enabled
        self.route = "unknown" if enabled else "off"
        self.posted = 0
        self.rejected = 0
        self._warned = False

    def _warn(self, message: str) -> None:
        if not self._warned:
            print(f"warning: {message}", file=sys.stderr)
            self._warned = True

    async def post(self, request_id: str, correct: bool) -> None:
        if not self.enabled:
            return
        try:
            await self.client.post_feedback(request_id, correct)
        except HTTPFailure as exc:
            if exc.status in (404, 405) and exc.detail == "Not Found":  # the route itself is missing
                self.enabled, self.route = False, "missing"
                print(f"warning: {self.client.base_url} has no feedback route: not posting feedback", file=sys.stderr)
                return
            self.rejected += 1
            self._warn(f"feedback rejected ({exc}); further rejections are counted, not shown")
            return
        except ScanError as exc:
            self.rejected += 1
            self._warn(f"feedback not delivered ({exc}); further failures are counted, not shown")
            return
        self.route = "present"
        self.posted += 1

    def summary(self) -> dict:
        return {"route": self.route, "posted": self.posted, "rejected": self.rejected}


async def _answer(
    client: EndpointClient, renderer: Renderer, task, probe: Probe, settings: RequestSettings
) -> Record:
    rendered = await renderer.render(probe.item.segments)
    completion = await client.complete(
        settings.model, rendered.prompt, max_tokens=settings.max_tokens,
        temperature=settings.temperature, seed=settings.seed,
    )
    return Record(
        probe_id=probe.probe_id,
        probe=probe.kind,
        offset=probe.offset,
        planned_phase=probe.planned_phase,
        position=rendered.target_position,
        phase=rendered.target_position % settings.hop,
        prompt_units=rendered.length,
        units=renderer.units,
        answer=probe.item.answer,
        completion=completion.text,
        correct=task.is_correct(completion.text, probe.item.answer),
        request_id=completion.request_id,
        attempts=completion.attempts,
        latency_s=round(completion.latency_s, 4),
        distance=rendered.distance,
        extra=probe.extra,
    )


@dataclass(frozen=True)
class Endpoint:
    client: EndpointClient
    store: RecordStore
    settings: RequestSettings
    feedback: FeedbackPoster


async def run_jobs(
    jobs: list[tuple[Endpoint, Probe]], renderer: Renderer, task, *, concurrency: int, progress: Progress
) -> list[Record]:
    """Answer every (endpoint, probe) job; returns the new records (also appended to each store)."""
    queue: asyncio.Queue[tuple[Endpoint, Probe]] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    new: list[Record] = []

    async def worker() -> None:
        while True:
            try:
                endpoint, probe = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            record = await _answer(endpoint.client, renderer, task, probe, endpoint.settings)
            endpoint.store.append(record)
            new.append(record)
            progress.update(record.correct)
            await endpoint.feedback.post(record.request_id, record.correct)

    endpoints = len({id(endpoint) for endpoint, _ in jobs}) or 1
    workers = [asyncio.create_task(worker()) for _ in range(max(1, min(concurrency * endpoints, len(jobs))))]
    try:
        await asyncio.gather(*workers)
    except BaseException:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        raise
    finally:
        progress.close()
    return new


async def run_probes(
    client: EndpointClient,
    renderer: Renderer,
    task,
    probes: list[Probe],
    store: RecordStore,
    settings: RequestSettings,
    *,
    concurrency: int,
    feedback: FeedbackPoster,
    progress: Progress,
) -> list[Record]:
    """Answer every probe on one endpoint; returns the new records (also appended to the store)."""
    endpoint = Endpoint(client, store, settings, feedback)
    return await run_jobs([(endpoint, p) for p in probes], renderer, task, concurrency=concurrency, progress=progress)
