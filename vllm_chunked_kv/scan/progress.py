"""A one-line progress bar on stderr (redrawn at most 10 times a second)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, label: str, *, enabled: bool = True, stream: TextIO | None = None):
        self.total = total
        self.label = label
        self.enabled = enabled and total > 0
        self.stream = stream or sys.stderr
        self.done = 0
        self.correct = 0
        self.start = time.monotonic()
        self._last_draw = 0.0

    def update(self, correct: bool) -> None:
        self.done += 1
        self.correct += int(correct)
        now = time.monotonic()
        if self.enabled and (now - self._last_draw >= 0.1 or self.done == self.total):
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        width = 30
        filled = int(width * self.done / self.total)
        rate = self.done / max(now - self.start, 1e-9)
        accuracy = self.correct / self.done
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(
            f"\r{self.label} [{bar}] {self.done}/{self.total} {rate:.1f}/s acc {accuracy:.1%}"
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.done:
            self.stream.write("\n")
            self.stream.flush()
