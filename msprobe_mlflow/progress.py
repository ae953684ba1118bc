"""The one progress display of every long command, on stderr (tqdm is not a dependency).

On a terminal, ``label: done/total (pct) elapsed  item`` is redrawn in place at most 5 times a second. Elsewhere
(CI logs, pipes), only when asked (``enabled=True``): a plain line at each tenth of the work and at the end.
"""
from __future__ import annotations

import sys
import time


class ProgressLine:
    def __init__(self, label: str, total: int, enabled: bool | None = None):
        self.label, self.total, self.done = label, total, 0
        self.interactive = sys.stderr.isatty()
        self.enabled = self.interactive if enabled is None else enabled
        self._start = self._last_draw = time.monotonic()
        self._next_plain_line = 0

    def advance(self, amount: int = 1, item: str = "") -> None:
        self.done += amount
        if not self.enabled:
            return
        now = time.monotonic()
        if self.interactive:
            if now - self._last_draw >= 0.2 or self.done >= self.total:
                self._last_draw = now
                sys.stderr.write("\r\033[K" + self._text(now, item)[:150])
        elif self.done >= self._next_plain_line or self.done >= self.total:
            self._next_plain_line = self.done + max(1, self.total // 10)
            sys.stderr.write(self._text(now, item) + "\n")
        sys.stderr.flush()

    def _text(self, now: float, item: str) -> str:
        percent = 100 * self.done / self.total if self.total else 100
        return f"{self.label}: {self.done}/{self.total} ({percent:.0f}%) {now - self._start:.1f}s  {item}".rstrip()

    def close(self) -> None:
        if self.enabled and self.interactive:
            sys.stderr.write("\n")
            sys.stderr.flush()
