"""The host-side result of one probed optimizer step, and how msprobe writes it as CSV text.

Framework-neutral: the PyTorch and MindSpore monitors both produce a :class:`StepRecord`; the dump writer, the
MLflow sink and the comparator only ever see this.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from msprobe_mlflow.layout import (CHECKSUM, CHECKSUM_PREFIX, CUMULATIVE_COUNTS, EXPONENT_COUNTS, EXTRA, EXTREMES,
                                   StatisticsLayout, consecutive_slices, packed_slices)
from msprobe_mlflow.levels import LEVELS, Level, csv_header
from msprobe_mlflow.statistics_table import PARAMETER_NORM, ExponentCounts, extra_statistics, md5_hex


@dataclass
class StepRecord:
    """Statistics of every probed parameter at one rank and optimizer step, in model order.

    ``values[i] = (max, min, norm)`` as float32, computed in the gradient's own dtype (bf16 values stay
    bf16-rounded); max and min are NaN for an empty parameter. ``bucket_counts[i, j]`` counts elements in bucket
    ``j`` of the float32 ``bounds`` (right-closed; NaN and +inf in the last bucket) and ``zero_counts[i]`` the
    elements equal to 0 (L2 only). ``md5[i]`` is the hex MD5 of the float32 C-order bytes (L0 only), or with the
    device checksum option ``mix64:`` and its 16 hex digits.
    ``directions`` holds ``grad > 0`` bit-packed (``np.packbits`` order) per parameter, each padded to a byte,
    concatenated in model order (L1 and L2 only). ``skipped_directions``: the level records directions but this
    step has none (a statistics-only step of the always-on tier, ``msprobe_mlflow.monitoring.directions_schedule``).
    ``exponent_counts``: the elements of each parameter at each binary exponent (opt-in, not in the CSV; an
    :class:`~msprobe_mlflow.statistics_table.ExponentCounts`, a row per parameter); ``loss_scale``: the scale the step's
    backward ran at where the monitor knows it (a ``GradScaler``'s), which the format losses read them at.
    ``extra``: each opt-in statistic's float32 column (:mod:`msprobe_mlflow.statistics_table`), by name.
    ``summary_csv``: the step's ``grad_summary`` bytes, kept by ``dump.summary_csv_bytes`` so that the sinks that
    read them back (metrics) do not format them again on the writer thread. ``compute_format``: the coarsest format
    the run computed this step in, where the monitor knows it (:mod:`msprobe_mlflow.formats`), written with the
    directions. ``anomaly_flags``: the step's flags as the local dump's process judged them, or the exception
    judging raised there; None where the sinks judge it (:mod:`msprobe_mlflow.anomaly_rule`).
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
    skipped_directions: bool = False
    extra: dict[str, np.ndarray] | None = None
    exponent_counts: ExponentCounts | None = None
    loss_scale: float | None = None
    summary_csv: bytes | None = field(default=None, repr=False, compare=False)  # set once written: sinks reuse it
    compute_format: str | None = None
    anomaly_flags: list | Exception | None = field(default=None, repr=False, compare=False)  # set where judged

    @functools.cached_property
    def numels(self) -> list[int]:
        return [math.prod(shape) for shape in self.shapes]

    def packed_directions(self) -> dict[str, np.ndarray]:
        """Each parameter's packed sign bits (views into ``directions``), by name."""
        return {name: self.directions[piece] for name, piece in zip(self.names, packed_slices(self.numels))}

    def csv_header(self) -> list[str]:
        return csv_header(self.level, self.bounds, list(self.extra or ()))

    @property
    def share_columns(self) -> int:
        """How many of a row's numbers are L2 shares (each bucket's, then ``=0``): 0 below L2."""
        return len(self.bounds) + 2 if LEVELS[self.level].has_buckets else 0

    def numbers(self) -> np.ndarray:
        """Every row's numeric cells as one float64 matrix, a row per parameter: the shares (``count / numel``,
        rounded alike by Python's and numpy's division; 0 for an empty parameter, which msprobe writes as the
        integer ``0``), then ``max, min, norm``, then the extra statistics."""
        columns = []
        if self.share_columns:
            numels = np.array(self.numels, np.float64)[:, None]
            counts = np.column_stack([self.bucket_counts, self.zero_counts]).astype(np.float64)
            columns.append(np.divide(counts, numels, out=np.zeros_like(counts), where=numels > 0))
        columns.append(np.asarray(self.values, np.float64).reshape(len(self.names), 3))
        columns += [np.asarray(values, np.float64).reshape(-1, 1) for values in (self.extra or {}).values()]
        return np.hstack(columns)

    def csv_rows(self) -> list[list]:
        """Rows in msprobe's cell types: ``csv`` writes floats with ``repr`` and the shape as ``[2, 3]``."""
        md5 = LEVELS[self.level].has_md5
        rows = []
        for i, (name, shape, numel, numbers) in enumerate(zip(self.names, self.shapes, self.numels,
                                                               self.numbers().tolist())):
            if not numel:
                numbers[:self.share_columns] = [0] * self.share_columns
            rows.append([name, *([self.md5[i]] if md5 else []), *numbers, list(shape)])
        return rows


def md5_per_parameter(flat_float32: np.ndarray, numels: list[int]) -> list[str]:
    """Hex MD5 of each parameter's float32 little-endian C-order bytes (msprobe's L0 ``MD5`` column)."""
    flat = np.ascontiguousarray(flat_float32, dtype="<f4")
    return [md5_hex(flat[piece]) for piece in consecutive_slices(numels)]  # no copy: hashes the view


def record_from_statistics(*, rank: int, step: int, level: str | Level, bounds, names: list[str],
                           shapes: list[tuple[int, ...]], statistics: np.ndarray, signs: np.ndarray | None = None,
                           float32_values: np.ndarray | None = None, checksum: bool = False,
                           directions: bool = True, md5: list[str] | None = None, extra=()) -> StepRecord:
    """The :class:`StepRecord` of the flat vector a monitor computes on the device, whatever the framework.

    ``statistics`` is laid out as :class:`msprobe_mlflow.layout.StatisticsLayout` says: ``max, min, norm`` per
    parameter, then at L2 the cumulative counts, whose differences are the buckets (so NaN and +inf land in the last
    one). ``signs`` are the packed directions (L1/L2), ``float32_values`` the flattened gradients (L0 MD5); with
    ``checksum``, the vector's checksum section (L0) fills the MD5 column instead; ``md5``: the digests, hashed
    already where the gradients were (then ``float32_values`` is not needed).
    ``directions=False``: a step whose directions were not computed (``signs`` is ignored). ``extra``: the names
    of the opt-in statistics in the vector (their ``finish`` gives the record's values).
    """
    shapes = [tuple(s) for s in shapes]
    layout = StatisticsLayout(level, bounds, [math.prod(shape) for shape in shapes], checksum, extra)
    sections = layout.split(np.asarray(statistics, dtype=np.float64))
    record = StepRecord(rank=rank, step=step, level=layout.level.name, bounds=tuple(bounds), names=list(names),
                        shapes=shapes,
                        values=sections[EXTREMES].astype(np.float32))
    if layout.level.has_buckets:
        cumulative = sections[CUMULATIVE_COUNTS].astype(np.int64)
        numels = np.array(layout.numels, dtype=np.int64)[:, None]
        record.bucket_counts = np.diff(cumulative[:, :-1], axis=1, prepend=0, append=numels)
        record.zero_counts = cumulative[:, -1]
    if layout.level.has_exponents:
        record.exponent_counts = ExponentCounts.of(sections[EXPONENT_COUNTS])
    if layout.extra:
        record.extra = {statistic.name: np.array([statistic.finish(float(reduced), numel) for reduced, numel
                                                  in zip(sections[EXTRA][:, column], layout.numels)], np.float32)
                        for column, statistic in enumerate(extra_statistics(layout.extra))}
    record.skipped_directions = layout.level.has_directions and not directions
    if layout.level.has_directions and directions:
        record.directions = np.zeros(0, np.uint8) if signs is None else np.asarray(signs, dtype=np.uint8)
    if checksum:
        record.md5 = [f"{CHECKSUM_PREFIX}{int(high):08x}{int(low):08x}" for high, low in sections[CHECKSUM]]
    elif layout.level.has_md5 and md5 is not None:
        record.md5 = list(md5)
    elif layout.level.has_md5:
        values = np.zeros(0, np.float32) if float32_values is None else float32_values
        record.md5 = md5_per_parameter(values, layout.numels)
    return record


def with_compute_format(record: StepRecord, compute_format: str | None) -> StepRecord:
    """``record`` with the format its step computed in (see :attr:`StepRecord.compute_format`)."""
    record.compute_format = compute_format
    return record


def with_loss_scale(record: StepRecord, loss_scale: float | None) -> StepRecord:
    """``record`` with the loss scale its step's backward ran at (see :attr:`StepRecord.loss_scale`)."""
    record.loss_scale = loss_scale
    return record


def with_parameter_norms(record: StepRecord, norms: np.ndarray) -> StepRecord:
    """``record`` with the parameters' own norms (``statistics=["param_norm"]``) as its last opt-in column."""
    record.extra = {**(record.extra or {}), PARAMETER_NORM: np.asarray(norms, np.float32)}
    return record
