"""The API checker's accuracy metrics and verdict (docs/api_check.md, "Metrics and verdict"), as plain numpy
functions.

All three metrics take the benchmark (torch) and the tested (MindSpore) output as arrays of the same shape, compute
in float64 over the flattened values, and let NaN propagate (a NaN metric fails the verdict); ``compare_arrays``
gives them only the elements finite in both outputs. For two empty arrays the cosine is 1.0 (the formula gives
1e-8 / 1e-8) and both errors are 0.0 (no element differs).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from msprobe_mlflow.vocabulary import API_CHECK_STATUSES as STATUSES, ERROR, OUT_OF_MEMORY, PASS, SKIP

__all__ = ["STATUSES", "ERROR", "PASS", "SKIP", "OUT_OF_MEMORY", "EPSILON", "Thresholds", "Comparison",
           "compare_arrays", "cosine_similarity", "max_abs_err", "max_relative_err"]

EPSILON = 1e-8


def cosine_similarity(bench: np.ndarray, tested: np.ndarray) -> float:
    """``(1e-8 + dot(bench, tested)) / (1e-8 + |bench| * |tested|)``."""
    bench, tested = _flat64(bench), _flat64(tested)
    return float((EPSILON + np.dot(bench, tested)) / (EPSILON + np.linalg.norm(bench) * np.linalg.norm(tested)))


def max_abs_err(bench: np.ndarray, tested: np.ndarray) -> float:
    """``max |bench - tested|``."""
    difference = np.abs(_flat64(bench) - _flat64(tested))
    return float(np.max(difference)) if difference.size else 0.0


def max_relative_err(bench: np.ndarray, tested: np.ndarray) -> float:
    """``max |bench - tested| / |bench|``, with 1e-8 in place of ``|bench|`` where bench is 0."""
    bench, tested = _flat64(bench), _flat64(tested)
    denominator = np.where(bench == 0, EPSILON, np.abs(bench))
    ratio = np.abs(bench - tested) / denominator
    return float(np.max(ratio)) if ratio.size else 0.0


def _flat64(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float64).ravel()


@dataclass(frozen=True)
class Thresholds:
    """The pass rule: ``Cosine > cosine`` and ``MaxAbsErr < max_abs_err`` (MaxRelativeErr does not decide)."""

    cosine: float = 0.99
    max_abs_err: float = 0.001


@dataclass(frozen=True)
class Comparison:
    """The metrics of one output pair and its verdict; metrics are ``None`` when they could not be computed."""

    cosine: float | None
    max_abs_err: float | None
    max_relative_err: float | None
    status: str
    message: str


def compare_arrays(bench: np.ndarray | None, tested: np.ndarray | None, thresholds: Thresholds) -> Comparison:
    """Metrics and verdict of one output; ``None`` stands for a value that is not a tensor.

    A pair that is not two tensors of one shape gets no metrics and the status ``error`` with msprobe's
    "skip comparing" message. Otherwise non-finite values are compared exactly: NaN, inf and -inf must sit at the
    same positions in both (an error names how many differ and the first), and the metrics are those of the
    elements finite in both; the messages are then msprobe's threshold texts for each failed criterion.
    """
    if bench is None or tested is None or np.shape(bench) != np.shape(tested):
        return Comparison(None, None, None, ERROR,
                          "two inputs are not valid for computing cosine similarity, skip comparing "
                          "two inputs are not valid for computing max absolute difference, skip comparing")
    bench, tested = _flat64(bench), _flat64(tested)
    finite = np.isfinite(bench) & np.isfinite(tested)
    differing = np.flatnonzero(~finite & (bench != tested) & ~(np.isnan(bench) & np.isnan(tested)))
    failures = []
    if differing.size:
        first = differing[0]
        failures.append(f"non-finite values differ at {differing.size} of {finite.size} elements (the first at "
                        f"flat index {first}: bench {bench[first]}, tested {tested[first]})")
    bench, tested = bench[finite], tested[finite]
    cosine = cosine_similarity(bench, tested)
    abs_err = max_abs_err(bench, tested)
    if not cosine > thresholds.cosine:
        failures.append(f"cosine similarity is less than threshold: {thresholds.cosine}")
    if not abs_err < thresholds.max_abs_err:
        failures.append(f"max absolute difference is greater than threshold: {thresholds.max_abs_err}")
    return Comparison(cosine, abs_err, max_relative_err(bench, tested), ERROR if failures else PASS,
                      " ".join(failures))
