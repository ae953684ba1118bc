"""How far run B's gradients moved among the binary exponents against run A's at a step, from the exponent counts
both monitors recorded (``statistics=["exponents"]``): the share of the model's gradient elements that are zero
(an underflow, a lost loss scale, flushes small gradients to zero) and the mean exponent ``floor(log2|g|)`` of the
other finite elements, each B's minus A's.

What moves: the model's share of zeros by more than :data:`ZERO_SHARE_MOVED`. Measured on the divergence
benchmark's dumps (all 120 benign pairs, in sample and held out: float64, bfloat16 autocast, one ulp, another thread
count), the share of zeros never moved by more than 0.3% of the elements, while the mean exponent drifted by whole
binades once two benign runs parted (up to 6 in a BatchNorm net late in training), and per parameter both moved
from step 0 where a gradient is rounding noise (a bias right before a normalisation) or has a handful of
elements. So the mean exponent is reported, not judged, and the parameters are named by how many of their
elements changed to or from zero, after the model's share moved.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from msprobe_mlflow.statistics_table import EXPONENT_HIGH, EXPONENT_LOW, ZERO_BIN

ZERO_SHARE_MOVED = 0.01  # a hundredth of the model's gradient elements more (or fewer) at zero
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
    """B against A at ``step``: the change in the model's share of zero elements and in the mean exponent of the
    others (binades); where the share moved, the parameters (B's names) holding most of the elements that changed
    to or from zero, with their own changes (share of their elements, binades), at most :data:`NAMED`."""

    step: int
    zero_share: float
    binades: float
    parameters: tuple[tuple[str, float, float], ...] = ()

    @property
    def moved(self) -> bool:
        """The model's share of zeros moved by more than :data:`ZERO_SHARE_MOVED`."""
        return abs(self.zero_share) > ZERO_SHARE_MOVED

    def describe(self) -> str:
        """``B holds 20.00% more of its gradient elements at zero than A (...), its others 1.07 binades higher``."""
        more = "more" if self.zero_share >= 0 else "fewer"
        way = "lower" if self.binades < 0 else "higher"
        named = "" if not self.parameters else " (most: " + ", ".join(
            f"{name} {zero:+.2%} at zero" for name, zero, _ in self.parameters) + ")"
        return (f"B holds {abs(self.zero_share):.2%} {more} of its gradient elements at zero than A{named}, its "
                f"other elements {abs(self.binades):.2f} binades {way} on average")

    def to_dict(self) -> dict:
        return {"step": self.step, "zero_share": self.zero_share, "binades": self.binades,
                "parameters": [list(item) for item in self.parameters]}


def exponent_shift(step: int, names: tuple[str, ...], counts_a: np.ndarray, counts_b: np.ndarray) -> ExponentShift:
    """The shift between two sides' full exponent counts of the same parameters (a row each, in the same order;
    ``names``: B's)."""
    zero_a, mean_a = zero_shares_and_mean_exponents(counts_a.sum(axis=0))
    zero_b, mean_b = zero_shares_and_mean_exponents(counts_b.sum(axis=0))
    shift = ExponentShift(step, float(zero_b[0] - zero_a[0]), float(mean_b[0] - mean_a[0]))
    if not shift.moved:
        return shift
    zeros_a, means_a = zero_shares_and_mean_exponents(counts_a)
    zeros_b, means_b = zero_shares_and_mean_exponents(counts_b)
    changed = (counts_b[:, ZERO_BIN] - counts_a[:, ZERO_BIN]) * np.sign(shift.zero_share)  # the model's way
    named = tuple((names[i], float(zeros_b[i] - zeros_a[i]), float(means_b[i] - means_a[i]))
                  for i in np.argsort(-changed, kind="stable")[:NAMED] if changed[i] > 0)
    return ExponentShift(shift.step, shift.zero_share, shift.binades, named)
