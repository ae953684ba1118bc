"""The one progress display of every long command: a ``tqdm.auto`` bar on stderr (a widget in a notebook).

``enabled=None`` shows it on a terminal and in a notebook, never in a log or a pipe; ``enabled=True`` shows it
everywhere (in a log, about ten updates, at each tenth of the work); ``enabled=False`` prints nothing.
"""
from __future__ import annotations

import sys

from tqdm.auto import tqdm


class ProgressLine:
    """``label:  40%|████      | 4/10 [00:01<00:01,  3.90it/s, item]``, advanced by the caller as work is done."""

    def __init__(self, label: str, total: int, enabled: bool | None = None):
        self.label, self.total, self.done = label, total, 0
        in_a_log = enabled and not sys.stderr.isatty()
        pace = {"mininterval": 0, "miniters": max(1, total // 10)} if in_a_log else {}
        # disable=None is tqdm's own "not on a terminal" (its notebook bar takes None as shown).
        self._bar = tqdm(total=total, desc=label, file=sys.stderr, disable=None if enabled is None else not enabled,
                         **pace)

    def advance(self, amount: int = 1, item: str = "") -> None:
        self.done += amount  # counted here too: a disabled tqdm counts nothing
        self._bar.set_postfix_str(item, refresh=False)
        self._bar.update(amount)

    def close(self) -> None:
        self._bar.close()
