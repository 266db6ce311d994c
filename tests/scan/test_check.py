"""Contract of `vllm-chunked-kv check` (one prompt, filler in front and at the end) against the fake endpoint.

Prompt `f1 f2 k3 v9 f3 f4 ? k3`: 9 tokens with `<bos>`, the value `v9` at position 4.

- Needle-keyed endpoint wrong only at phase 3: filler in front moves the
  value to 4 + k, so the answer changes exactly at k = 3 and 7 (phase 3,
  periodic); filler before the question (`--end-before "?"`) leaves the
  value where it is: stable. Exit status 3.
- Length-keyed endpoint wrong only at length phase 3: both sides change
  exactly where 9 + k = 3 (mod 4), i.e. k = 2 and 6.
- Flat endpoint: stable on both sides, exit 0.
- Filler after the question buries it (the fake then answers something
  else for every k > 0): unstable and not periodic.
- Hop: the server's config route when present (2: extras 0..3), `--hop` over it.
- The prompt from an argument, `--file` or stdin gives the same result;
  bad input is a one-line error.
"""

from __future__ import annotations

import io
import json

import pytest

from vllm_chunked_kv.commands.main import main

from .fake_server import FakeEndpoint

PROMPT = "f1 f2 k3 v9 f3 f4 ? k3"
QUICK = ["--retries", "0", "--timeout", "10"]


def _check(capsys, *args: str):
    code = main(["check", *QUICK, *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _json(capsys, *args: str) -> tuple[int, dict]:
    code, out, err = _check(capsys, *args, "--json")
    assert code in (0, 3), err
    return code, json.loads(out)


def test_needle_keyed_changes_only_in_front(capsys):
    with FakeEndpoint((1.0, 1.0, 1.0, 0.0)) as fake:
        code, result = _json(capsys, "--base-url", fake.base_url, PROMPT, "--end-before", "?")
    assert code == 3 and not result["stable"] and result["conclusion"] == "periodic"
    assert result["front"]["baseline"].strip() == "v9"
    assert result["front"]["changed_extras"] == [k for k in range(8) if (4 + k) % 4 == 3]
    assert result["front"]["phases"] == [3] and result["front"]["periodic"]
    assert result["end"]["changed_extras"] == []
    assert [a["length"] for a in result["end"]["answers"]] == [9 + k for k in range(8)]


def test_length_keyed_changes_on_both_sides(capsys):
    with FakeEndpoint((1.0, 1.0, 1.0, 0.0), keyed="length") as fake:
        code, result = _json(capsys, "--base-url", fake.base_url, PROMPT, "--end-before", "?")
    assert code == 3 and result["conclusion"] == "periodic"
    for side in ("front", "end"):
        assert result[side]["changed_extras"] == [k for k in range(8) if (9 + k) % 4 == 3]
        assert result[side]["length_phases"] == [3]


def test_flat_endpoint_is_stable_and_text_says_so(capsys):
    with FakeEndpoint((1.0,) * 4) as fake:
        code, out, err = _check(capsys, "--base-url", fake.base_url, PROMPT, "--end-before", "?")
    assert code == 0, err
    assert out.strip().splitlines()[-1].startswith("stable:")
    assert out.count("  same") == 2 * 8


def test_filler_after_the_question_is_not_periodic(capsys):
    with FakeEndpoint((1.0,) * 4) as fake:
        code, result = _json(capsys, "--base-url", fake.base_url, PROMPT)
    assert code == 3 and result["conclusion"] == "unstable"
    assert result["end"]["changed_extras"] == list(range(1, 8)) and not result["end"]["periodic"]
    assert result["front"]["changed_extras"] == []


def test_hop_from_the_server_unless_given(capsys):
    with FakeEndpoint((1.0,) * 4, config_hop=2) as fake:
        _, result = _json(capsys, "--base-url", fake.base_url, PROMPT)
        assert (result["hop"], result["hop_source"]) == (2, "server")
        assert [a["extra"] for a in result["front"]["answers"]] == [0, 1, 2, 3]
        _, result = _json(capsys, "--base-url", fake.base_url, PROMPT, "--hop", "3")
        assert (result["hop"], result["hop_source"], len(result["front"]["answers"])) == (3, "--hop", 6)


def test_prompt_from_file_and_stdin(capsys, tmp_path, monkeypatch):
    path = tmp_path / "prompt.txt"
    path.write_text(PROMPT)
    with FakeEndpoint((1.0, 1.0, 1.0, 0.0)) as fake:
        results = [_json(capsys, "--base-url", fake.base_url, PROMPT)[1],
                    _json(capsys, "--base-url", fake.base_url, "--file", str(path))[1]]
        monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT))
        results.append(_json(capsys, "--base-url", fake.base_url)[1])
    assert results[0]["front"]["changed_extras"] == [3, 7]
    assert results[0] == results[1] == results[2]


@pytest.mark.parametrize("args, message", [
    ([PROMPT, "--end-before", "!"], "--end-before '!' does not occur"),
    ([PROMPT, "--file", "x.txt"], "not both"),
    (["--file", "/nonexistent/p.txt"], "cannot read"),
    (["   "], "the prompt is empty"),
])
def test_bad_input_is_one_line(capsys, args, message):
    with FakeEndpoint() as fake:
        code, _, err = _check(capsys, "--base-url", fake.base_url, *args)
    assert code == 1 and err.count("\n") == 1 and message in err
