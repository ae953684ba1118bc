"""The anomaly flags' rule, pure bookkeeping from the statistics each step already carries (``record.values``: max,
min, norm per parameter): which parameters of a step are anomalous, by their gradients' norms.

- **non-finite**: a parameter whose norm is NaN or infinite: it has NaN or infinite elements, or its norm
  overflowed float32 (an empty parameter's norm is 0). That is this flag, never a spike.
- **spike**, per parameter and for the total norm (``sqrt`` of the sum of squared norms), in both directions:
  :class:`SpikeRule`.

Where a step is judged: in the local dump's process when the step goes there (:mod:`msprobe_mlflow.dump_process`,
steps of many parameters: off the training process's interpreter lock), which returns the flags with the step;
else by the sink that reads them (:class:`AnomalyFlags.flags_of`). What is done with them: the anomaly flags' sink
(:mod:`msprobe_mlflow.sinks.anomalies`) and the always-on tier's trigger
(:mod:`msprobe_mlflow.monitoring.directions_schedule`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from msprobe_mlflow.records import StepRecord

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
        self._judged_elsewhere = False  # a step came judged: the series are in the judge's windows, not these

    def flags_of(self, record: StepRecord) -> list[Flag]:
        """``record``'s flags: those the local dump's process judged when it did (``record.anomaly_flags``; an
        exception it raised judging is raised here), else judged here. The windows start empty when this judges
        again after steps judged there (the process ended): they would hold older steps than the last ``window``."""
        judged = record.anomaly_flags
        if judged is not None:
            self._judged_elsewhere = True
            if isinstance(judged, Exception):
                raise judged
            return judged
        if self._judged_elsewhere:
            self._judged_elsewhere = False
            self.parameters, self.total = LogNormWindow(self.rule.window), LogNormWindow(self.rule.window)
        return self.step_flags(record)

    def step_flags(self, record: StepRecord) -> list[Flag]:
        norms = np.asarray(record.values, dtype=np.float64).reshape(len(record.names), 3)[:, 2]
        nonfinite = ~np.isfinite(norms)  # NaN and inf elements reach the norm; max and min add nothing
        flags = [Flag(record.step, record.names[i], "nonfinite", float(norms[i])) for i in np.flatnonzero(nonfinite)]
        flags += spike_flags(record.step, record.names, norms, self.parameters.push(record.names, norms), self.rule)
        total = np.sqrt(np.sum(np.square(norms), keepdims=True))  # NaN when any norm is not finite: not judged
        flags += spike_flags(record.step, [None], total, self.total.push(["total"], total), self.rule)
        return flags
