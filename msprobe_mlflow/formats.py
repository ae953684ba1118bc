"""The floating-point formats a training computes in, by unit roundoff (half the gap between 1 and the next
number): what the noise rule judges the first steps against (``compare --precision``), what a monitor records with
each step's directions (``compute_format``), and how a pair's is found from its two runs'. And by range
(:data:`RANGES`): what each narrow format would lose of a step's gradients, read from their exponent counts
(:func:`format_losses`)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from msprobe_mlflow.statistics_table import ExponentCounts

UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "tf32": 2.0 ** -11, "float16": 2.0 ** -11,
                 "bfloat16": 2.0 ** -8}


def added_rounding(fmt: str, size: int) -> float:
    """The rounding one call adds to its result, relative: sums over ``size`` terms in ``fmt``, where a
    half-precision result is accumulated in float32 and rounded once (autocast's products and reductions, on CPUs
    and GPUs alike)."""
    if UNIT_ROUNDOFF[fmt] > UNIT_ROUNDOFF["float32"]:
        return UNIT_ROUNDOFF[fmt] + UNIT_ROUNDOFF["float32"] * math.sqrt(size)
    return UNIT_ROUNDOFF[fmt] * math.sqrt(size)


def coarsest(formats: Iterable[str | None]) -> str | None:
    """The coarsest of ``formats`` (the largest unit roundoff; the first of equals); None when any is None (not
    known) or there is none."""
    formats = list(formats)
    if not formats or any(found is None for found in formats):
        return None
    return max(formats, key=UNIT_ROUNDOFF.__getitem__)


@dataclass(frozen=True)
class Range:
    """A format's range by binary exponent ``e = floor(log2|x|)``: an element at ``e < least_subnormal - 1``
    becomes zero, one below ``least_normal`` a subnormal (fewer significant bits; from ``least_subnormal - 1`` it
    rounds to the least subnormal), one at ``e >= overflow`` is beyond the largest finite value (inf; NaN in FP8
    E4M3, which has no inf). Read by exponent, the edges are exact but for the top binade's values that round
    past the largest finite one (float16: 65520 to 65535), counted as finite, and exactly ``2**(least_subnormal -
    1)``, which rounds to zero and is counted as subnormal."""

    least_subnormal: int
    least_normal: int
    overflow: int


RANGES = {"float16": Range(-24, -14, 16), "bfloat16": Range(-133, -126, 128), "fp8_e4m3": Range(-9, -6, 9),
          "fp8_e5m2": Range(-16, -14, 16)}
LOSSES = ("underflow", "subnormal", "overflow")


def scale_exponent(loss_scale: float | None) -> int:
    """The loss scale as a power of two (GradScaler's and MindSpore's dynamic scales are powers of two; another
    scale is taken at the power of two at or below it). None (no scale in use): 0."""
    if loss_scale is None or not math.isfinite(loss_scale) or loss_scale <= 0:
        return 0
    return math.floor(math.log2(loss_scale))


def format_losses(exponent_counts: ExponentCounts, loss_scale: float | None = None) -> dict[str, np.ndarray]:
    """Per format of :data:`RANGES`, per parameter (a row of ``exponent_counts`` each), the elements that would
    underflow to zero, become subnormal and overflow (int64, one column each, :data:`LOSSES`' order) if the
    gradients were held in that format at ``loss_scale`` (:func:`scale_exponent`). Zeros and non-finite elements
    are neither."""
    counts = exponent_counts.kept[:, :-2]
    below = np.concatenate([np.zeros((len(counts), 1), np.int64), np.cumsum(counts, axis=1)], axis=1)
    shift = scale_exponent(loss_scale)

    def below_exponent(exponent: int) -> np.ndarray:  # elements whose scaled exponent is below ``exponent``
        return below[:, min(max(exponent - shift - exponent_counts.lowest, 0), counts.shape[1])]

    losses = {}
    for name, limits in RANGES.items():
        zero, normal, overflow = (below_exponent(e) for e in (limits.least_subnormal - 1, limits.least_normal,
                                                                 limits.overflow))
        losses[name] = np.column_stack([zero, normal - zero, below[:, -1] - overflow])
    return losses


@dataclass(frozen=True)
class LossyFormat:
    """What the anomaly flags watch for with ``lossy_format``: the first step at which ``format`` would hold more
    than ``share`` of the gradient elements outside its normal range, at the step's loss scale: underflowed to
    zero, subnormal (fewer significant bits, down to one) or overflowed. Subnormals count: in a float16 run whose
    loss scale is too small, the elements that underflowed are zeros by the time they are recorded, and the ones
    left are mostly subnormal."""

    format: str
    share: float = 0.01

    def __post_init__(self):
        if self.format not in RANGES:
            raise ValueError(f"lossy_format = {self.format!r} is not accepted; expected one of "
                             f"{', '.join(map(repr, RANGES))}, or None")
        if isinstance(self.share, bool) or not isinstance(self.share, (int, float)) or not 0 < self.share < 1:
            raise ValueError(f"lossy_share = {self.share!r} is not accepted; expected a number between 0 and 1 (the "
                             f"share of a step's gradient elements, e.g. 0.01)")

    def losses(self, names: list[str], exponent_counts: ExponentCounts, loss_scale: float | None
               ) -> tuple[float, list[tuple[str, float]]] | None:
        """None where the step loses no more than ``share``; else the share it loses and the parameters that lose
        more than ``share`` of their own elements, most first, with their shares."""
        lost = format_losses(exponent_counts, loss_scale)[self.format].sum(axis=1)
        numels = exponent_counts.kept.sum(axis=1)
        total = int(numels.sum())
        if not total or lost.sum() / total <= self.share:
            return None
        shares = lost / np.maximum(numels, 1)
        order = np.argsort(-shares, kind="stable")
        return float(lost.sum() / total), [(names[i], float(shares[i])) for i in order if shares[i] > self.share]
