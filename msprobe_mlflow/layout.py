"""Where each number of a probed step lies: the flat statistics vector every monitor computes on the device, and
the sign and value buffers beside it. Pure Python and numpy, shared by the PyTorch and MindSpore monitors and by
the decoder (:func:`msprobe_mlflow.records.record_from_statistics`).

The statistics vector is float64 (float32 statistics and integer counts are exact in it). It is made of
*sections*, one after the other; a section holds ``width`` numbers per monitored parameter, parameters in model
order:

- ``extremes`` (every level): ``max, min, norm``, each a float32 value;
- ``cumulative_counts`` (levels with buckets: L2): the number of elements ``x <= b`` for each float32 bound ``b``,
  then the number ``x == 0`` (``-0.0`` included). Buckets are differences of those counts, so NaN and +inf land in
  the last bucket.
- ``exponent_counts`` (with the opt-in exponents, :func:`msprobe_mlflow.levels.recorded_level`): the elements at
  each binary exponent, then zeros, then non-finite ones (:func:`msprobe_mlflow.statistics_table.exponent_counts`);
- ``extra`` (only with opt-in statistics, ``extra`` names from
  :data:`msprobe_mlflow.statistics_table.EXTRA`): each one's reduced value, in the order of the names;
- ``checksum`` (only with ``checksum=True``, at L0): the device checksum of the float32 values (see
  :data:`CHECKSUM_PREFIX`), as its high and low 32 bits.

Beside it: the packed signs (levels with directions: ``grad > 0`` in ``np.packbits`` order, each parameter padded
to a whole byte, ``packed_length(numel)`` bytes, concatenated in model order) and the float32 values (levels with
MD5: ``numel`` values per parameter, concatenated).

Adding a statistic: an entry in :mod:`msprobe_mlflow.statistics_table` (see there); every backend computes the
``extra`` section from it. The buffer lengths, the merge of per-device results and :meth:`~StatisticsLayout.split`
(the decoder) follow from the layout, and a reader takes a section by its name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from msprobe_mlflow.levels import LEVELS, Level
from msprobe_mlflow.statistics_table import EXPONENT_BINS, extra_statistics, packed_length

EXTREMES = "extremes"
CUMULATIVE_COUNTS = "cumulative_counts"
EXPONENT_COUNTS = "exponent_counts"
EXTRA = "extra"
CHECKSUM = "checksum"
CHECKSUMS = ("md5", "mix64")  # what L0's MD5 column holds: msprobe's MD5 (on the host), or the device checksum
CHECKSUM_PREFIX = "mix64:"  # how the MD5 column tells a device checksum (16 hex digits follow) from an MD5


def consecutive_slices(lengths: Iterable[int]) -> list[slice]:
    """Where each of several pieces of these lengths lies once they are concatenated in order."""
    slices, start = [], 0
    for length in lengths:
        slices.append(slice(start, start + length))
        start += length
    return slices


def packed_slices(numels: Iterable[int]) -> list[slice]:
    """Where each parameter's packed sign bytes lie in the concatenated packed signs."""
    return consecutive_slices(packed_length(numel) for numel in numels)


@dataclass(frozen=True)
class Section:
    """A run of the statistics vector holding ``width`` numbers per parameter."""

    name: str
    width: int


@dataclass(frozen=True)
class StatisticsLayout:
    """The layout of one step's results for parameters of ``numels`` elements at ``level`` (a :class:`Level` or its
    name) with bucket ``bounds``, with the device ``checksum`` section or not, and the opt-in ``extra``
    statistics (their names); see the module docstring."""

    level: Level
    bounds: tuple
    numels: tuple[int, ...]
    checksum: bool = False
    extra: tuple[str, ...] = ()

    def __post_init__(self):
        if isinstance(self.level, str):
            object.__setattr__(self, "level", LEVELS[self.level])
        object.__setattr__(self, "bounds", tuple(self.bounds))
        object.__setattr__(self, "numels", tuple(int(n) for n in self.numels))
        object.__setattr__(self, "extra", tuple(self.extra))
        extra_statistics(self.extra)  # an unknown name is refused here

    @property
    def count(self) -> int:
        """The number of parameters."""
        return len(self.numels)

    @property
    def sections(self) -> tuple[Section, ...]:
        """The sections of the statistics vector, in order."""
        sections = [Section(EXTREMES, 3)]
        if self.level.has_buckets:
            sections.append(Section(CUMULATIVE_COUNTS, len(self.bounds) + 1))
        if self.level.has_exponents:
            sections.append(Section(EXPONENT_COUNTS, EXPONENT_BINS))
        if self.extra:
            sections.append(Section(EXTRA, len(self.extra)))
        if self.checksum:
            sections.append(Section(CHECKSUM, 2))
        return tuple(sections)

    @property
    def statistics_length(self) -> int:
        return self.count * sum(section.width for section in self.sections)

    @property
    def signs_length(self) -> int:
        return int(packed_length(np.asarray(self.numels, np.int64)).sum()) if self.level.has_directions else 0

    @property
    def values_length(self) -> int:
        return sum(self.numels) if self.level.has_md5 else 0

    def split(self, statistics: np.ndarray) -> dict[str, np.ndarray]:
        """Each section of a flat statistics vector as a ``(count, width)`` view, by section name."""
        pieces = consecutive_slices(self.count * section.width for section in self.sections)
        return {section.name: statistics[piece].reshape(self.count, section.width)
                for section, piece in zip(self.sections, pieces)}

    def in_order(self, sections: dict) -> list:
        """The ``(count, width)`` arrays or tensors of ``sections`` flattened, in vector order, ready to
        concatenate (``np.concatenate``, ``torch.cat``); an entry for a section this layout does not have (the
        counts, at a level without buckets) is ignored."""
        return [sections[section.name].reshape(-1) for section in self.sections]

    def sign_slices(self) -> list[slice]:
        return packed_slices(self.numels)

    def sign_offsets(self) -> np.ndarray:
        """Where each parameter's packed sign bytes start (int64; :meth:`sign_slices`' starts, in one numpy call)."""
        packed = packed_length(np.asarray(self.numels, np.int64))
        return np.cumsum(packed) - packed

    def value_slices(self) -> list[slice]:
        return consecutive_slices(self.numels)

    def subset(self, indices: Iterable[int]) -> "StatisticsLayout":
        """The layout of some of the parameters (those on one device, say), in the order of ``indices``."""
        return StatisticsLayout(self.level, self.bounds, [self.numels[i] for i in indices], self.checksum,
                                self.extra)

    def merge(self, parts: list[tuple[list[int], tuple]]) -> tuple:
        """Results computed apart for groups of parameters, ``(indices, (statistics, signs, float32_values))``
        each laid out by :meth:`subset`, as one ``(statistics, signs, float32_values)`` in parameter order. Signs
        are None at a level without directions; values are None unless every group holds them."""
        sections = {section.name: np.zeros((self.count, section.width)) for section in self.sections}
        signs, values = [None] * self.count, [None] * self.count
        for indices, (statistics, packed, flat) in parts:
            part = self.subset(indices)
            for name, rows in part.split(statistics).items():
                sections[name][indices] = rows
            if packed is not None:
                for i, piece in zip(indices, part.sign_slices()):
                    signs[i] = packed[piece]
            if flat is not None:
                for i, piece in zip(indices, part.value_slices()):
                    values[i] = flat[piece]
        has_values = self.level.has_md5 and all(v is not None for v in values)  # the accelerator path copies apart
        return (np.concatenate([np.zeros(0), *self.in_order(sections)]),
                np.concatenate([np.zeros(0, np.uint8), *signs]) if self.level.has_directions else None,
                np.concatenate([np.zeros(0, np.float32), *values]) if has_values else None)
