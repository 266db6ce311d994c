"""Contract of `vllm-chunked-kv scan` against the fake endpoint.

- Planted effect (p(correct) 0.95 at phases 0, 1, 2 and 0.55 at phase 3 of
  the target's position): the offset probe finds period 4, both probes name
  phase 3 worst, and the planted 40-point gap and phase-3 accuracy lie
  within about 3 standard errors of the reported ones (the 95% interval
  widened by half its width); the chi-square test rejects independence.
- The needle-keyed endpoint shows nothing on the `length` axis.
- Phase-independent endpoint: no period, no significant dependence, on any axis.
- Output: `--json` prints the summary on stdout; records (JSONL, CSV),
  summary.json and the PNG are written; without a tokenizer the units are characters.
- A failure midway keeps the answers; re-running sends only the missing probes
  and ends with the full result.
- Errors (unreachable server, wrong model, HTTP 500 after retries, malformed
  JSONL, settings mismatch): exit 1 and exactly one line on stderr, no traceback,
  also through the installed console script.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import summary_of
from .fake_server import FakeEndpoint, free_port

SIZES = ["--prompts", "48", "--per-phase", "96"]
PLANTED_GAP = 0.40


def _near(ci: list[float], planted: float) -> bool:
    """The planted value lies in the 95% interval widened by a quarter of its
    width on each side (about 3 standard errors): four 95% intervals of one
    fixed sample would each miss 1 time in 20."""
    lo, hi = ci
    return lo - (hi - lo) / 4 <= planted <= hi + (hi - lo) / 4


def _assert_one_line_error(code, err, fragment):
    assert code == 1
    assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert fragment in err
    assert "Traceback" not in err


def test_planted_period_and_gap_are_recovered(fake, scan, tmp_path):
    code, out, err = scan("--base-url", fake.base_url, *SIZES, "--feedback")
    assert code == 0, err
    summary = summary_of(out)
    offset, needle = summary["results"]["offset"], summary["results"]["needle"]
    assert summary["units"] == "tokens" and summary["model"] == "fake-model"
    assert offset["period"]["period"] == 4
    for result in (offset, needle):
        assert result["worst_phase"] == 3
        assert _near(result["gap"]["ci"], PLANTED_GAP)
        assert result["chi2"]["p_value"] < 1e-3
        assert _near(result["by_phase"][3]["ci"], 0.55)
    length = summary["results"]["length"]  # the prompt length does not matter to this server
    assert length["chi2"]["p_value"] > 1e-3 and length["period"]["period"] is None
    means = [row["position_mean"] for row in needle["by_phase"]]
    sds = [row["position_sd"] for row in needle["by_phase"]]
    assert max(means) - min(means) < 1e-9 and max(sds) - min(sds) < 0.5  # position-matched groups
    assert summary["feedback"] == {"route": "present", "posted": 2 * 8 * 48 + 4 * 96, "rejected": 0}
    files = summary["files"]
    assert open(files["plot"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert len(open(files["records"]).readlines()) == 2 * 8 * 48 + 4 * 96
    assert json.load(open(files["summary"]))["results"] == summary["results"]


def test_phase_independent_endpoint_has_no_period(scan):
    with FakeEndpoint(accuracy=(0.8,) * 4) as fake:
        code, out, err = scan("--base-url", fake.base_url, *SIZES)
    assert code == 0, err
    results = summary_of(out)["results"]
    assert set(results) == {"offset", "needle", "length"}
    for result in results.values():
        assert result["chi2"]["p_value"] > 1e-3
        assert result["period"]["period"] is None


def test_text_output_and_character_units(scan):
    with FakeEndpoint(tokenize=False) as fake:
        code, out, err = scan("--base-url", fake.base_url, "--prompts", "4", "--per-phase", "8", json_output=False)
    assert code == 0, err
    assert "units chars, hop 4 (default)" in out
    assert "offset probe (filler in front: target and prompt end move together): 32 probes" in out
    assert "needle probe (target phase varies, prompt length fixed): 32 probes" in out
    assert "length probe (prompt length varies, target fixed): 32 probes" in out
    assert "dominant period" in out and "worst phase" in out


def test_hop_comes_from_the_server_unless_given(scan, tmp_path):
    with FakeEndpoint(accuracy=(0.9, 0.5), config_hop=2) as fake:
        code, out, err = scan("--base-url", fake.base_url, "--prompts", "4", "--per-phase", "8")
        assert code == 0, err
        summary = summary_of(out)
        assert (summary["hop"], summary["hop_source"]) == (2, "server")
        assert [row["offset"] for row in summary["results"]["offset"]["by_offset"]] == [0, 1, 2, 3]
        code, out, err = scan("--base-url", fake.base_url, "--prompts", "4", "--per-phase", "8", "--hop", "4",
                              out=tmp_path / "other")
        assert (summary_of(out)["hop"], summary_of(out)["hop_source"]) == (4, "--hop")
    with FakeEndpoint() as fake:
        code, out, err = scan("--base-url", fake.base_url, "--prompts", "4", "--per-phase", "8", out=tmp_path / "third")
        assert (summary_of(out)["hop"], summary_of(out)["hop_source"]) == (4, "default")


def test_resume_after_the_server_fails_midway(scan, tmp_path):
    args = ["--prompts", "8", "--per-phase", "16", "--probe", "both"]
    total = 8 * 8 + 4 * 16
    with FakeEndpoint(fail_after=50) as fake:
        code, out, err = scan("--base-url", fake.base_url, *args)
        _assert_one_line_error(code, err, "HTTP 500")
        assert "50 answers are kept" in err and "re-run" in err
        assert len((tmp_path / "scan" / "records.csv").read_text().splitlines()) == 1 + 50
        fake.fail_after = None
        before = fake.completions_served
        code, out, err = scan("--base-url", fake.base_url, *args)
        assert code == 0, err
        summary = summary_of(out)
        assert (summary["resumed"], summary["sent"]) == (50, total - 50)
        assert fake.completions_served - before == total - 50
        assert sum(r["probes"] for r in summary["results"].values()) == total


def test_unreachable_server(scan):
    code, _, err = scan("--base-url", f"http://127.0.0.1:{free_port()}")
    _assert_one_line_error(code, err, "cannot reach")


def test_wrong_model_name(fake, scan):
    code, _, err = scan("--base-url", fake.base_url, "--model", "gpt-9")
    _assert_one_line_error(code, err, "model 'gpt-9' is not served")


def test_http_500_after_retries(scan):
    with FakeEndpoint(fail_first=10**6) as fake:
        code, _, err = scan("--base-url", fake.base_url, "--prompts", "2", "--per-phase", "4")
    _assert_one_line_error(code, err, "HTTP 500: engine dead (after 2 attempts)")


def test_malformed_jsonl(fake, scan, tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"template": "{record} ? k1", "record": "k1 v1", "answer": "v1"}\n{"template": 3}\n')
    code, _, err = scan("--base-url", fake.base_url, "--task", str(path))
    _assert_one_line_error(code, err, "mine.jsonl:2: 'template' must be a non-empty string")
    assert fake.completion_requests == 0


def test_user_task_end_to_end(fake, scan, tmp_path):
    path = tmp_path / "mine.jsonl"
    lines = [{"template": "f1 f2 {record} f3 ? k3", "record": "k3 v9", "answer": "v9", "filler": "f0"},
             {"template": "f5 {record} f6 f7 ? k4", "record": "k4 v2", "answer": "v2"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, out, err = scan("--base-url", fake.base_url, "--task", str(path), "--prompts", "8", "--per-phase", "32")
    assert code == 0, err
    results = summary_of(out)["results"]
    # The record's first token is the key; the fake judges the value one token later.
    assert results["needle"]["worst_phase"] == 2
    assert results["needle"]["chi2"]["p_value"] < 0.05


def test_changed_settings_are_refused(fake, scan, tmp_path):
    assert scan("--base-url", fake.base_url, "--prompts", "2", "--per-phase", "4")[0] == 0
    code, _, err = scan("--base-url", fake.base_url, "--prompts", "2", "--per-phase", "4", "--hop", "2")
    _assert_one_line_error(code, err, "holds a scan with other settings")


def test_console_script_prints_no_traceback(tmp_path):
    command = [sys.executable, "-m", "vllm_chunked_kv.commands.main", "scan", "--base-url", f"http://127.0.0.1:{free_port()}",
               "--retries", "0", "--out", str(tmp_path / "s")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.startswith("error: cannot reach") and done.stderr.count("\n") == 1


@pytest.mark.parametrize("bad", [["--hop", "1"], ["--per-phase", "10"], ["--offsets", "1"]])
def test_bad_plan_is_one_line(fake, scan, bad):
    code, _, err = scan("--base-url", fake.base_url, *bad)
    assert code == 1 and err.count("\n") == 1 and err.startswith("error: --")
