"""Every statistic a probe records, as one table, with the numpy reference that every backend is tested against,
and the helpers all backends share (bit weights, padding to a byte, float32 bounds). Pure Python and numpy.

| statistic    | section / buffer    | per element | reduction | CSV column            | metric (``grad/rank{R}/``)  |
|--------------|---------------------|-------------|-----------|-----------------------|-----------------------------|
| max          | extremes            | x           | max       | ``max``               | ``max`` (finite ones)       |
| min          | extremes            | x           | min       | ``min``               | ``min`` (finite ones)       |
| norm         | extremes            | x * x       | sum, sqrt | ``norm``              | ``total_norm``              |
| bucket_counts| cumulative_counts   | x <= b      | sum       | ``(a, b]`` shares     | ``share of gradient ...``   |
| zero_count   | cumulative_counts   | x == 0      | sum       | ``=0`` share          | ``share of .../exactly 0``  |
| signs        | signs buffer        | x > 0       | packbits  | ``step{S}/`` files    |                             |
| md5          | float32 values      | float32 x   | MD5       | ``MD5``               |                             |
| exponents    | exponent_counts     | exponent(x) | count     | ``exponents_{S}.npz`` | format losses (opt-in)      |

Elements are compared in float32 (bf16/fp16 widened exactly) or float64; max and min are NaN for an empty gradient
or one holding NaN, and +0.0 is above -0.0; MindSpore's backend keeps MindSpore's own answer, the first zero of
the gradient (``mint.max`` and msprobe's ``ops.amax`` agree on it), so its CSVs stay msprobe's for MindSpore; the
norm is float32, rounded to a bf16/fp16 gradient's dtype, as ``torch._foreach_norm``. These built-in statistics
have a hand-written kernel per backend (the CPU's numba kernel, the accelerator's row buffer, the sharded partials,
MindSpore's graph) for speed and torch's exact bits.

:data:`EXTRA` statistics are generic and opt-in (the monitors' ``statistics=["mean", "abs_mean"]``, off by default,
so msprobe's CSVs stay byte-identical): each backend maps every element with ``element`` (written with operators
numpy, torch and MindSpore share: ``abs``, ``*``, comparisons) and reduces with ``reduction`` (sum, max, min: per
row, shard, device, then over them), into the layout's ``extra`` section; the record applies ``finish`` and writes
the column ``name`` after ``norm``; the metrics sum it up over parameters with ``summary``. Adding one is an entry
here and its expectations in ``tests/test_statistic_table.py``.

:data:`PARAMETER_NORM` (``statistics=["param_norm"]``) is not the gradient's: it is the L2 norm of the
parameter itself as the optimizer is about to update it, in the column after the gradient's. A weight that changes
without a gradient that moved it (a corrupted weight, a wrong checkpoint shard) is invisible in the gradients at the
step it happens (the layer feeding it changes most) and shows there, in one column.

Exponent counts (opt-in, ``statistics=["exponents"]``) are how many elements sit at each binary exponent ``floor(log2|x|)``: where the gradients lie
against the range of each number format (:mod:`msprobe_mlflow.formats`). One bin per exponent from
:data:`EXPONENT_LOW` to :data:`EXPONENT_HIGH` (clamped there: below float32's least subnormal, at or above its
overflow: every format loses those alike), then zeros (``-0.0`` too) and non-finite elements (inf and NaN).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)  # np.packbits order: the first element in the high bit
REDUCTIONS = ("sum", "max", "min")
EXPONENT_LOW, EXPONENT_HIGH = -150, 128  # 2**-149 is float32's least subnormal, 2**128 its overflow
EXPONENT_BINS = EXPONENT_HIGH - EXPONENT_LOW + 3  # one per exponent, then zero, then non-finite
ZERO_BIN, NON_FINITE_BIN = EXPONENT_BINS - 2, EXPONENT_BINS - 1


def byte_padding(numel: int) -> int:
    """The zero bits that pad ``numel`` sign bits to a whole byte."""
    return -numel % 8


def packed_length(numel: int) -> int:
    """Bytes that ``numel`` sign bits take when packed, each parameter padded to a whole byte."""
    return (numel + 7) // 8


def float32_bounds(bounds) -> tuple[float, ...]:
    """The bucket bounds as the float32 values every comparison uses (``0.1`` is ``0.10000000149011612``)."""
    return tuple(float(np.float32(b)) for b in bounds)


def md5_hex(values: np.ndarray) -> str:
    """msprobe's L0 ``MD5`` column: the hex MD5 of the values' float32 little-endian C-order bytes (a float32
    contiguous array is hashed in place, without a copy)."""
    return hashlib.md5(np.ascontiguousarray(values, dtype="<f4")).hexdigest()


def _weighted_mean(values: list[float], numels: list[int]) -> float:
    total = sum(numels)
    return math.fsum(v * n for v, n in zip(values, numels) if n) / total if total else math.nan


@dataclass(frozen=True)
class Statistic:
    """An opt-in statistic: ``element`` maps each element (float32, float64 for a float64 gradient); ``reduction``
    (``sum``, ``max``, ``min``, NaN-propagating) gives one float64 per parameter; ``finish(reduced, numel)`` the
    column's value, written as float32; ``summary(values, numels)`` the run-page metric over the parameters.
    ``element`` is a ``def`` function or a builtin (``abs``): MindSpore's graph parser refuses a lambda written
    among other code on its line."""

    name: str
    element: Callable
    reduction: str
    finish: Callable[[float, int], float] = lambda reduced, numel: reduced
    summary: Callable[[list, list], float] = _weighted_mean

    def __post_init__(self):
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"statistic {self.name!r}: reduction {self.reduction!r} is not accepted; expected one "
                             f"of {', '.join(REDUCTIONS)}")

    def reduce(self, values: np.ndarray) -> float:
        """The numpy reference of the reduction over one gradient's (compared) values, before ``finish``."""
        mapped = np.asarray(self.element(values), np.float64)
        if self.reduction == "sum":
            return float(np.sum(mapped))
        if not mapped.size:
            return math.nan
        return float(np.max(mapped) if self.reduction == "max" else np.min(mapped))


def _value(x):
    return x


def _absolute(x):
    return abs(x)


def _per_element(reduced: float, numel: int) -> float:
    return reduced / numel if numel else math.nan


EXTRA: dict[str, Statistic] = {statistic.name: statistic for statistic in (
    Statistic("mean", _value, "sum", finish=_per_element),  # msprobe's monitor's "mean"
    Statistic("abs_mean", _absolute, "sum", finish=_per_element),  # the gradient's typical size, sign aside
)}


PARAMETER_NORM = "param_norm"  # the parameter's own L2 norm (not the gradient's); see the module docstring
EXPONENTS = "exponents"  # the exponent counts, opt-in at every level (their files, not a CSV column)
OPT_IN = (*EXTRA, PARAMETER_NORM, EXPONENTS)  # what a monitor's ``statistics`` option accepts


def refuse_unknown(names, accepted=OPT_IN) -> None:
    """Refuses statistics ``names`` not among ``accepted``, naming those accepted."""
    unknown = [name for name in names if name not in accepted]
    if unknown:
        raise ValueError(f"statistics {unknown} are not known; expected some of: {', '.join(accepted) or 'none yet'}")


def extra_statistics(names) -> tuple[Statistic, ...]:
    """The :data:`EXTRA` entries of ``names``, in that order; an unknown name is refused, naming those accepted."""
    refuse_unknown(names, tuple(EXTRA))
    return tuple(EXTRA[name] for name in names)


def _extreme(values: np.ndarray, reduction: Callable) -> float:
    """np.max/np.min with NaN for an empty array or one holding NaN, and +0.0 above -0.0."""
    if not values.size or np.isnan(values).any():
        return math.nan
    value = float(reduction(values))
    if value == 0:
        zeros = values[values == 0]
        value = float(reduction(np.where(np.signbit(zeros), -1.0, 1.0))) * 0.0
    return value


def _rounded_to(value: np.float32, dtype: str) -> np.float32:
    """A float32 rounded to nearest-even ``bfloat16`` or ``float16`` (as float32), or kept."""
    if dtype == "float16":
        return np.float32(np.float16(value))
    if dtype == "bfloat16" and np.isfinite(value):
        bits = int(np.array(value).view(np.uint32))
        return np.array((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000, np.uint32).view(np.float32)[()]
    return value


def exponent_counts(compared: np.ndarray) -> np.ndarray:
    """The numpy reference of the exponent counts (see the module docstring) of the compared values: int64, one
    row of :data:`EXPONENT_BINS`. ``np.frexp`` gives ``|x| = m * 2**e`` with ``0.5 <= m < 1``, so
    ``floor(log2|x|) = e - 1``, subnormals included."""
    finite = compared[np.isfinite(compared) & (compared != 0)]
    exponents = np.clip(np.frexp(np.abs(finite))[1].astype(np.int64) - 1, EXPONENT_LOW, EXPONENT_HIGH)
    counts = np.bincount(exponents - EXPONENT_LOW, minlength=EXPONENT_BINS)
    counts[ZERO_BIN] = np.sum(compared == 0)
    counts[NON_FINITE_BIN] = np.sum(~np.isfinite(compared))
    return counts


@dataclass(frozen=True)
class ExponentCounts:
    """Exponent counts of several parameters (a row each) kept over the exponents that occur in any of them:
    column ``j`` of ``kept`` (int64) counts exponent ``lowest + j``, its last two columns the zeros and the
    non-finite elements. A step's 281 bins per parameter shrink to a few dozen columns for the record's trips (the
    local dump's process, the sinks) and the file."""

    lowest: int
    kept: np.ndarray

    @classmethod
    def of(cls, full: np.ndarray) -> "ExponentCounts":
        """From rows of :data:`EXPONENT_BINS` (as :func:`exponent_counts` gives them)."""
        full = np.asarray(full).reshape(-1, EXPONENT_BINS)
        occurring = np.flatnonzero(full[:, :ZERO_BIN].any(axis=0))
        low, high = (int(occurring[0]), int(occurring[-1])) if occurring.size else (0, -1)
        return cls(EXPONENT_LOW + low, np.concatenate([full[:, low:high + 1], full[:, ZERO_BIN:]], axis=1)
                   .astype(np.int64))

    @property
    def highest(self) -> int:
        """The highest exponent kept (below ``lowest`` when no element is finite and nonzero)."""
        return self.lowest + self.kept.shape[1] - 3

    def full(self) -> np.ndarray:
        """Rows of :data:`EXPONENT_BINS` again."""
        full = np.zeros((len(self.kept), EXPONENT_BINS), np.int64)
        full[:, self.lowest - EXPONENT_LOW:self.highest - EXPONENT_LOW + 1] = self.kept[:, :-2]
        full[:, ZERO_BIN:] = self.kept[:, -2:]
        return full


def reference(values: np.ndarray, bounds, extra=(), dtype: str | None = None) -> dict:
    """What every backend must record for one gradient of ``dtype`` (``bfloat16``, ``float16``, ``float32``,
    ``float64``; default: that of ``values``) whose values, exactly, are ``values``: ``max, min, norm`` (float32,
    the norm rounded to a bf16/fp16 dtype), ``bucket_counts`` (right-closed, NaN and +inf in the last),
    ``zero_count``, ``exponent_counts``, ``signs`` (packed), ``md5`` (of the float32 bytes) and each of the
    ``extra`` statistics."""
    values = np.asarray(values).reshape(-1)
    compared = values.astype(np.float64 if (dtype or values.dtype.name) == "float64" else np.float32)
    bounds32 = np.array(float32_bounds(bounds), compared.dtype)
    norm = np.float32(np.sqrt(np.sum(np.square(compared.astype(np.float64)))))
    cumulative = [int(np.sum(compared <= b)) for b in bounds32]
    result = {
        "max": np.float32(_extreme(compared, np.max)),
        "min": np.float32(_extreme(compared, np.min)),
        "norm": _rounded_to(norm, dtype or values.dtype.name),
        "bucket_counts": np.diff(cumulative, prepend=0, append=values.size).tolist(),
        "zero_count": int(np.sum(compared == 0)),
        "exponent_counts": exponent_counts(compared),
        "signs": np.packbits(compared > 0),
        "md5": md5_hex(compared),
    }
    for statistic in extra_statistics(extra):
        result[statistic.name] = np.float32(statistic.finish(statistic.reduce(compared), values.size))
    return result
