"""Contract of target placement (scan/placement.py) and the inside/outside-window split.

- Geometry: `--window` overrides the server's window, the server's
  (`GET /v1/chunked_kv/config`) is used when there is one, else a long window
  (512) is assumed; chunk size falls back to the hop. A target is outside the
  raw window when it has >= window + chunk_size units after it and starts
  past the sinks.
- Tasks, once placed: every needle and offset target (user tasks and the kv
  task, default and explicit ranges) has at least `min_distance` units after
  it and starts past the sinks; without a placement the kv task keeps its
  old default range.
- Without the config route a 512-token window is assumed (`--window` overrides
  it). Scan against a server reporting window 40: every record carries its
  distance, all targets are outside, no warning. With `--window 0` against
  the same server the targets fall inside the server's window: the summary
  counts them as inside and the text output warns in one line.
- `--needle-range` accepts `LO:HI`, `LO HI` and `"LO HI"`; anything else is
  refused naming both forms.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from vllm_chunked_kv.commands.main import main
from vllm_chunked_kv.scan.client import EndpointClient
from vllm_chunked_kv.scan.placement import ASSUMED_WINDOW, Geometry, geometry_from
from vllm_chunked_kv.scan.render import Renderer
from vllm_chunked_kv.scan.tasks import KVTask, UserTask

from .conftest import summary_of
from .fake_server import FakeEndpoint

SERVER = {"window": 40, "chunk_size": 4, "sink_tokens": 4}
LINES = [
    {"template": "f1 f2 {record} f3 ? k3", "record": "k3 v9", "answer": "v9", "filler": "f0"},
    {"template": "f5 f6 f7 f8 f9 {record} ? k4", "record": "k4 v2", "answer": "v2"},
]


def test_geometry_precedence():
    assert geometry_from(SERVER, None, 4) == Geometry(40, 4, 4, "server")
    assert geometry_from(SERVER, 100, 4) == Geometry(100, 4, 4, "--window")
    assert geometry_from(None, None, 2) == Geometry(ASSUMED_WINDOW, 2, 4, "assumed")
    assert geometry_from({"window": 64}, None, 3).chunk_size == 3  # chunk size from the hop


def test_outside_rule():
    g = Geometry(40, 4, 4, "server")
    assert g.min_distance == 44
    assert g.outside(10, 44) and not g.outside(10, 43)
    assert not g.outside(3, 100)  # a sink
    assert g.scaled("chars").min_distance == 4 * 44 and g.scaled("tokens") == g


def _placed(fake, task, geometry, action):
    async def go():
        async with EndpointClient(fake.base_url, retries=0) as client:
            renderer = Renderer(client, "fake-model")
            await task.place(renderer, geometry, 4, [])
            return await action(renderer)

    return asyncio.run(go())


async def _render_all(renderer, groups):
    return [await renderer.render(item.segments) for items in groups for item in items]


@pytest.mark.parametrize("span", [None, (10, 30)])
def test_user_task_targets_are_older_than_the_window(fake, tmp_path, span):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    geometry = Geometry(40, 4, 4, "server")

    async def both(renderer):
        task_needles = await task.needle_items(renderer, 4, 8, 0, span)
        offsets = await task.offset_items(renderer, 4, 0, None)
        return await _render_all(renderer, [*task_needles.values(), offsets])

    task = UserTask(path)
    rendered = _placed(fake, task, geometry, both)
    assert rendered and all(r.distance >= 44 and r.target_position >= 4 for r in rendered)
    assert min(r.distance for r in rendered) < 44 + 16  # padded to the window, not far beyond it


def test_kv_task_grows_its_haystack_past_the_window(fake):
    task = KVTask(haystack_len=60, num_records=8)
    geometry = Geometry(100, 4, 4, "server")

    async def both(renderer):
        needles = await task.needle_items(renderer, 4, 8, 0, None)
        offsets = await task.offset_items(renderer, 4, 0, None)
        return await _render_all(renderer, [*needles.values(), offsets])

    rendered = _placed(fake, task, geometry, both)
    assert task.haystack_len > 60
    assert all(r.distance >= 104 and r.target_position >= 4 for r in rendered)
    for r in rendered:  # the target is the value token: the word after the queried key's first use
        assert fake.words[r.prompt[r.target_position - 1]] == fake.words[r.prompt[-1]]


def test_unplaced_kv_task_keeps_its_default_range(fake):
    task = KVTask(haystack_len=240, num_records=48)

    async def go():
        async with EndpointClient(fake.base_url, retries=0) as client:
            groups = await task.needle_items(Renderer(client, "fake-model"), 4, 8, 0, None)
        return [p for items in groups.values() for p in items]

    assert len(asyncio.run(go())) == 32 and task.haystack_len == 240


def _scan(capsys, tmp_path, url, *extra, json_output=True):
    argv = ["scan", "--no-progress", "--retries", "1", "--timeout", "10", "--base-url", url, "--probe", "needle",
            "--per-phase", "8", "--out", str(tmp_path / "scan"), "--fresh", "--no-plot", *extra]
    code = main(argv + (["--json"] if json_output else []))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_scan_places_beyond_the_servers_window(capsys, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    with FakeEndpoint(config_hop=4, config=SERVER) as fake:
        code, out, err = _scan(capsys, tmp_path, fake.base_url, "--task", str(path))
        assert code == 0, err
        summary = summary_of(out)
        window = summary["results"]["needle"]["window"]
        assert summary["placement"]["source"] == "server" and window["window"] == 40
        assert window["outside"]["n"] == 32 and window["inside"]["n"] == 0
        records = [json.loads(line) for line in (tmp_path / "scan" / "records.jsonl").read_text().splitlines()]
        assert all(r["distance"] >= 44 for r in records)

        code, out, err = _scan(capsys, tmp_path, fake.base_url, "--task", str(path), "--window", "0",
                               json_output=False)
        assert code == 0, err
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "inside the raw window" in warnings[0]
    assert "inside: " in out and "window 40 from server" in out


@pytest.mark.parametrize("form", [["30:330"], ["30", "330"], ["30 330"]])
def test_needle_range_forms(form):
    from vllm_chunked_kv.scan.cli import add_arguments
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--needle-range", *form]).needle_range == (30, 330)


def test_needle_range_bad_form_names_both(capsys):
    from vllm_chunked_kv.scan.cli import add_arguments
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--needle-range", "30-330"])
    err = capsys.readouterr().err
    assert "LO:HI or LO HI" in err


def test_scan_without_the_config_route_assumes_a_long_window(capsys, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    with FakeEndpoint() as fake:  # no /v1/chunked_kv/config
        code, out, err = _scan(capsys, tmp_path, fake.base_url, "--task", str(path))
        assert code == 0, err
        assert summary_of(out)["placement"] == {"window": ASSUMED_WINDOW, "chunk_size": 4, "sink_tokens": 4,
                                                "min_distance": ASSUMED_WINDOW + 4, "source": "assumed"}
        code, out, err = _scan(capsys, tmp_path, fake.base_url, "--task", str(path), "--window", "40")
        assert summary_of(out)["placement"]["source"] == "--window"
    records = [json.loads(line) for line in (tmp_path / "scan" / "records.jsonl").read_text().splitlines()]
    assert records and all(r["distance"] >= 44 for r in records)
