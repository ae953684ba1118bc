"""Anomaly flags on every run, no baseline needed: non-finite gradients and gradient-norm spikes, from the statistics
each step already carries (``record.values``: max, min, norm per parameter), on a thread of their own.

- **non-finite**: a parameter whose norm is NaN or infinite: it has NaN or infinite elements, or its norm
  overflowed float32 (an empty parameter's norm is 0). That is this flag, never a spike.
- **spike**, per parameter and for the total norm (``sqrt`` of the sum of squared norms), in both directions:
  :class:`SpikeRule`.

What lands where (the local dump first, ``{dump}/rank{R}/findings/anomalies.csv``; MLflow through the run's
``annotate``): every flag as a CSV row (``step,scope,parameter,kind,norm,median_norm,band_low,band_high``; scope
``parameter`` or ``total``); at steps with flags only, the metrics ``anomalies/rank{R}/flagged_params`` (parameters
flagged at that step) and ``anomalies/rank{R}/total_norm_spike`` (+1 explosion, -1 collapse): a series with few
points, so the UI's sampling (320 points spread over a metric's own steps) never drops a one-step spike; the tags
``msprobe_mlflow.first_nonfinite_step`` / ``nonfinite_parameters`` and ``msprobe_mlflow.first_spike_step`` /
``spike_parameters`` at the first step of each kind, with one warning each. The CSV goes to MLflow at those first
steps and at the end (not at every flag: a run gone NaN flags every parameter at every step).
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass

import numpy as np

from msprobe_mlflow.background import BackgroundStepWriter
from msprobe_mlflow.dump import findings_dir
from msprobe_mlflow.notices import Notices
from msprobe_mlflow.records import StepRecord
from msprobe_mlflow.vocabulary import finding_tags

ANOMALIES_FILE_NAME = "anomalies.csv"
CSV_HEADER = ["step", "scope", "parameter", "kind", "norm", "median_norm", "band_low", "band_high"]

NORMAL_MAD_SCALE = 1.4826  # MAD x this = the standard deviation, for normally distributed values
MIN_SPREAD = 0.01  # a floor on the spread of log-norms: a perfectly steady norm may still wobble by ~1 %


@dataclass(frozen=True)
class SpikeRule:
    """A norm spikes when its log lies outside ``median +/- threshold x spread`` of the same series' log-norms over
    the last ``window`` steps, ``spread`` being the scaled median absolute deviation (at least ``MIN_SPREAD``):
    an explosion above the band, a collapse below it (a norm of 0 is always below). Judged once the window holds
    ``window // 2`` values; zero and non-finite norms never enter it.

    Why this rule: logs, because gradient norms vary by ratios (a tenfold rise is as alarming at 1e-3 as at 10);
    median and MAD, because one spike in the window moves neither (a mean and standard deviation would hide the
    next one); both directions, because a layer whose gradient collapses is as broken as one that explodes.
    The defaults come from clean 300-step trainings of four small models (an MLP with Adam, the same with SGD and a
    tenfold learning-rate decay, a CNN with SGD momentum, a 2-layer transformer with AdamW; 13,500 parameter-steps;
    ``benchmarks/anomaly_rates.py``, ``benchmarks/results/anomalies.md``): threshold 7 flagged 1 of their 1,200
    steps (threshold 6: 6 steps, 8: none), and still caught every zeroed layer, and in the transformer (steady
    norms, as in large models) every tenfold rise or fall; in the small noisy MLPs, whose scalar bias gradients
    vary tenfold from step to step, only about half of the hundredfold faults stand out. Raise ``threshold`` for
    fewer flags, lower it to catch smaller faults.
    """

    threshold: float = 7.0
    window: int = 50

    def __post_init__(self):
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not math.isfinite(self.threshold) or self.threshold <= 0:
            raise ValueError(f"spike_threshold = {self.threshold!r} is not accepted; expected a positive number "
                             f"(the band's half-width in robust standard deviations of the log-norm, e.g. 7)")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 4:
            raise ValueError(f"spike_window = {self.window!r} is not accepted; expected an integer >= 4 (steps)")

    @property
    def min_history(self) -> int:
        return self.window // 2


@dataclass(frozen=True)
class AnomalyOptions:
    """The anomaly flags' monitor options. ``anomaly_flags`` turns the flags on (the default); ``spike_threshold``
    and ``spike_window`` make the one :class:`SpikeRule` (:attr:`rule`) that both flags spikes and triggers the
    always-on tier's directions (``msprobe_mlflow.monitoring.directions_schedule``), the latter whether or not the
    flags are on."""

    anomaly_flags: bool = True
    spike_threshold: float = SpikeRule.threshold
    spike_window: int = SpikeRule.window

    def __post_init__(self):
        if not isinstance(self.anomaly_flags, bool):
            raise ValueError(f"anomaly_flags = {self.anomaly_flags!r} is not accepted; expected True or False")
        self.rule  # a bad threshold or window is refused here

    @property
    def rule(self) -> SpikeRule:
        return SpikeRule(self.spike_threshold, self.spike_window)

    @property
    def flag_rule(self) -> SpikeRule | None:
        """The rule of the flags sink: None when the flags are off."""
        return self.rule if self.anomaly_flags else None


def robust_bands(logs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of ``logs`` (NaN: no value): the median, the scaled MAD, and the number of values."""
    count = np.isfinite(logs).sum(axis=1)
    rows = np.arange(len(logs))
    low, high = np.maximum(count - 1, 0) // 2, np.minimum(count // 2, logs.shape[1] - 1)  # the middle positions

    def median(values: np.ndarray) -> np.ndarray:
        ordered = np.sort(values, axis=1)  # NaN last
        return (ordered[rows, low] + ordered[rows, high]) / 2

    middle = median(logs)
    return middle, NORMAL_MAD_SCALE * median(np.abs(logs - middle[:, None])), count


class LogNormWindow:
    """The log-norms of named series over the last ``window`` steps, one row per series (NaN: none that step)."""

    def __init__(self, window: int):
        self.rows: dict[str, int] = {}
        self.logs = np.full((0, window), np.nan)
        self.column = 0
        self.names: list[str] = []  # the last step's names and their rows: most steps name the same parameters
        self.index = np.zeros(0, dtype=np.int64)
        self.whole = True  # index is 0, 1, ..., len(logs) - 1: the bands read logs itself, no copy

    def push(self, names: list[str], norms: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The bands of ``names`` before this step (see :func:`robust_bands`), then this step's positive, finite
        norms enter the window."""
        rows = self._rows(names)
        bands = robust_bands(self.logs if self.whole else self.logs[rows])
        self.logs[:, self.column] = np.nan
        with np.errstate(divide="ignore", invalid="ignore"):
            usable = np.isfinite(norms) & (norms > 0)
            self.logs[rows[usable], self.column] = np.log(norms[usable])
        self.column = (self.column + 1) % self.logs.shape[1]
        return bands

    def _rows(self, names: list[str]) -> np.ndarray:
        """The rows of ``names`` (new names get new rows), reused while the names stay those of the last step."""
        if names == self.names:
            return self.index
        for name in names:
            if name not in self.rows:
                self.rows[name] = len(self.rows)
        if len(self.rows) > len(self.logs):
            self.logs = np.vstack([self.logs, np.full((len(self.rows) - len(self.logs), self.logs.shape[1]), np.nan)])
        self.names = list(names)
        self.index = np.array([self.rows[name] for name in names], dtype=np.int64)
        self.whole = np.array_equal(self.index, np.arange(len(self.logs)))
        return self.index


@dataclass(frozen=True)
class Flag:
    """One flag: ``parameter`` None for the total norm; the band (in norm units) is None for a non-finite flag."""

    step: int
    parameter: str | None
    kind: str  # "nonfinite", "explosion" or "collapse"
    norm: float
    median_norm: float | None = None
    band: tuple[float, float] | None = None

    def csv_row(self) -> list:
        low, high = self.band or ("", "")
        return [self.step, "total" if self.parameter is None else "parameter", self.parameter or "", self.kind,
                self.norm, "" if self.median_norm is None else self.median_norm, low, high]

    def describe(self) -> str:
        name = "the total norm" if self.parameter is None else self.parameter
        if self.kind == "nonfinite":
            return name
        return f"{name} ({self.kind}: {self.norm:.4g}, median {self.median_norm:.4g})"


def spike_flags(step: int, names: list[str | None], norms: np.ndarray, bands, rule: SpikeRule) -> list[Flag]:
    """The spikes among finite ``norms`` given their series' bands before this step."""
    median, spread, count = bands
    half_width = rule.threshold * np.maximum(spread, MIN_SPREAD)
    with np.errstate(divide="ignore"):
        logs = np.log(norms)
    judged = (count >= rule.min_history) & np.isfinite(norms)
    flags = []
    for i in np.flatnonzero(judged & ((logs > median + half_width) | (logs < median - half_width))):
        band = (math.exp(median[i] - half_width[i]), math.exp(median[i] + half_width[i]))
        flags.append(Flag(step, names[i], "explosion" if logs[i] > median[i] else "collapse", float(norms[i]),
                          math.exp(median[i]), band))
    return flags


class AnomalyFlags:
    """The flags of one rank's steps, in order: pure bookkeeping, no I/O."""

    def __init__(self, rule: SpikeRule):
        self.rule = rule
        self.parameters = LogNormWindow(rule.window)
        self.total = LogNormWindow(rule.window)

    def step_flags(self, record: StepRecord) -> list[Flag]:
        norms = np.asarray(record.values, dtype=np.float64).reshape(len(record.names), 3)[:, 2]
        nonfinite = ~np.isfinite(norms)  # NaN and inf elements reach the norm; max and min add nothing
        flags = [Flag(record.step, record.names[i], "nonfinite", float(norms[i])) for i in np.flatnonzero(nonfinite)]
        flags += spike_flags(record.step, record.names, norms, self.parameters.push(record.names, norms), self.rule)
        total = np.sqrt(np.sum(np.square(norms), keepdims=True))  # NaN when any norm is not finite: not judged
        flags += spike_flags(record.step, [None], total, self.total.push(["total"], total), self.rule)
        return flags


class AnomalySink:
    """Flags one rank's steps (see the module docstring). ``run`` is the MLflow run's ``annotate`` target, or None
    (findings in the local dump only)."""

    def __init__(self, rule: SpikeRule, dump_path: str, rank: int, *, run=None, notices: Notices | None = None,
                 several_ranks: bool = False):
        self.flags = AnomalyFlags(rule)
        self.path = findings_dir(dump_path, rank) / ANOMALIES_FILE_NAME
        self.rank = rank
        self.run = run
        self.notices = notices or Notices()
        self.several_ranks = several_ranks  # each rank's first findings are also tagged rank{R}.*
        self.first_step: dict[str, int] = {}  # "nonfinite" / "spike" -> the first step flagged so
        self.flag_count = 0
        self._worker = BackgroundStepWriter([self._flag], max_pending=100_000,
                                            name=f"msprobe-mlflow-anomalies-rank{rank}")

    def handle(self, record: StepRecord) -> None:
        values_only = StepRecord(record.rank, record.step, record.level, record.bounds, record.names, record.shapes,
                                 record.values)  # what the flags read: small
        self._worker.submit(lambda: values_only)  # the queue is long: the writer never waits

    def flush(self) -> None:
        self._worker.flush()

    def _flag(self, record: StepRecord) -> None:
        flags = self.flags.step_flags(record)
        if not flags:
            return
        self._append(flags)
        metrics = {f"anomalies/rank{self.rank}/total_norm_spike": 1.0 if f.kind == "explosion" else -1.0
                   for f in flags if f.parameter is None}
        parameters = {f.parameter for f in flags if f.parameter is not None}
        if parameters:
            metrics[f"anomalies/rank{self.rank}/flagged_params"] = float(len(parameters))
        tags = {}
        for kind, found in (("nonfinite", [f for f in flags if f.kind == "nonfinite"]),
                            ("spike", [f for f in flags if f.kind != "nonfinite"])):
            if found and kind not in self.first_step:
                self.first_step[kind] = record.step
                tags.update(self._first(kind, record.step, found))
        if self.run is not None:
            self.run.annotate(step=record.step, metrics=metrics, tags=tags, files=[self.path] if tags else [])

    def _first(self, kind: str, step: int, found: list[Flag]) -> dict[str, str]:
        names = ", ".join(f.describe() for f in found)
        what = "non-finite gradients" if kind == "nonfinite" else "gradient-norm spikes"
        self.notices.warn(f"rank {self.rank}: {what} at step {step}: {names[:500]}; every flag is listed in "
                          f"{self.path}")
        return finding_tags(kind, self.rank, step, names, self.several_ranks)

    def _append(self, flags: list[Flag]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8-sig", newline="") as file:  # no BOM when appending
            writer = csv.writer(file)
            if file.tell() == 0:
                writer.writerow(CSV_HEADER)
            writer.writerows(flag.csv_row() for flag in flags)
        self.flag_count += len(flags)

    def close(self) -> None:
        self._worker.close()
        if self._worker.errors:
            self.notices.warn(f"rank {self.rank}: the anomaly flags failed {len(self._worker.errors)} time(s); "
                              f"first: {self._worker.errors[0]}")
        if self.run is not None and self.flag_count:
            self.run.annotate(files=[self.path])
