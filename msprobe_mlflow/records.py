"""The host-side result of one probed optimizer step, and how msprobe writes it as CSV text.

Framework-neutral: the PyTorch and MindSpore monitors both produce a :class:`StepRecord`; the dump writer, the
MLflow sink and the comparator only ever see this.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np


def bucket_labels(bounds) -> list[str]:
    """msprobe's L2 column names: ``(-inf, b0]``, ``(b0, b1]``, ..., ``(bn, inf)``, then ``=0``."""
    labels = [f"(-inf, {bounds[0]}]"]
    labels += [f"({low}, {high}]" for low, high in zip(bounds, bounds[1:])]
    return labels + [f"({bounds[-1]}, inf)", "=0"]


def csv_header(level: str, bounds) -> list[str]:
    if level == "L0":
        return ["param_name", "MD5", "max", "min", "norm", "shape"]
    if level == "L1":
        return ["param_name", "max", "min", "norm", "shape"]
    return ["param_name", *bucket_labels(bounds), "max", "min", "norm", "shape"]


def packed_length(numel: int) -> int:
    """Bytes that ``numel`` sign bits take when packed, each parameter padded to a whole byte."""
    return (numel + 7) // 8


@dataclass
class StepRecord:
    """Statistics of every probed parameter at one rank and optimizer step, in model order.

    ``values[i] = (max, min, norm)`` as float32, computed in the gradient's own dtype (bf16 values stay
    bf16-rounded); max and min are NaN for an empty parameter. ``bucket_counts[i, j]`` counts elements in bucket
    ``j`` of the float32 ``bounds`` (right-closed; NaN and +inf in the last bucket) and ``zero_counts[i]`` the
    elements equal to 0 (L2 only). ``md5[i]`` is the hex MD5 of the float32 C-order bytes (L0 only).
    ``directions`` holds ``grad > 0`` bit-packed (``np.packbits`` order) per parameter, each padded to a byte,
    concatenated in model order (L1 and L2 only).
    """

    rank: int
    step: int
    level: str
    bounds: tuple
    names: list[str]
    shapes: list[tuple[int, ...]]
    values: np.ndarray
    bucket_counts: np.ndarray | None = None
    zero_counts: np.ndarray | None = None
    md5: list[str] | None = None
    directions: np.ndarray | None = None

    @property
    def numels(self) -> list[int]:
        return [math.prod(shape) for shape in self.shapes]

    def direction_slices(self) -> list[slice]:
        """Where each parameter's packed bytes lie in ``directions``."""
        slices, start = [], 0
        for numel in self.numels:
            end = start + packed_length(numel)
            slices.append(slice(start, end))
            start = end
        return slices

    def csv_rows(self) -> list[list]:
        """Rows in msprobe's cell types: ``csv`` writes floats with ``repr`` and the shape as ``[2, 3]``."""
        rows = []
        for i, (name, shape, numel) in enumerate(zip(self.names, self.shapes, self.numels)):
            stats = [float(v) for v in self.values[i]]
            if self.level == "L0":
                rows.append([name, self.md5[i], *stats, list(shape)])
            elif self.level == "L1":
                rows.append([name, *stats, list(shape)])
            else:
                counts = [*self.bucket_counts[i].tolist(), int(self.zero_counts[i])]
                fractions = [count / numel if numel else 0 for count in counts]
                rows.append([name, *fractions, *stats, list(shape)])
        return rows


def md5_per_parameter(flat_float32: np.ndarray, numels: list[int]) -> list[str]:
    """Hex MD5 of each parameter's float32 little-endian C-order bytes (msprobe's L0 ``MD5`` column)."""
    flat = np.ascontiguousarray(flat_float32, dtype="<f4")
    digests, start = [], 0
    for numel in numels:
        digests.append(hashlib.md5(flat[start:start + numel]).hexdigest())  # hashes the buffer, no copy
        start += numel
    return digests


def record_from_statistics(*, rank: int, step: int, level: str, bounds, names: list[str],
                           shapes: list[tuple[int, ...]], statistics: np.ndarray, signs: np.ndarray | None = None,
                           float32_values: np.ndarray | None = None) -> StepRecord:
    """The :class:`StepRecord` of the flat vector a monitor computes on the device, whatever the framework.

    ``statistics`` holds ``max, min, norm`` per parameter, then at L2, per parameter, the counts of ``x <= b``
    for each float32 bound and of ``x == 0``; buckets are differences of those counts (so NaN and +inf land in the
    last one). ``signs`` are the packed directions (L1/L2), ``float32_values`` the flattened gradients (L0 MD5).
    """
    count = len(names)
    statistics = np.asarray(statistics, dtype=np.float64)
    record = StepRecord(rank=rank, step=step, level=level, bounds=tuple(bounds), names=list(names),
                        shapes=[tuple(s) for s in shapes],
                        values=statistics[: 3 * count].reshape(count, 3).astype(np.float32))
    if level == "L2":
        cumulative = statistics[3 * count:].reshape(count, len(bounds) + 1).astype(np.int64)
        numels = np.array(record.numels, dtype=np.int64)[:, None]
        record.bucket_counts = np.diff(cumulative[:, :-1], axis=1, prepend=0, append=numels)
        record.zero_counts = cumulative[:, -1]
    if level != "L0":
        record.directions = np.zeros(0, np.uint8) if signs is None else np.asarray(signs, dtype=np.uint8)
    else:
        values = np.zeros(0, np.float32) if float32_values is None else float32_values
        record.md5 = md5_per_parameter(values, record.numels)
    return record
