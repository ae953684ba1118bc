"""msprobe's gradient levels as one table of data (msprobe 1.0.3 keeps them as ``level_adp``), and the
``grad_summary`` CSV header each one writes.

| level | CSV header                                                      | direction files |
|-------|-----------------------------------------------------------------|-----------------|
| L0    | ``param_name,MD5,max,min,norm,shape``                           | no              |
| L1    | ``param_name,max,min,norm,shape``                               | yes             |
| L2    | ``param_name,(-inf, b0],...,(bn, inf),=0,max,min,norm,shape``   | yes             |

Code asks the table what a level records (``LEVELS[name].has_buckets``) and never compares level names.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

MD5_COLUMN = "MD5"
ZERO_COLUMN = "=0"


def bucket_labels(bounds) -> list[str]:
    """msprobe's L2 column names: ``(-inf, b0]``, ``(b0, b1]``, ..., ``(bn, inf)``, then ``=0``; each bound
    formatted with Python ``str()`` (``-1``, ``0.01``, ``1e-05``)."""
    labels = [f"(-inf, {bounds[0]}]"]
    labels += [f"({low}, {high}]" for low, high in zip(bounds, bounds[1:])]
    return labels + [f"({bounds[-1]}, inf)", ZERO_COLUMN]


@dataclass(frozen=True)
class Level:
    """What one ``grad_level`` records per parameter, besides ``max, min, norm`` and the shape.

    ``has_md5``: the MD5 of the gradient's float32 bytes. ``has_directions``: the sign of every element
    (``step{S}/`` files). ``has_buckets``: the fraction of elements in each bucket of ``bounds`` and equal to 0.
    ``has_exponents`` (ours, not in msprobe's CSV; opt-in at every level, :func:`recorded_level`): the elements at
    each binary exponent (:func:`msprobe_mlflow.statistics_table.exponent_counts`), in a file beside the CSV.
    """

    name: str
    has_md5: bool = False
    has_directions: bool = False
    has_buckets: bool = False
    has_exponents: bool = False

    @property
    def own_columns(self) -> list[str]:
        """The header columns that tell this level's CSV apart, whatever the bounds."""
        return [column for column, present in ((MD5_COLUMN, self.has_md5), (ZERO_COLUMN, self.has_buckets))
                if present]


LEVELS: dict[str, Level] = {level.name: level for level in (
    Level("L0", has_md5=True),
    Level("L1", has_directions=True),
    Level("L2", has_directions=True, has_buckets=True),
)}


def recorded_level(level: "str | Level", exponents: bool = False) -> Level:
    """The :class:`Level` of ``level`` (a name or a level), with the exponent counts too where asked (the opt-in
    ``statistics=["exponents"]``)."""
    found = LEVELS[level] if isinstance(level, str) else level
    return replace(found, has_exponents=True) if exponents and not found.has_exponents else found


def csv_header(level: str, bounds, extra=()) -> list[str]:
    """The ``grad_summary`` header of ``level`` (a ``grad_level`` name) with these bucket ``bounds``, and the
    columns of the opt-in ``extra`` statistics (:mod:`msprobe_mlflow.statistics_table`) after ``norm``."""
    recorded = LEVELS[level]
    return ["param_name", *([MD5_COLUMN] if recorded.has_md5 else []),
            *(bucket_labels(bounds) if recorded.has_buckets else []), "max", "min", "norm", *extra, "shape"]


def level_of_header(header: list[str]) -> Level:
    """The inverse of :func:`csv_header` (bounds aside): the level with the most of its own columns (``MD5``,
    ``=0``) in ``header``, L1 when it holds none. Used where only a dump's CSV is left to tell its level."""
    matching = [level for level in LEVELS.values() if all(column in header for column in level.own_columns)]
    return max(matching, key=lambda level: len(level.own_columns))
