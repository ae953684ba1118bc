"""The suspicious-step rule (documented by msprobe, never coded there), on similarity series: no I/O.

A series (one parameter's, or the summary's, similarity at each compared step) trips the rule at a step when

- the step is the first compared step and the similarity is below ``first_threshold`` (default 0.97): two runs
  that start alike should agree on almost every gradient sign; or
- the similarity fell by more than ``drop_threshold`` (default 0.03) since the series' previous compared value.

``fall`` measures how far: previous value minus this one, the previous value of the first compared step being 1.0
(full agreement). Values that are ``None`` (a parameter absent from one side at that step, or empty) are skipped:
the next value is compared with the last one present. A rank's first suspicious step is the earliest step where any
series trips; the parameters that trip it are listed by ``fall``, largest first.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

DEFAULT_FIRST_THRESHOLD = 0.97
DEFAULT_DROP_THRESHOLD = 0.03
# Rounding slack, so that a drop from 1.0 to 0.97 is not "more than 0.03" through float error.
_TOLERANCE = 1e-12

Series = list[float | None]


@dataclass(frozen=True)
class Trip:
    """A series tripping the rule at ``step``: ``reason`` is ``first`` (below the first threshold) or ``drop``."""

    name: str
    step: int
    similarity: float
    previous: float
    reason: str

    @property
    def fall(self) -> float:
        return self.previous - self.similarity


def check_thresholds(first_threshold: float, drop_threshold: float) -> None:
    for key, value in (("first_threshold", first_threshold), ("drop_threshold", drop_threshold)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ValueError(f"{key} = {value!r} is not accepted; expected a number between 0 and 1")


def trip_at(name: str, step: int, value: float, previous: float | None, first_step: bool,
            first_threshold: float, drop_threshold: float) -> Trip | None:
    """The rule at one value of a series: ``previous`` is the series' last compared value (None: none yet),
    ``first_step`` says whether ``step`` is the first compared step."""
    if first_step and value < first_threshold:
        return Trip(name, step, value, 1.0, "first")
    if previous is not None and previous - value > drop_threshold + _TOLERANCE:
        return Trip(name, step, value, previous, "drop")
    return None


def series_trips(name: str, steps: list[int], values: Series, first_threshold: float = DEFAULT_FIRST_THRESHOLD,
                 drop_threshold: float = DEFAULT_DROP_THRESHOLD) -> list[Trip]:
    """Every step at which one series trips the rule, in step order."""
    trips = []
    previous = None
    for index, (step, value) in enumerate(zip(steps, values)):
        if value is None:
            continue
        trip = trip_at(name, step, value, previous, index == 0, first_threshold, drop_threshold)
        if trip is not None:
            trips.append(trip)
        previous = value
    return trips


@dataclass
class RankVerdict:
    """``parameter_trips``: the parameters tripping at ``first_suspicious_step``, largest fall first;
    ``summary_trip``: the summary's trip at that step, if the summary trips there too."""

    rank: int
    first_suspicious_step: int | None = None
    summary_trip: Trip | None = None
    parameter_trips: list[Trip] = field(default_factory=list)

    @property
    def suspicious(self) -> bool:
        return self.first_suspicious_step is not None


def judge_rank(rank: int, steps: list[int], summary: Series, parameters: dict[str, Series],
               first_threshold: float = DEFAULT_FIRST_THRESHOLD,
               drop_threshold: float = DEFAULT_DROP_THRESHOLD) -> RankVerdict:
    check_thresholds(first_threshold, drop_threshold)
    summary_trips = series_trips("summary", steps, summary, first_threshold, drop_threshold)
    parameter_trips = [trip for name, values in parameters.items()
                       for trip in series_trips(name, steps, values, first_threshold, drop_threshold)]
    tripped_steps = [trip.step for trip in summary_trips + parameter_trips]
    if not tripped_steps:
        return RankVerdict(rank)
    first = min(tripped_steps)
    summary_trip = next((t for t in summary_trips if t.step == first), None)
    return RankVerdict(rank, first, summary_trip, largest_fall_first(t for t in parameter_trips if t.step == first))


def largest_fall_first(trips) -> list[Trip]:
    return sorted(trips, key=lambda t: (-t.fall, t.name))


class StepByStepJudge:
    """:func:`judge_rank` fed one compared step at a time, for a verdict while training runs: the same rule on the
    same series gives the same first suspicious step, summary trip and parameter trips, in the same order.

    ``judge(step, summary, parameters)`` takes the next compared step (steps ascending; ``parameters``: name ->
    value, ``None`` or absent where not compared) and returns the rank's verdict at the step where the rule first
    trips, else None; it judges nothing after that step (the verdict names the first suspicious step only).
    ``judge_values`` is the same with the values as one array (NaN: not compared), a few array operations per step
    however many parameters: it runs beside the training, whose interpreter it shares.
    """

    def __init__(self, rank: int, first_threshold: float = DEFAULT_FIRST_THRESHOLD,
                 drop_threshold: float = DEFAULT_DROP_THRESHOLD):
        check_thresholds(first_threshold, drop_threshold)
        self.rank = rank
        self.first_threshold = first_threshold
        self.drop_threshold = drop_threshold
        self.verdict: RankVerdict | None = None
        self._steps_judged = 0
        self._previous_summary: float | None = None
        self._slots: dict[str, int] = {}  # parameter -> its place in _previous
        self._previous = np.empty(0)  # each parameter's last compared value, NaN: none yet
        self._last_names: tuple[str, ...] | None = None
        self._last_places = np.empty(0, dtype=np.int64)

    def judge(self, step: int, summary: float | None, parameters: dict[str, float | None]) -> RankVerdict | None:
        values = np.array([np.nan if value is None else value for value in parameters.values()], dtype=np.float64)
        return self.judge_values(step, summary, tuple(parameters), values)

    def _places(self, names: tuple[str, ...]) -> np.ndarray:
        if names != self._last_names:  # a step laid out like the last one (the usual case) skips the lookups
            places = [self._slots.setdefault(name, len(self._slots)) for name in names]
            if len(self._slots) > len(self._previous):
                self._previous = np.concatenate([self._previous, np.full(len(self._slots) - len(self._previous),
                                                                         np.nan)])
            self._last_names, self._last_places = names, np.array(places, dtype=np.int64)
        return self._last_places

    def judge_values(self, step: int, summary: float | None, names: tuple[str, ...],
                     values: np.ndarray) -> RankVerdict | None:
        if self.verdict is not None:
            return None
        first_step, self._steps_judged = self._steps_judged == 0, self._steps_judged + 1
        thresholds = (self.first_threshold, self.drop_threshold)
        summary_trip = None
        if summary is not None:
            summary_trip = trip_at("summary", step, summary, self._previous_summary, first_step, *thresholds)
            self._previous_summary = summary
        places = self._places(names)
        previous = self._previous[places]
        compared = ~np.isnan(values)
        below_first = compared & (values < self.first_threshold) if first_step else np.zeros(len(values), bool)
        with np.errstate(invalid="ignore"):  # NaN - x: no previous value, never a drop
            dropped = compared & ~below_first & (previous - values > self.drop_threshold + _TOLERANCE)
        self._previous[places[compared]] = values[compared]
        parameter_trips = [Trip(names[i], step, float(values[i]), 1.0, "first") for i in np.flatnonzero(below_first)]
        parameter_trips += [Trip(names[i], step, float(values[i]), float(previous[i]), "drop")
                            for i in np.flatnonzero(dropped)]
        if summary_trip is None and not parameter_trips:
            return None
        self.verdict = RankVerdict(self.rank, step, summary_trip, largest_fall_first(parameter_trips))
        return self.verdict


@dataclass
class Verdict:
    first_threshold: float
    drop_threshold: float
    ranks: list[RankVerdict]

    @property
    def suspicious(self) -> bool:
        return any(rank.suspicious for rank in self.ranks)

    @property
    def first_suspicious_step(self) -> int | None:
        """The earliest suspicious step over all ranks, or ``None``."""
        steps = [rank.first_suspicious_step for rank in self.ranks if rank.suspicious]
        return min(steps) if steps else None

    def to_dict(self) -> dict:
        def trip_dict(trip: Trip | None) -> dict | None:
            return None if trip is None else {**asdict(trip), "fall": trip.fall}

        return {
            "suspicious": self.suspicious,
            "first_suspicious_step": self.first_suspicious_step,
            "first_threshold": self.first_threshold,
            "drop_threshold": self.drop_threshold,
            "ranks": [{"rank": r.rank, "first_suspicious_step": r.first_suspicious_step,
                       "summary_trip": trip_dict(r.summary_trip),
                       "parameter_trips": [trip_dict(t) for t in r.parameter_trips]} for r in self.ranks],
        }

    def describe(self, max_parameters: int = 5) -> str:
        """A few lines for a person: per rank, the first suspicious step and the parameters that fell most."""
        lines = []
        for rank in self.ranks:
            if not rank.suspicious:
                lines.append(f"rank {rank.rank}: no suspicious step (first < {self.first_threshold}, "
                             f"drop > {self.drop_threshold})")
                continue
            line = f"rank {rank.rank}: first suspicious step {rank.first_suspicious_step}"
            if rank.summary_trip:
                line += (f" (summary {rank.summary_trip.previous:.4f} -> {rank.summary_trip.similarity:.4f})")
            lines.append(line)
            shown = rank.parameter_trips[:max_parameters]
            for trip in shown:
                lines.append(f"    {trip.name}: {trip.previous:.4f} -> {trip.similarity:.4f} (fell {trip.fall:.4f})")
            if len(rank.parameter_trips) > len(shown):
                lines.append(f"    ... and {len(rank.parameter_trips) - len(shown)} more parameters")
        return "\n".join(lines)
