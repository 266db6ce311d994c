"""Contract of the scan tasks.

- kv task: the target segment starts with the answer; rendered in a word-level
  server's tokens, the target sits exactly at the planned position; offset
  items share one target position; needle items have the phase they were
  drawn for.
- User tasks: every malformed line is one ScanError naming the file and line;
  offset items put every record at the same position and give every prompt
  the same length; needle items move only the record (each line's prompt
  length stays fixed) and land on their phase.
- Length items (kv and user): one prompt length, targets at every phase
  equally; growing the slot by k adds k units to the length and leaves the
  target where it is, still followed by the question.
- Correctness of user tasks: the completion starts with the answer.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from vllm_chunked_kv.scan.client import EndpointClient
from vllm_chunked_kv.scan.errors import ScanError
from vllm_chunked_kv.scan.items import grown
from vllm_chunked_kv.scan.render import Renderer, Target
from vllm_chunked_kv.scan.tasks import KVTask, UserTask

USER_LINES = [
    {"template": "f1 f2 {record} f3 ? k3", "record": "k3 v9", "answer": "v9", "filler": "f0"},
    {"template": "f1 f2 f4 f5 f6 {record} ? k4", "record": "k4 v1", "answer": "v1"},
]


async def _with_renderer(url: str, action):
    async with EndpointClient(url, retries=0) as client:
        return await action(Renderer(client, "fake-model"))


def _write(tmp_path, lines) -> str:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return str(path)


def test_kv_offset_items_share_the_target_position(fake):
    task = KVTask(haystack_len=60, num_records=8)

    async def go(renderer):
        items = await task.offset_items(renderer, 5, seed=3, position=30)
        return items, [await renderer.render(item.segments) for item in items]

    items, rendered = asyncio.run(_with_renderer(fake.base_url, go))
    assert {r.target_position for r in rendered} == {30}
    for item, r in zip(items, rendered):
        target = next(s for s in item.segments if isinstance(s, Target))
        assert target.text.split()[0] == item.answer
        assert fake.words[r.prompt[30]] == item.answer
    assert len({tuple(r.prompt) for r in rendered}) == 5  # distinct prompts


def test_kv_needle_items_land_on_their_phase(fake):
    task = KVTask(haystack_len=60, num_records=8)

    async def go(renderer):
        groups = await task.needle_items(renderer, hop=4, per_phase=8, seed=0, span=None)
        return {phase: [await renderer.render(i.segments) for i in items] for phase, items in groups.items()}

    rendered = asyncio.run(_with_renderer(fake.base_url, go))
    assert sorted(rendered) == [0, 1, 2, 3]
    for phase, group in rendered.items():
        assert len(group) == 8
        assert all(r.target_position % 4 == phase for r in group)


@pytest.mark.parametrize(
    "lines, message",
    [
        (["{not json"], "tasks.jsonl:1: not valid JSON"),
        ([USER_LINES[0], "[1, 2]"], "tasks.jsonl:2: expected a JSON object"),
        ([{"template": "{record}", "record": "r"}], "tasks.jsonl:1: 'answer' must be a non-empty string"),
        ([{"template": "no slot", "record": "r", "answer": "a"}], "exactly once"),
        ([{"template": "{record}{record}", "record": "r", "answer": "a"}], "exactly once"),
        ([{"template": "{record}", "record": "r", "answer": "a", "filler": ""}], "'filler' must be"),
        ([{"template": "{record}", "record": "r", "answer": "a", "extra": 1}], "unknown key(s) extra"),
        ([""], "no tasks"),
    ],
)
def test_malformed_jsonl_names_the_line(tmp_path, lines, message):
    with pytest.raises(ScanError) as info:
        UserTask(_write(tmp_path, lines))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ScanError, match="cannot read task file"):
        UserTask(tmp_path / "absent.jsonl")


def test_user_offset_items_align_the_records(fake, tmp_path):
    task = UserTask(_write(tmp_path, USER_LINES))

    async def go(renderer):
        items = await task.offset_items(renderer, 4, seed=0, position=None)
        return [await renderer.render(i.segments) for i in items]

    rendered = asyncio.run(_with_renderer(fake.base_url, go))
    positions = {r.target_position for r in rendered}
    assert positions == {1 + 5}  # <bos> + the longer head (5 words)
    assert {fake.words[r.prompt[6]] for r in rendered} == {"k3", "k4"}
    assert len({r.length for r in rendered}) == 1  # the two lines' prompts differ by a word without padding


@pytest.mark.parametrize("kind", ["kv", "user"])
def test_length_items_grow_only_the_end(fake, tmp_path, kind):
    task = KVTask(haystack_len=60, num_records=8) if kind == "kv" else UserTask(_write(tmp_path, USER_LINES))

    async def go(renderer):
        items = await task.length_items(renderer, 8, seed=0, hop=4)
        return [[await renderer.render(grown(item, k).segments) for k in (0, 1, 5)] for item in items]

    rendered = asyncio.run(_with_renderer(fake.base_url, go))
    base = rendered[0][0].length
    assert sorted(r[0].target_position % 4 for r in rendered) == [0, 0, 1, 1, 2, 2, 3, 3]
    for versions in rendered:
        assert [r.length for r in versions] == [base, base + 1, base + 5]
        assert len({r.target_position for r in versions}) == 1
        assert [fake.words[r.prompt[-2]] for r in versions] == ["?"] * 3  # the question still ends the prompt


def test_user_needle_items_move_only_the_record(fake, tmp_path):
    task = UserTask(_write(tmp_path, USER_LINES))

    async def go(renderer):
        groups = await task.needle_items(renderer, hop=4, per_phase=8, seed=0, span=None)
        return {p: [await renderer.render(i.segments) for i in items] for p, items in groups.items()}

    rendered = asyncio.run(_with_renderer(fake.base_url, go))
    lengths = {0: set(), 1: set()}  # line -> prompt lengths seen
    for phase, group in rendered.items():
        for i, r in enumerate(group):
            assert r.target_position % 4 == phase
            assert fake.words[r.prompt[r.target_position]] in ("k3", "k4")
            lengths[i % 2].add(r.length)
    assert all(len(seen) == 1 for seen in lengths.values())


def test_user_correctness_reads_the_start(tmp_path):
    task = UserTask(_write(tmp_path, USER_LINES))
    assert task.is_correct("  4812 is the code", "4812")
    assert not task.is_correct("The code is 4812", "4812")
