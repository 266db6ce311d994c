"""Contract of the probe runner.

- Every probe is answered once and recorded on disk as it arrives, judged by the task.
- No more than `concurrency` requests are in flight at once.
- Feedback: each outcome is posted with the completion's id while the route
  exists; a missing route (404 'Not Found') warns once and stops posting;
  a rejected post (unknown id) is counted, not fatal.
"""

from __future__ import annotations

import asyncio

from vllm_chunked_kv.scan.client import EndpointClient
from vllm_chunked_kv.scan.probes import ProbePlan, build_probes
from vllm_chunked_kv.scan.progress import Progress
from vllm_chunked_kv.scan.records import RecordStore
from vllm_chunked_kv.scan.render import Renderer
from vllm_chunked_kv.scan.runner import FeedbackPoster, RequestSettings, run_probes
from vllm_chunked_kv.scan.tasks import KVTask

from .fake_server import FakeEndpoint

PLAN = ProbePlan(hop=4, num_offsets=8, prompts=3, per_phase=4, seed=0)


async def _run(fake: FakeEndpoint, tmp_path, *, concurrency=4, feedback=True):
    async with EndpointClient(fake.base_url, retries=0) as client:
        renderer = Renderer(client, "fake-model")
        task = KVTask(haystack_len=60, num_records=8)
        probes = await build_probes(["offset", "needle"], task, renderer, PLAN)
        store = RecordStore(tmp_path)
        poster = FeedbackPoster(client, feedback)
        records = await run_probes(
            client, renderer, task, probes, store, RequestSettings("fake-model", 4, 1, 0.0, None),
            concurrency=concurrency, feedback=poster, progress=Progress(len(probes), "t", enabled=False),
        )
        store.close()
        return probes, records, store, poster


def test_every_probe_is_answered_once_and_recorded(fake, tmp_path):
    probes, records, store, _ = asyncio.run(_run(fake, tmp_path))
    assert sorted(r.probe_id for r in records) == sorted(p.probe_id for p in probes)
    assert store.load().keys() == {p.probe_id for p in probes}
    for record in records:
        assert record.correct == (record.completion.split() == [record.answer])
        assert record.phase == record.position % 4


def test_concurrency_limit(tmp_path):
    with FakeEndpoint(delay_s=0.02) as fake:
        asyncio.run(_run(fake, tmp_path, concurrency=3, feedback=False))
        assert fake.max_in_flight == 3


def test_feedback_is_posted_with_the_completion_ids(fake, tmp_path):
    _, records, _, poster = asyncio.run(_run(fake, tmp_path))
    posted = {(p["request_id"], p["correct"]) for p in fake.feedback_posts}
    assert posted == {(r.request_id, r.correct) for r in records}
    assert poster.summary() == {"route": "present", "posted": len(records), "rejected": 0}


def test_missing_feedback_route_warns_once_and_stops(tmp_path, capsys):
    with FakeEndpoint(feedback=False) as fake:
        _, records, _, poster = asyncio.run(_run(fake, tmp_path, concurrency=1))
    err = capsys.readouterr().err
    assert err.count("no feedback route") == 1
    assert poster.summary() == {"route": "missing", "posted": 0, "rejected": 0}


def test_rejected_feedback_is_counted(fake, capsys):
    async def go():
        async with EndpointClient(fake.base_url, retries=0) as client:
            poster = FeedbackPoster(client, True)
            await poster.post("cmpl-unknown", True)
            await poster.post("cmpl-unknown-2", False)
            return poster

    poster = asyncio.run(go())
    assert poster.summary() == {"route": "unknown", "posted": 0, "rejected": 2}
    assert capsys.readouterr().err.count("feedback rejected") == 1
