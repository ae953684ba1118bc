"""One step of two dumps compared: the one implementation that ``compare`` (every step of two dumps) and the live
verdict (each step as it lands) share, so both see the same matching, the same counts and the same statistics.

A step of side A (the reference: the baseline) and side B (the run being checked) gives, for every parameter
present in both with the same shape (paired by name, by the user's name map, or across wrappers and frameworks:
:mod:`msprobe_mlflow.compare.pairing`), the number of gradient elements whose direction agrees,
and, where both sides wrote their ``grad_summary_{S}.csv`` beside the step folder, each parameter's statistics on
both sides (``norm``, ``max``, ``min`` and, at L2, the bucket fractions), which the noise-aware rule reads; and
where both recorded exponent counts, how far B's gradients moved among the exponents
(:mod:`msprobe_mlflow.compare.exponent_shift`), whose share at zero the noise-aware rule reads too.

A file of the step that cannot be read as written (a direction archive failing its CRC-32, a truncated ``.npy``, a
malformed summary CSV) raises :class:`~msprobe_mlflow.directions.DamagedFile` naming it: the step is never compared
on what the file no longer holds. A summary CSV that is absent is not damage (msprobe's dumps always write one, but
a user may delete it): the step is compared on its signs, and ``statistics_missing`` says which file was absent.
"""
from __future__ import annotations

import functools
import math
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from msprobe_mlflow.compare.exponent_shift import ExponentShift, exponent_shift
from msprobe_mlflow.compare.pairing import pair_parameters
from msprobe_mlflow.compare.similarity import PackedLayout, agreeing_directions, similarity
from msprobe_mlflow.directions import (PACKED_FILE_NAME, DamagedFile, LaidOutReader, StoredDirection,
                                       open_step_directions, step_compute_format)
from msprobe_mlflow.dump import (SUMMARY_PREFIX, SUMMARY_SUFFIX, SummaryTable, csv_cells, csv_text, read_summary,
                                 short_list)
from msprobe_mlflow.exponents import exponents_file_name, read_exponents
from msprobe_mlflow.statistics_table import PARAMETER_NORM


class StepMismatch(ValueError):
    """The two sides of a step cannot be compared (nothing in common, shapes differ where shapes must match)."""


@dataclass
class SideStatistics:
    """One side's statistics of the compared parameters, in their order (float64; NaN where the CSV says ``nan``):
    ``buckets`` is parameters x buckets of L2's fractions (None below L2), the two buckets that meet at 0 summed:
    which side of 0 an element lies on is its direction, compared on its own; the buckets tell its magnitude.
    ``parameter_norm``: the parameters' own norms, where the monitor recorded them (``statistics=["param_norm"]``);
    ``bucket_columns``: the CSV's bucket headers (the bounds they were counted over)."""

    norm: np.ndarray
    max: np.ndarray
    min: np.ndarray
    buckets: np.ndarray | None = None
    parameter_norm: np.ndarray | None = None
    bucket_columns: tuple[str, ...] = ()


def summary_beside(step_folder: Path, step: int) -> Path:
    """``rank{R}/grad_summary_{S}.csv``: the statistics of the step whose directions are in ``rank{R}/step{S}/``."""
    return step_folder.parent / f"{SUMMARY_PREFIX}{step}{SUMMARY_SUFFIX}"


def _exponent_rows(step_folder: Path, step: int, names: list[str] | tuple[str, ...]) -> np.ndarray | None:
    """The full exponent counts of ``names`` (a row each) from ``rank{R}/exponents_{S}.npz`` beside the step
    folder; None where the file is absent or lacks one of them. A damaged file raises :class:`DamagedFile`."""
    path = step_folder.parent / exponents_file_name(step)
    if not path.is_file():
        return None
    listed, counts, _ = read_exponents(path)
    rows = {name: index for index, name in enumerate(listed)}
    if any(name not in rows for name in names):
        return None
    return counts.full()[[rows[name] for name in names]]


def _exponent_shift(step: int, folder_a: Path, folder_b: Path, names_a, names_b) -> ExponentShift | None:
    """B's gradients against A's among the exponents, where both recorded exponent counts of the compared names."""
    rows_a = _exponent_rows(folder_a, step, names_a)
    rows_b = _exponent_rows(folder_b, step, names_b) if rows_a is not None else None
    return None if rows_b is None or not len(names_b) else exponent_shift(step, tuple(names_b), rows_a, rows_b)


def _damaged(path: Path, error: ValueError) -> DamagedFile:
    """``error`` (whose text may start with the path already) as the damage of the file at ``path``."""
    return DamagedFile(path, str(error).removeprefix(f"{path}: "))


def _summary(csv_path: Path) -> SummaryTable | None:
    """A step's ``grad_summary_{S}.csv``, read once for the model order and the statistics; None when absent,
    :class:`DamagedFile` when it cannot be read as a summary."""
    if not csv_path.is_file():
        return None
    try:
        return read_summary(csv_path)
    except ValueError as e:  # UnicodeDecodeError included
        raise _damaged(csv_path, e) from None


def _statistics(table: SummaryTable | None, csv_path: Path, names: list[str]) -> tuple[SideStatistics | None,
                                                                                        str | None]:
    """:func:`side_statistics` of one side and, where there are none, why (the file absent, or lacking the compared
    parameters' rows or the ``norm`` column): a step compared on its signs alone says so."""
    if table is None:
        return None, f"{csv_path} (absent)"
    try:
        statistics = side_statistics(table, names)
    except ValueError as e:  # a cell that is no number
        raise _damaged(csv_path, e) from None
    if statistics is not None:
        return statistics, None
    if "norm" not in table.header:
        return None, f"{csv_path} (no norm column)"
    listed = set(table.column("param_name"))
    return None, f"{csv_path} (no row for {short_list([n for n in names if n not in listed], 3)})"


def side_statistics(table: SummaryTable | None, names: list[str]) -> SideStatistics | None:
    """The statistics of ``names`` from a step's summary table; None without one, or when it lacks a name or the
    ``norm`` column."""
    if table is None or "norm" not in table.header:
        return None
    rows = {name: index for index, name in enumerate(table.column("param_name"))}
    if any(name not in rows for name in names):
        return None
    order = [rows[name] for name in names]

    def column(name: str) -> np.ndarray:
        return np.array(table.numbers(name), dtype=np.float64)[order]

    bucket_columns = [name for name in table.header if name.startswith("(")]
    buckets = [column(name) for name in bucket_columns]
    at_zero = next((i for i, name in enumerate(bucket_columns[:-1]) if name.endswith(", 0]")), None)
    if at_zero is not None:  # "(-1, 0]" and "(0, 1]": one bucket of magnitudes below the next bounds
        buckets[at_zero:at_zero + 2] = [buckets[at_zero] + buckets[at_zero + 1]]
    return SideStatistics(column("norm"), column("max"), column("min"), np.stack(buckets, axis=1) if buckets else None,
                          column(PARAMETER_NORM) if PARAMETER_NORM in table.header else None, tuple(bucket_columns))


def _other_bounds(side_a: SideStatistics | None, side_b: SideStatistics | None) -> tuple[str, ...] | None:
    """Where both sides counted L2's buckets over other bounds, the two headers (``(-inf, -1]`` ...) and both
    sides without buckets, which cannot be compared; else None and the sides as they are."""
    if side_a is None or side_b is None or side_a.buckets is None or side_b.buckets is None \
            or side_a.bucket_columns == side_b.bucket_columns:
        return None
    side_a.buckets = side_b.buckets = None
    return side_a.bucket_columns, side_b.bucket_columns


@dataclass
class StepComparison:
    """One step compared: of the parameters ``compared`` (A's names, A's model order; B's names in
    ``names_b``), ``agreeing`` elements of ``numels``; their statistics on both sides where both wrote them, and the
    format each run computed the step in where its monitor recorded it (``compute_formats``, A's and B's)."""

    step: int
    compared: tuple[str, ...]
    names_b: tuple[str, ...]
    agreeing: np.ndarray
    numels: np.ndarray
    statistics_a: SideStatistics | None = None
    statistics_b: SideStatistics | None = None
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    shape_differs: list[str] = field(default_factory=list)
    compute_formats: tuple[str | None, str | None] = (None, None)
    paired_by: tuple[str, ...] = ()  # how each compared pair was found (``pairing.HOW``); empty: all by name
    # the summary CSVs this step has no statistics from (absent, or lacking the compared parameters): A's, then B's
    statistics_missing: tuple[str, ...] = ()
    exponent_shift: ExponentShift | None = None  # where both sides recorded exponent counts
    bounds_differ: tuple | None = field(init=False, default=None)  # A's and B's L2 bucket headers where they differ

    def __post_init__(self):
        """Buckets counted over other bounds are not compared: their headers are kept to say so, their counts
        dropped from both sides' statistics."""
        self.bounds_differ = _other_bounds(self.statistics_a, self.statistics_b)

    @property
    def summary_counts(self) -> tuple[int, int]:
        return int(self.agreeing.sum()), int(self.numels.sum())

    @property
    def renamed_matches(self) -> list[tuple[str, str, str]]:
        """(name in A, name in B, how) of the pairs whose names differ."""
        return [(a, b, how) for a, b, how in zip(self.compared, self.names_b, self.paired_by) if a != b]

    def similarities(self) -> np.ndarray:
        """Each compared parameter's similarity (msprobe's values: 0.0 for an empty parameter)."""
        return np.divide(self.agreeing, self.numels, out=np.zeros(len(self.numels)), where=self.numels > 0)

    def csv_text(self, layout: "StepLayout") -> bytes:
        """``similarities_{S}.csv`` of the live verdict: ``param_name,similarity`` in ``layout``'s order (empty:
        not compared; 0 for an empty parameter), ``summary`` last. When every parameter was compared under its own
        name (the usual case) the rows are joined from the layout's name cells: the ``csv`` writer's bytes, at a
        fraction of its cost per step."""
        values, summary = self.similarities().tolist(), similarity(*self.summary_counts)
        if self.names_b != layout.names:  # some parameters were not compared: their cells stay empty
            by_name = dict(zip(self.names_b, values))
            rows = [[name, by_name.get(name, "")] for name in layout.names]
            return csv_text([["param_name", "similarity"], *rows, ["summary", summary]])
        rows = "".join([f"{cell},{value!r}\r\n" for cell, value in zip(layout.name_cells, values)])
        return f"param_name,similarity\r\n{rows}summary,{summary!r}\r\n".encode("utf-8-sig")


class StepLayout:
    """What comparing a step works out once for side B's parameter names and shapes, which usually stay the same
    from step to step: the packed cuts (``PackedLayout``), readers of both sides' archives laid out alike, and the
    CSV cells of the names. With it, a step whose two archives both hold exactly these parameters is compared at
    once (a few array operations however many parameters): the live verdict's usual case."""

    def __init__(self, names: list[str], shapes: list[tuple[int, ...]]):
        self.names = tuple(names)
        self.shapes = tuple(tuple(shape) for shape in shapes)
        self.packed = PackedLayout([math.prod(shape) for shape in self.shapes])
        self.reader_a = LaidOutReader(self.names, self.shapes)
        self.reader_b = LaidOutReader(self.names, self.shapes)
        self.name_cells = csv_cells(list(names))


def _open_side(folder: Path) -> dict[str, StoredDirection]:
    stored = open_step_directions(folder)
    if not stored:  # the step folder is there, its files are not
        raise DamagedFile(folder, "holds no direction files (expected directions.npz or <param>.npy)")
    return stored


def _model_order(table: SummaryTable | None, stored: dict[str, StoredDirection]) -> list[str]:
    """The summary CSV's ``param_name`` order (msprobe's npy form lists files alphabetically)."""
    listed = table.column("param_name") if table is not None else []
    ordered = [name for name in listed if name in stored]
    seen = set(ordered)
    return ordered + [name for name in stored if name not in seen]


def _agreeing(pair: tuple[StoredDirection, StoredDirection]) -> int:
    stored_a, stored_b = pair
    return agreeing_directions(stored_a.packed_bits(), stored_b.packed_bits(), stored_a.numel)


def compare_step(step: int, folder_a: Path, folder_b: Path, *, layout: StepLayout | None = None,
                 pool: Executor | None = None, shapes_must_match: bool = True,
                 name_map: dict[str, str] | None = None) -> StepComparison:
    """Compares the directions of ``step`` in two step folders (``rank{R}/step{S}``), and reads both sides'
    statistics from the ``grad_summary_{S}.csv`` beside them.

    With ``layout`` (B's names and shapes), two archives that both hold exactly those parameters are compared
    whole; otherwise (other names, msprobe's npy form, wrapper prefixes, another framework's names; ``name_map``:
    name in A -> name in B, see :func:`~msprobe_mlflow.compare.pairing.pair_parameters`) parameter by parameter,
    one in memory at a time per worker of ``pool``. A parameter whose shapes differ raises :class:`StepMismatch`
    naming both files, unless ``shapes_must_match`` is False (the live verdict: it is listed in ``shape_differs`` and left out).
    A file that cannot be read as written raises :class:`DamagedFile` naming it; an absent summary CSV is listed in
    ``statistics_missing``.
    """
    csv_a, csv_b = summary_beside(folder_a, step), summary_beside(folder_b, step)
    table_a, table_b = _summary(csv_a), _summary(csv_b)
    formats = step_compute_format(folder_a), step_compute_format(folder_b)
    bits_a = layout.reader_a.read(folder_a / PACKED_FILE_NAME) if layout is not None else None
    bits_b = layout.reader_b.read(folder_b / PACKED_FILE_NAME) if bits_a is not None else None
    if bits_b is not None:
        names = list(layout.names)
        (statistics_a, missing_a), (statistics_b, missing_b) = (_statistics(table_a, csv_a, names),
                                                                _statistics(table_b, csv_b, names))
        return StepComparison(step, layout.names, layout.names, layout.packed.agreeing(bits_a, bits_b),
                              layout.packed.numels, statistics_a, statistics_b, compute_formats=formats,
                              statistics_missing=tuple(m for m in (missing_a, missing_b) if m),
                              exponent_shift=_exponent_shift(step, folder_a, folder_b, names, names))
    stored_a, stored_b = _open_side(folder_a), _open_side(folder_b)
    matches = _paired(tuple((n, stored_a[n].shape) for n in _model_order(table_a, stored_a)),
                      tuple((n, stored_b[n].shape) for n in _model_order(table_b, stored_b)),
                      tuple((name_map or {}).items()))
    pairs, shape_differs = [], []
    for name_a, name_b, how in matches:
        shape_a, shape_b = stored_a[name_a].shape, stored_b[name_b].shape
        if shape_a == shape_b:
            pairs.append((name_a, name_b, how))
        elif shapes_must_match:
            raise StepMismatch(f"step{step}: parameter {name_a!r} has shape {list(shape_a)} in "
                               f"{stored_a[name_a].path} but {list(shape_b)} in {stored_b[name_b].path}; shapes "
                               f"must match (were both runs the same model?)")
        else:
            shape_differs.append(f"{name_b} {list(shape_b)} (baseline {list(shape_a)})")
    work = [(stored_a[a], stored_b[b]) for a, b, _ in pairs]
    agreeing = list(pool.map(_agreeing, work)) if pool is not None else [_agreeing(item) for item in work]
    names_a, names_b = [a for a, _, _ in pairs], [b for _, b, _ in pairs]
    matched_a, matched_b = {a for a, _, _ in matches}, {b for _, b, _ in matches}
    (statistics_a, missing_a), (statistics_b, missing_b) = (_statistics(table_a, csv_a, names_a),
                                                            _statistics(table_b, csv_b, names_b))
    return StepComparison(step, tuple(names_a), tuple(names_b), np.array(agreeing, dtype=np.int64),
                          np.array([stored_a[a].numel for a in names_a], dtype=np.int64), statistics_a, statistics_b,
                          [n for n in stored_a if n not in matched_a], [n for n in stored_b if n not in matched_b],
                          shape_differs, formats, tuple(how for _, _, how in pairs),
                          tuple(m for m in (missing_a, missing_b) if m),
                          _exponent_shift(step, folder_a, folder_b, names_a, names_b))


@functools.lru_cache(maxsize=8)
def _paired(shapes_a: tuple, shapes_b: tuple, name_map: tuple) -> list[tuple[str, str, str]]:
    """:func:`pair_parameters` once per layout of the two sides (steps usually share one)."""
    return [(pair.a, pair.b, pair.how) for pair in pair_parameters(dict(shapes_a), dict(shapes_b), dict(name_map))]
