"""Contract of prompt rendering in tokens and in characters.

- Tokens: the server's special prefix comes first, then each segment's tokens;
  the target position counts every unit before the target, prefix included;
  a fill is the filler's tokens cycled to the count.
- Characters: the segments joined; positions count characters.
- Identical texts are tokenized once.
"""

from __future__ import annotations

import asyncio

from vllm_chunked_kv.scan.client import EndpointClient
from vllm_chunked_kv.scan.render import Fill, Renderer, Target, Text

SEGMENTS = (Fill(3, "x y"), Text("a b "), Target("k1 v2 ? k1"))


async def _render_tokens(url: str, segments, repeat: int = 1):
    async with EndpointClient(url, retries=0) as client:
        renderer = Renderer(client, "fake-model")
        return [await renderer.render(segments) for _ in range(repeat)]


def test_tokens(fake):
    rendered = asyncio.run(_render_tokens(fake.base_url, SEGMENTS))[0]
    words = [fake.words[i] for i in rendered.prompt]
    assert words == ["<bos>", "x", "y", "x", "a", "b", "k1", "v2", "?", "k1"]
    assert rendered.target_position == 6
    assert rendered.length == len(words)


def test_identical_texts_are_tokenized_once(fake):
    asyncio.run(_render_tokens(fake.base_url, SEGMENTS, repeat=3))
    # "a" twice for the special prefix, then the filler and the two texts.
    assert fake.tokenize_requests == 5


def test_characters():
    rendered = asyncio.run(Renderer().render(SEGMENTS))
    assert rendered.prompt == "x ya b k1 v2 ? k1"
    assert rendered.target_position == len("x ya b ")
    assert rendered.length == len(rendered.prompt)


def test_zero_fill_and_no_target():
    rendered = asyncio.run(Renderer().render((Fill(0, "z"), Text("abc"))))
    assert (rendered.prompt, rendered.target_position, rendered.length) == ("abc", 3, 3)
