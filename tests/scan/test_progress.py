"""Contract of the progress bar: it draws done/total and accuracy on its stream, ends
the line when closed, and writes nothing when disabled."""

from __future__ import annotations

import io

from vllm_chunked_kv.scan.progress import Progress


def test_draws_and_closes():
    stream = io.StringIO()
    bar = Progress(2, "scan", stream=stream)
    bar.update(True)
    bar.update(False)
    bar.close()
    text = stream.getvalue()
    assert "2/2" in text and "acc 50.0%" in text and text.endswith("\n")


def test_disabled_is_silent():
    stream = io.StringIO()
    bar = Progress(3, "scan", enabled=False, stream=stream)
    bar.update(True)
    bar.close()
    assert stream.getvalue() == ""
