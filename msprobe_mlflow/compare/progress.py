"""A one-line progress display on stderr (tqdm is not a dependency): ``label: done/total (pct) elapsed``."""
from __future__ import annotations

import sys
import time


class ProgressLine:
    """Redrawn in place at most 5 times a second; by default shown only when stderr is a terminal."""

    def __init__(self, label: str, total: int, enabled: bool | None = None):
        self.label, self.total, self.done = label, total, 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._start = self._last_draw = time.monotonic()

    def advance(self, amount: int = 1) -> None:
        self.done += amount
        now = time.monotonic()
        if self.enabled and (now - self._last_draw >= 0.2 or self.done >= self.total):
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        percent = 100 * self.done / self.total if self.total else 100
        sys.stderr.write(f"\r{self.label}: {self.done}/{self.total} ({percent:.0f}%) {now - self._start:.1f}s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            sys.stderr.write("\n")
            sys.stderr.flush()
