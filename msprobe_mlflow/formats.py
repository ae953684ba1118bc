"""The floating-point formats a training computes in, by unit roundoff (half the gap between 1 and the next
number): what the noise rule judges the first steps against (``compare --precision``), what a monitor records with
each step's directions (``compute_format``), and how a pair's is found from its two runs'."""
from __future__ import annotations

from typing import Iterable

UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "tf32": 2.0 ** -11, "float16": 2.0 ** -11,
                 "bfloat16": 2.0 ** -8}


def coarsest(formats: Iterable[str | None]) -> str | None:
    """The coarsest of ``formats`` (the largest unit roundoff; the first of equals); None when any is None (not
    known) or there is none."""
    formats = list(formats)
    if not formats or any(found is None for found in formats):
        return None
    return max(formats, key=UNIT_ROUNDOFF.__getitem__)
