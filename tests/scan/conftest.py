"""Fixtures of the scanner tests: a fake endpoint and a way to run the CLI in-process."""

from __future__ import annotations

import json

import pytest

from vllm_chunked_kv.commands.main import main

from .fake_server import FakeEndpoint

QUICK = ["--no-progress", "--retries", "1", "--backoff", "0.01", "--timeout", "10"]


@pytest.fixture
def fake():
    with FakeEndpoint() as endpoint:
        yield endpoint


@pytest.fixture
def scan(capsys, tmp_path):
    """scan(*args) -> (exit code, stdout, stderr); --out defaults to a fresh tmp dir, output is JSON."""

    def run(*args: str, out=None, json_output: bool = True):
        argv = ["scan", *QUICK, "--out", str(out or tmp_path / "scan"), *args]
        if json_output:
            argv.append("--json")
        code = main(argv)
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


def summary_of(stdout: str) -> dict:
    return json.loads(stdout)
