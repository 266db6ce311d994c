"""The model fetcher's one error type: its message is the single line the user sees."""

from __future__ import annotations


class ModelFetchError(Exception):
    """A failure to report as one line on stderr with a non-zero exit (no traceback)."""
