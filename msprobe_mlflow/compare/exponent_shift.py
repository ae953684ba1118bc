"""How far run B's gradients moved among the binary exponents against run A's at a step, from the exponent counts
both monitors recorded (``statistics=["exponents"]``): the share of the elements that are zero (an underflow
flushes small gradients to zero) and the mean exponent ``floor(log2|g|)`` of the other finite elements (a lost loss
scale or a narrower format moves them), each B's minus A's, for the model and per parameter.

Reported beside the verdict (``compare``'s table, ``verdict.json``, the comparison run's metrics), not a reason for
it: its limits below were set beforehand from what rounding can do, not measured on pairs, and the divergence
benchmark's dumps hold no exponent counts yet. Rounding moves an element's exponent only where it crosses a power
of two, so between runs that differ in rounding the mean exponent moves by hundredths of a binade and the share of
zeros by the few elements that round to zero; an underflow or a lost scale moves whole binades of elements.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from msprobe_mlflow.statistics_table import EXPONENT_HIGH, EXPONENT_LOW, ZERO_BIN

ZERO_SHARE_MOVED = 0.01  # a hundredth of the elements more (or fewer) at zero
BINADES_MOVED = 0.5  # the other elements' mean exponent moved by half a binade (a factor of 1.4 in magnitude)
NAMED = 3  # parameters named with a move, most first


def zero_shares_and_mean_exponents(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of full exponent counts (``EXPONENT_BINS`` each): the share of its elements that are zero, and the
    mean exponent of its finite non-zero elements (NaN where it has none)."""
    counts = np.atleast_2d(np.asarray(counts, dtype=np.float64))
    numels = counts.sum(axis=1)
    finite = counts[:, :ZERO_BIN]
    weights = finite.sum(axis=1)
    exponents = np.arange(EXPONENT_LOW, EXPONENT_HIGH + 1, dtype=np.float64)
    zero_shares = np.divide(counts[:, ZERO_BIN], numels, out=np.zeros(len(counts)), where=numels > 0)
    means = np.divide(finite @ exponents, weights, out=np.full(len(counts), np.nan), where=weights > 0)
    return zero_shares, means


@dataclass(frozen=True)
class ExponentShift:
    """B against A at ``step``: the model's change in the share of zeros and in the mean exponent (binades), and
    the parameters (B's names) whose own change passes a limit, most first (at most :data:`NAMED`)."""

    step: int
    zero_share: float
    binades: float
    parameters: tuple[tuple[str, float, float], ...] = ()

    @property
    def moved(self) -> bool:
        """The model's or a parameter's change passes :data:`ZERO_SHARE_MOVED` or :data:`BINADES_MOVED`."""
        return _passes(self.zero_share, self.binades) or bool(self.parameters)

    def describe(self) -> str:
        """``B holds 12.5% more of its elements at zero than A, its others 0.80 binades lower (most: ...)``."""
        more = "more" if self.zero_share >= 0 else "fewer"
        way = "lower" if self.binades < 0 else "higher"
        text = (f"B holds {abs(self.zero_share):.2%} {more} of its gradient elements at zero than A, its other "
                f"elements {abs(self.binades):.2f} binades {way} on average")
        if self.parameters:
            text += " (most: " + ", ".join(f"{name} {zero:+.2%} at zero, {binades:+.2f} binades"
                                           for name, zero, binades in self.parameters) + ")"
        return text

    def to_dict(self) -> dict:
        return {"step": self.step, "zero_share": self.zero_share, "binades": self.binades,
                "parameters": [list(item) for item in self.parameters]}


def _passes(zero_share: float, binades: float) -> bool:
    return abs(zero_share) > ZERO_SHARE_MOVED or (not np.isnan(binades) and abs(binades) > BINADES_MOVED)


def exponent_shift(step: int, names: tuple[str, ...], counts_a: np.ndarray, counts_b: np.ndarray) -> ExponentShift:
    """The shift between two sides' full exponent counts of the same parameters (a row each, in the same order;
    ``names``: B's)."""
    zero_a, mean_a = zero_shares_and_mean_exponents(counts_a.sum(axis=0))
    zero_b, mean_b = zero_shares_and_mean_exponents(counts_b.sum(axis=0))
    zeros_a, means_a = zero_shares_and_mean_exponents(counts_a)
    zeros_b, means_b = zero_shares_and_mean_exponents(counts_b)
    zeros, binades = zeros_b - zeros_a, means_b - means_a
    order = np.argsort(-np.maximum(np.abs(zeros) / ZERO_SHARE_MOVED, np.nan_to_num(np.abs(binades)) / BINADES_MOVED),
                       kind="stable")
    named = tuple((names[i], float(zeros[i]), float(binades[i])) for i in order
                  if _passes(float(zeros[i]), float(binades[i])))[:NAMED]
    return ExponentShift(step, float(zero_b[0] - zero_a[0]), float(mean_b[0] - mean_a[0]), named)
