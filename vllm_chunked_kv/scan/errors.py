"""The scanner's one error type: its message is the single line the user sees."""

from __future__ import annotations

import asyncio
import sys


class ScanError(Exception):
    """A failure to report as one line on stderr with a non-zero exit (no traceback)."""


class Failed:
    """What `run_reporting` returns when the run failed (its line is already on stderr)."""


def run_reporting(coroutine):
    """Run `coroutine`; a ScanError becomes `error: <line>` on stderr and the result `Failed`."""
    try:
        return asyncio.run(coroutine)
    except ScanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return Failed
