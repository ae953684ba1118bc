"""The summary metrics of one rank and step, and the rules for their keys: what every sink reports.

They are computed from the step's ``grad_summary`` CSV text (a live :class:`StepRecord` goes through the same
text), so the live sinks and ``msprobe-mlflow upload`` of the same dump give identical values. A fixed, small set
of keys per rank (the MLflow UI degrades with thousands of keys); per-parameter metrics only for the names or glob
patterns the user lists.
"""
from __future__ import annotations

import fnmatch
import math
import re

import numpy as np

from msprobe_mlflow.dump import SummaryTable
from msprobe_mlflow.formats import LOSSES, format_losses
from msprobe_mlflow.levels import MD5_COLUMN, ZERO_COLUMN
from msprobe_mlflow.records import StepRecord
from msprobe_mlflow.statistics_table import EXTRA, PARAMETER_NORM, ExponentCounts
from msprobe_mlflow.vocabulary import grad_key

MAX_KEY_LENGTH = 250  # MLflow's limit (mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH)
_NOT_ALLOWED = re.compile(r"[^/\w.\- :]")


def metric_key(*parts: str) -> str:
    """``parts`` joined with ``/``, characters outside MLflow's ``[/\\w.\\- :]`` replaced by ``_``, cut to 250:
    one invalid key would reject a whole ``log_batch``."""
    key = _NOT_ALLOWED.sub("_", "/".join(parts))
    key = re.sub(r"/{2,}", "/", key)
    return key[:MAX_KEY_LENGTH]


BUCKETS = "share of gradient elements"  # the L2 buckets' section of a run page: its charts are titled by range


def bucket_metric_names(labels: list[str]) -> list[str]:
    """Metric names of msprobe's L2 columns, in their (numeric) order, titled for a run page: ``(-inf, -1]``,
    ``(-1, 0]``, ``(0, 1]``, ``(1, inf)``, ``=0`` -> ``share of gradient elements/1 at most -1``, ``.../2 over -1 up to
    0``, ``.../3 over 0 up to 1``, ``.../4 over 1``, ``.../exactly 0``.

    MLflow's UI makes the part before the last ``/`` a section and the rest the chart's title, sorted by name: the
    bucket's number comes first (zero-padded from 10 buckets) so that the charts stand in numeric order, and words
    say the range, as keys allow no brackets (msprobe's buckets are open below and closed above, the last one open).
    """
    width = len(str(sum(label != ZERO_COLUMN for label in labels)))
    names, index = [], 0
    for label in labels:
        if label == ZERO_COLUMN:
            names.append(f"{BUCKETS}/exactly 0")
            continue
        low, high = (part.strip() for part in label[1:-1].split(","))
        index += 1
        opening = "over" if label[0] == "(" else "from" if high != "inf" else "at least"
        above = "" if low == "-inf" else f"{opening} {low}"
        below = "" if high == "inf" else f"{'below' if label[-1] == ')' else 'up to' if above else 'at most'} {high}"
        names.append(f"{BUCKETS}/{index:0{width}d} {' '.join(filter(None, (above, below)))}")
    return names


FORMATS = "formats"  # the section of the format losses: ``grad/rank{R}/formats/float16 underflow``...


def format_metrics(prefix: str, exponent_counts: ExponentCounts, loss_scale: float | None) -> dict[str, float]:
    """The share of all the step's gradient elements that each narrow format would lose (underflow to zero,
    subnormal, overflow: :func:`msprobe_mlflow.formats.format_losses`) at the step's loss scale."""
    total = int(exponent_counts.kept.sum())
    return {metric_key(prefix, FORMATS, f"{name} {loss}"): int(count) / total if total else 0.0
            for name, counts in format_losses(exponent_counts, loss_scale).items()
            for loss, count in zip(LOSSES, counts.sum(axis=0))}


NORM_BEFORE_CLIPPING = "total_norm_before_clipping"  # logged by integrations.NormsBeforeClipping


def norm_before_clipping_key(rank: int) -> str:
    """Beside ``total_norm`` (the recorded, applied gradients'), the norm the trainer clipped them from."""
    return grad_key(rank, NORM_BEFORE_CLIPPING)


def _total_norm(norms: list[float]) -> float:
    """The norm of all the parameters together: sqrt of the sum of their squared norms."""
    return math.sqrt(math.fsum(n * n for n in norms))


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def step_metrics(table: SummaryTable, rank: int, param_patterns: tuple[str, ...] = (),
                 exponents: tuple[ExponentCounts, float | None] | None = None) -> dict[str, float]:
    """Summary scalars of one ``grad_summary`` table, keyed ``grad/rank{R}/...``.

    ``total_norm`` = sqrt(sum of the parameters' squared norms); ``max``/``min`` over the finite values; at L2 each
    bucket's and the ``=0`` share of all monitored elements (weighted by element count); each opt-in statistic's
    summary (``param_norm``: the weights' total norm, as ``total_norm``); given the step's ``exponents`` (exponent
    counts and loss scale, where recorded), :func:`format_metrics`. Only what changes from step to step: the
    number of parameters is the CSV's rows, and non-finite gradients are the anomaly flags'
    (``anomalies/rank{R}/flagged_params``, tags ``msprobe_mlflow.first_nonfinite_step``...), so no chart of a run is a
    flat line by construction.
    """
    maxima, minima, norms = table.numbers("max"), table.numbers("min"), table.numbers("norm")
    prefix = grad_key(rank).rstrip("/")
    finite_max, finite_min = _finite(maxima), _finite(minima)
    metrics = {
        f"{prefix}/total_norm": _total_norm(norms),
        f"{prefix}/max": max(finite_max) if finite_max else math.nan,
        f"{prefix}/min": min(finite_min) if finite_min else math.nan,
    }
    bucket_columns = [h for h in table.header if h.startswith("(") or h == ZERO_COLUMN]
    extra = [EXTRA[column] for column in table.header if column in EXTRA]  # opt-in statistics
    numels = [math.prod(shape) for shape in table.shapes()] if bucket_columns or extra else []
    if bucket_columns:
        total, sizes = sum(numels), np.array(numels, np.float64)
        for column, name in zip(bucket_columns, bucket_metric_names(bucket_columns)):
            counts = np.rint(np.array(table.numbers(column)) * sizes)  # each share back to its count (as round())
            metrics[metric_key(prefix, name)] = int(counts.sum()) / total if total else 0.0
    for statistic in extra:
        metrics[metric_key(prefix, statistic.name)] = statistic.summary(table.numbers(statistic.name), numels)
    if PARAMETER_NORM in table.header:  # the weights' norm, as total_norm is the gradients'
        metrics[metric_key(prefix, PARAMETER_NORM)] = _total_norm(table.numbers(PARAMETER_NORM))
    if exponents is not None:
        metrics.update(format_metrics(prefix, *exponents))
    if param_patterns:
        for name, high, low, norm in zip(table.column("param_name"), maxima, minima, norms):
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in param_patterns):
                for statistic, value in (("max", high), ("min", low), ("norm", norm)):
                    metrics[metric_key(prefix, "param", name, statistic)] = value
    return metrics


def record_metrics(record: StepRecord, param_patterns: tuple[str, ...] = ()) -> dict[str, float]:
    """:func:`step_metrics` of a live record: equal to those of the CSV the dump holds for it (``repr`` round-trips
    every float), read from the record's numbers, as parsing that text back costs the writer thread, which shares
    the interpreter lock with training, a millisecond a step of 512 parameters."""
    exponents = None if record.exponent_counts is None else (record.exponent_counts, record.loss_scale)
    return step_metrics(_RecordColumns(record), record.rank, param_patterns, exponents)


class _RecordColumns:
    """A live record as :func:`step_metrics` reads a :class:`SummaryTable`: header, float columns, shapes, names."""

    def __init__(self, record: StepRecord):
        self.header = record.csv_header()
        numeric = [h for h in self.header if h not in ("param_name", MD5_COLUMN, "shape")]
        self._numbers = dict(zip(numeric, record.numbers().T.tolist()))
        self._record = record

    def numbers(self, name: str) -> list[float]:
        return self._numbers[name]

    def shapes(self) -> list[tuple[int, ...]]:
        return self._record.shapes

    def column(self, name: str) -> list[str]:
        if name != "param_name":
            raise ValueError(f"a live record has no text column {name!r}")
        return self._record.names
