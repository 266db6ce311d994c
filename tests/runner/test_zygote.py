"""Contract of `runner/zygote.py`: each run is a fresh child of a zygote.

- a run sees exactly the caller's environment plus its own `env` (a variable
  given to one run is gone in the next), and the zygote's imports; runs
  differing only in ``CHUNKED_KV_*`` or ``PYTEST_*`` variables (pytest sets
  PYTEST_CURRENT_TEST for every test) share a zygote, any other difference
  gets its own (it may matter at import time);
- runs share no state: a module-level counter starts afresh every time,
  and the child is a new process each time while the zygote is reused;
- what the child prints is returned as ``log``; an exception fails the
  call with the child's traceback; a run past its timeout raises
  `subprocess.TimeoutExpired`, and the next call works (a new zygote).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from vllm_chunked_kv.runner import zygote

COUNTER = []
LIGHT = ("json",)  # these tests do not need vLLM imported


def describe(spec: dict) -> dict:
    COUNTER.append(1)
    print("hello from", os.getpid(), flush=True)
    print("and to stderr", file=sys.stderr, flush=True)
    return {"pid": os.getpid(), "parent": os.getppid(), "counter": len(COUNTER), "spec": spec,
            "probe": os.environ.get("CHUNKED_KV_ZYGOTE_PROBE"), "other": os.environ.get("ZYGOTE_OTHER"),
            "preloaded": "json" in sys.modules}


def fail(spec: dict) -> dict:
    raise ValueError("planted failure " + spec["why"])


def sleep(spec: dict) -> dict:
    time.sleep(spec["seconds"])
    return {}


def run(fn: str, spec: dict, **kwargs) -> dict:
    return zygote.run_forked(f"{__name__}:{fn}", spec, timeout=60, preload=LIGHT, **kwargs)


def test_each_run_is_a_fresh_child_with_its_own_environment(monkeypatch):
    first = run("describe", {"n": 1}, env={"CHUNKED_KV_ZYGOTE_PROBE": "set"})
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test")
    second = run("describe", {"n": 2})
    assert first["spec"] == {"n": 1} and second["spec"] == {"n": 2}
    assert first["probe"] == "set" and second["probe"] is None
    assert first["counter"] == second["counter"] == 1  # no state carried over
    assert first["pid"] != second["pid"] != os.getpid()
    assert first["parent"] == second["parent"] != os.getpid()  # one zygote forked both
    assert first["preloaded"]
    assert f"hello from {first['pid']}" in first["log"] and "and to stderr" in first["log"]
    other = run("describe", {}, env={"ZYGOTE_OTHER": "x"})
    assert other["other"] == "x" and other["parent"] != first["parent"]


def test_failure_carries_the_childs_traceback():
    with pytest.raises(RuntimeError, match="planted failure here"):
        run("fail", {"why": "here"})
    assert run("describe", {})["counter"] == 1  # the zygote survives a failed child


def test_timeout_kills_the_run_and_the_next_call_works():
    before = run("describe", {})["parent"]
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run_forked(f"{__name__}:sleep", {"seconds": 30}, timeout=1, preload=LIGHT)
    after = run("describe", {})["parent"]
    assert after != before  # the killed zygote was replaced
