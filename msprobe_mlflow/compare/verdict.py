"""Verdicts on two runs' steps, and the rules that reach them: no I/O.

A rule is a *judge* fed one compared step at a time (:class:`~msprobe_mlflow.compare.step.StepComparison`, steps
ascending); it returns the rank's :class:`RankVerdict` at the first step it finds suspicious and judges nothing after
that step. ``compare`` feeds it every step of two dumps in order, the live verdict each step as it lands: one
implementation, so both give the same verdict on the same steps.

Two rules (:data:`RULES`; ``compare/rules.py`` makes the judge of each):

- ``noise`` (the default, ``compare/noise_rule.py``): judges each step against the pair's own numerical noise, on
  the directions and on the statistics both runs recorded.
- ``msprobe``: the rule msprobe documents (and never coded). A series (one parameter's, or the summary's, direction
  similarity at each compared step) trips at a step when the step is the first compared step and the similarity is
  below ``first_threshold`` (default 0.97), or the similarity fell by more than ``drop_threshold`` (default 0.03)
  since the series' previous compared value. ``fall`` = previous value minus this one, the previous value of the
  first compared step being 1.0. Values not compared (a parameter absent from one side, or empty) are skipped: the
  next value is compared with the last one present. The parameters tripping at the first suspicious step are listed
  by ``fall``, largest first.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from msprobe_mlflow.formats import UNIT_ROUNDOFF

DEFAULT_FIRST_THRESHOLD = 0.97
DEFAULT_DROP_THRESHOLD = 0.03
# Rounding slack, so that a drop from 1.0 to 0.97 is not "more than 0.03" through float error.
_TOLERANCE = 1e-12
SUMMARY_SLOT = ""  # msprobe's rule keeps the summary's series beside the parameters' under a name none can have

Series = list[float | None]
PRECISION = "precision"  # the noise rule's reason for a gradient in a 16-bit format: a format, not a distance
ZEROS = "zeros"  # the noise rule's reason for a share of the model's gradient elements gone to (or from) zero
NO_SCORE = (PRECISION, ZEROS)  # reasons told by what was found, not by how far beyond a noise
# The noise rule's grades of a suspicious step, strongest first: a *break* is beyond anything rounding can do; a
# *departure* is beyond the pair's learnt noise, within what amplified rounding has been measured to do (a sharp
# region, a loss spike: a benign pair that genuinely parts) or a small bug.
BREAK, DEPARTURE = "break", "departure"
GRADES = (BREAK, DEPARTURE)
DEPARTURE_MEANS = "beyond this pair's learnt noise, within what amplified rounding can do (a sharp region, a loss " \
    "spike, a near tie that switched a ReLU or a router: BatchNorm nets often part so) or a small bug"


@dataclass(frozen=True)
class Trip:
    """A series tripping its rule at ``step``.

    ``similarity``: the direction similarity there (None: the series is a statistic's, not a direction's);
    ``previous``: what the rule expected (msprobe: the previous value; noise: the series' expected similarity);
    ``reason``: msprobe ``first`` or ``drop``; noise ``direction``, ``norm``, ``distribution``, ``weight``,
    ``precision`` or ``zeros``; ``score``: how far beyond its noise (noise rule: robust deviations, 0 for
    ``precision``, a format, and ``zeros``, a share; msprobe: the fall); ``detail``: the numbers, for a person."""

    name: str
    step: int
    similarity: float | None
    previous: float | None
    reason: str
    score: float = 0.0
    detail: str = ""

    @property
    def fall(self) -> float:
        """How far the similarity fell below what was expected (0 for a trip on statistics alone)."""
        if self.similarity is None or self.previous is None:
            return 0.0
        return self.previous - self.similarity


@dataclass(frozen=True)
class SignNoise:
    """A parameter whose signs disagree at rounding level: some elements (``signs``: the key third of a fused q/k/v
    bias; its magnitudes agree) or its whole gradient (``whole gradient``: tiny on both sides, as a bias right
    before a normalisation). Reported, never a trip or a culprit."""

    name: str
    step: int  # the first step it was seen
    similarity: float
    norm_difference: float  # relative: |norm_b - norm_a| / max(norm_a, norm_b)
    kind: str = "signs"  # "signs": part of its elements are at rounding level; "whole gradient": all of them


@dataclass(frozen=True)
class Sensitivity:
    """What the noise rule could not have seen (issue 47's decision 1), at ``step``, the last it judged: a
    gradient's norm moving by less than ``median`` of its scale from its usual difference with the other run is
    within the pair's noise for half of the parameters judged on their norms; ``finest`` for ``finest_name``, the
    most sensitive. A single parameter's change breaks only beyond 1% (smaller ones count where the whole model's
    differences jump at once). None where the runs agreed bit for bit at every step: any difference breaks."""

    step: int
    median: float
    finest: float
    finest_name: str

    def note(self) -> str:
        """The line under the rank."""
        median, finest = f"{self.median * 100:.2g}%", f"{self.finest * 100:.2g}%"
        which = f"for the finest, {self.finest_name}, too" if finest == median else \
            f"half of the parameters; {finest} for {self.finest_name}, the finest"
        return (f"what it could not see: at step {self.step}, a gradient norm moving by less than {median} of its "
                f"scale is within this pair's noise ({which})")

    def headline(self) -> str:
        """The same, short, for a consistent comparison's first line."""
        return f"norm moves under {self.median * 100:.2g}% of a gradient's scale were within the pair's noise at " \
            f"step {self.step}"


@dataclass(frozen=True)
class FirstSteps:
    """Where the pair's precision was neither given nor recorded: the largest difference of the first steps' norms
    (``difference`` of its scale, ``name`` at ``step``) when it is beyond what float32 rounding does there
    (``bound``) and within what ``finest`` (the finest format whose rounding can) does. A bug present from step 0
    and smaller than bfloat16 rounding, the bound the rule then judges against, looks like this, so the verdict
    says it.
    ``sixteen_bit``: the one run (``"A"`` or ``"B"``) whose first steps' gradients came out of a 16-bit format
    (their max and min carry at most 11 significant bits), in ``sixteen_bit_parameters`` (the first of them named
    ``sixteen_bit_example``): autocast, or a cast the other run does not make. Where both runs' gradients do,
    bfloat16's rounding is the pair's and there is no note."""

    difference: float
    name: str
    step: int
    bound: float
    finest: str
    sixteen_bit: str | None = None
    sixteen_bit_parameters: int = 0
    sixteen_bit_example: str = ""

    def note(self) -> str:
        found = (f"first steps: {self.name}'s norm differs by {self.difference:.2%} of its scale at step {self.step}, "
                 f"beyond float32 rounding ({self.bound:.2g}), within {self.finest}'s: ")
        if self.sixteen_bit is None:
            return found + ("if both runs compute in float32 (no autocast, TF32 or HF32), --precision float32 judges "
                            "the first steps at float32's bound")
        return found + (f"run {self.sixteen_bit} computes {self.sixteen_bit_parameters} parameter(s)' gradients in a "
                        f"16-bit format (e.g. {self.sixteen_bit_example}), the other run none: under autocast that "
                        f"is the pair's rounding; if it is a cast, --precision float32 judges the first steps at "
                        f"float32's bound")


@dataclass
class RankVerdict:
    """``parameter_trips``: the parameters tripping at ``first_suspicious_step``, most evidence first;
    ``summary_trip``: the summary's trip at that step, if it trips there too; ``sign_noise``: parameters whose
    sign disagreement was recognised as noise (noise rule); ``summary_band``: per judged step, the lowest summary
    similarity the rule expected from noise (noise rule); ``first_steps``: see :class:`FirstSteps` (noise rule);
    ``recorded_precision``: where the pair's precision was not given, the format the noise rule judged the first
    steps at from what the runs recorded: the coarsest format both monitors recorded at every first step,
    bfloat16 where both runs' first steps hold gradients out of a 16-bit format (a cast torch does not report)."""

    rank: int
    first_suspicious_step: int | None = None
    summary_trip: Trip | None = None
    parameter_trips: list[Trip] = field(default_factory=list)
    sign_noise: list[SignNoise] = field(default_factory=list)
    summary_band: dict[int, float] = field(default_factory=dict)
    first_steps: FirstSteps | None = None
    recorded_precision: str | None = None
    grade: str | None = None  # noise rule: BREAK or DEPARTURE at the first suspicious step (msprobe's rule: None)
    evidence: str = ""  # the grade's reason, in words
    coarser_format: str | None = None  # a first-steps break within this coarser format's rounding (see silencer)
    sensitivity: Sensitivity | None = None  # noise rule, no suspicious step: what it could not have seen

    def silencer(self) -> str | None:
        """What would make the verdict quiet where it would be right to: a first-steps break that lies within a
        coarser format's rounding than the one judged at, if a run computed in that format unknown to torch."""
        if self.coarser_format is None:
            return None
        return (f"every norm that broke at step {self.first_suspicious_step} lies within {self.coarser_format}'s "
                f"rounding: if a run computed in {self.coarser_format} without torch reporting it (an accelerator "
                f"running float32 matmuls in TF32 or HF32, as Ascend can), --precision {self.coarser_format} "
                f"(precision='{self.coarser_format}') judges the first steps at its bound; if not, this is a bug")

    @property
    def suspicious(self) -> bool:
        return self.first_suspicious_step is not None

    def fails(self, grade: str) -> bool:
        """Suspicious with at least ``grade``'s evidence (msprobe's rule, which grades nothing, fails at any)."""
        return self.suspicious and (self.grade is None or GRADES.index(self.grade) <= GRADES.index(grade))


def check_thresholds(first_threshold: float, drop_threshold: float) -> None:
    for key, value in (("first_threshold", first_threshold), ("drop_threshold", drop_threshold)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ValueError(f"{key} = {value!r} is not accepted; expected a number between 0 and 1")


RULES = ("noise", "msprobe")
DEFAULT_RULE = "noise"


def check_rule(rule: str) -> None:
    if rule not in RULES:
        raise ValueError(f"rule = {rule!r} is not accepted; expected one of {', '.join(map(repr, RULES))}")


def check_precision(precision: str | None) -> None:
    if precision is not None and precision not in UNIT_ROUNDOFF:
        raise ValueError(f"precision = {precision!r} is not accepted; expected one of "
                         f"{', '.join(map(repr, UNIT_ROUNDOFF))} (the coarsest format either run computed in), or "
                         f"None (not known: bfloat16 assumed)")


@dataclass(frozen=True)
class RuleSettings:
    """Which rule judges, with its settings (the thresholds are msprobe's rule's only), checked when made."""

    rule: str = DEFAULT_RULE
    first_threshold: float = DEFAULT_FIRST_THRESHOLD
    drop_threshold: float = DEFAULT_DROP_THRESHOLD
    precision: str | None = None  # noise rule: the coarsest format either run computed in (None: not known)

    def __post_init__(self):
        check_rule(self.rule)
        check_thresholds(self.first_threshold, self.drop_threshold)
        check_precision(self.precision)
        if self.precision is not None and self.rule != "noise":
            raise ValueError(f"precision = {self.precision!r} applies to the noise rule only (msprobe's rule reads "
                             f"fixed thresholds); use rule='noise' or leave precision out")

    def to_dict(self) -> dict:
        settings = {"rule": self.rule}
        if self.rule == "msprobe":
            settings.update(first_threshold=self.first_threshold, drop_threshold=self.drop_threshold)
        elif self.precision is not None:
            settings.update(precision=self.precision)
        return settings

    def describe(self) -> str:
        """The rule in a few words, for the verdict's lines."""
        if self.rule == "msprobe":
            return f"msprobe's rule: first < {self.first_threshold}, drop > {self.drop_threshold}"
        precision = f"; first steps judged at {self.precision} rounding" if self.precision else ""
        return f"noise-aware rule: beyond the pair's own numerical noise{precision}"


def rule_settings(rule: "str | RuleSettings" = DEFAULT_RULE, first_threshold: float | None = None,
                  drop_threshold: float | None = None, precision: str | None = None) -> RuleSettings:
    """The rule as the one value that travels to the judge: ``rule`` a :class:`RuleSettings` as it is (a setting
    given beside it is refused: it would be ignored), or a rule's name with the settings given (None: the
    default)."""
    given = {name: value for name, value in (("first_threshold", first_threshold), ("drop_threshold", drop_threshold),
                                             ("precision", precision)) if value is not None}
    if isinstance(rule, RuleSettings):
        if given:
            raise ValueError(f"{', '.join(given)} given beside rule={rule!r}; put them in the RuleSettings")
        return rule
    return RuleSettings(rule, **given)


def largest_fall_first(trips) -> list[Trip]:
    return sorted(trips, key=lambda t: (-t.fall, t.name))


def judged_values(comparison) -> tuple[float | None, np.ndarray]:
    """What a rule sees of a step's directions: the summary similarity (None when no element was compared) and each
    compared parameter's similarity, NaN for an empty one."""
    agreeing, numel = comparison.summary_counts
    summary = agreeing / numel if numel else None
    values = np.divide(comparison.agreeing, comparison.numels, out=np.full(len(comparison.numels), np.nan),
                       where=comparison.numels > 0)
    return summary, values


class MsprobeJudge:
    """msprobe's rule (see the module docstring), one compared step at a time: a few array operations per step
    however many parameters."""

    def __init__(self, rank: int, first_threshold: float = DEFAULT_FIRST_THRESHOLD,
                 drop_threshold: float = DEFAULT_DROP_THRESHOLD):
        check_thresholds(first_threshold, drop_threshold)
        self.rank = rank
        self.first_threshold = first_threshold
        self.drop_threshold = drop_threshold
        self.verdict: RankVerdict | None = None
        self._steps_judged = 0
        self._slots: dict[str, int] = {}  # parameter -> its place in _previous
        self._previous = np.empty(0)  # each parameter's last compared value, NaN: none yet
        self._last_names: tuple[str, ...] | None = None
        self._last_places = np.empty(0, dtype=np.int64)

    def report(self) -> RankVerdict:
        return self.verdict or RankVerdict(self.rank)

    def finish(self) -> None:
        """Judging ends: msprobe's rule holds no step back."""

    def judge_step(self, comparison) -> RankVerdict | None:
        summary, values = judged_values(comparison)
        return self.judge_values(comparison.step, summary, comparison.compared, values)

    def judge(self, step: int, summary: float | None, parameters: dict[str, float | None]) -> RankVerdict | None:
        """The rule on plain values (``parameters``: name -> similarity, None or absent where not compared)."""
        values = np.array([np.nan if value is None else value for value in parameters.values()], dtype=np.float64)
        return self.judge_values(step, summary, tuple(parameters), values)

    def _places(self, names: tuple[str, ...]) -> np.ndarray:
        if names != self._last_names:  # a step laid out like the last one (the usual case) skips the lookups
            self._last_names, self._last_places = names, slots_of(self._slots, names)
            if len(self._slots) > len(self._previous):
                self._previous = np.concatenate([self._previous, np.full(len(self._slots) - len(self._previous),
                                                                         np.nan)])
        return self._last_places

    def judge_values(self, step: int, summary: float | None, names: tuple[str, ...],
                     values: np.ndarray) -> RankVerdict | None:
        """The rule on one step: the summary and every parameter are series alike, judged by the same lines."""
        if self.verdict is not None:
            return None
        first_step, self._steps_judged = self._steps_judged == 0, self._steps_judged + 1
        places = self._places((SUMMARY_SLOT, *names))
        values = np.concatenate([[np.nan if summary is None else summary], values])
        previous = self._previous[places]
        compared = ~np.isnan(values)
        below_first = compared & (values < self.first_threshold) if first_step else np.zeros(len(values), bool)
        with np.errstate(invalid="ignore"):  # NaN - x: no previous value, never a drop
            dropped = compared & ~below_first & (previous - values > self.drop_threshold + _TOLERANCE)
        self._previous[places[compared]] = values[compared]
        labels = ("summary", *names)
        trips = {i: Trip(labels[i], step, float(values[i]), 1.0, "first", 1.0 - float(values[i]))
                 for i in np.flatnonzero(below_first)}
        trips.update({i: Trip(labels[i], step, float(values[i]), float(previous[i]), "drop",
                              float(previous[i] - values[i])) for i in np.flatnonzero(dropped)})
        if not trips:
            return None
        summary_trip = trips.pop(0, None)
        parameter_trips = list(trips.values())
        self.verdict = RankVerdict(self.rank, step, summary_trip, largest_fall_first(parameter_trips))
        return self.verdict


def slots_of(slots: dict[str, int], names: tuple[str, ...]) -> np.ndarray:
    """Each name's place in a judge's per-parameter arrays, new names appended."""
    return np.array([slots.setdefault(name, len(slots)) for name in names], dtype=np.int64)


def judge_rank(rank: int, steps: list[int], summary: Series, parameters: dict[str, Series],
               first_threshold: float = DEFAULT_FIRST_THRESHOLD,
               drop_threshold: float = DEFAULT_DROP_THRESHOLD) -> RankVerdict:
    """msprobe's rule on whole series (``parameters``: name -> value per step, None where not compared)."""
    judge = MsprobeJudge(rank, first_threshold, drop_threshold)
    for index, step in enumerate(steps):
        if judge.judge(step, summary[index], {name: values[index] for name, values in parameters.items()}):
            break
    return judge.report()


@dataclass(frozen=True)
class Coverage:
    """How much of the two runs was compared, over all ranks: parameters paired, and those of A and of B that
    were not (no counterpart in the other run, or shapes that differ), and the steps left out as damaged
    (``compare --skip-damaged``). A verdict on part of the runs says so."""

    paired: int
    only_in_a: int = 0
    only_in_b: int = 0
    skipped_steps: int = 0

    def partial(self) -> str | None:
        """``partial: the models differ (2 of 6 parameters of A, 1 of 5 of B unpaired); 1 damaged step skipped``
        where something was left out, else None."""
        sides = []
        if self.only_in_a:
            sides.append(f"{self.only_in_a} of {self.paired + self.only_in_a} parameters of A")
        if self.only_in_b:
            words = "of B" if sides else "parameters of B"
            sides.append(f"{self.only_in_b} of {self.paired + self.only_in_b} {words}")
        parts = [f"the models differ ({', '.join(sides)} unpaired)"] if sides else []
        if self.skipped_steps:
            parts.append(f"{self.skipped_steps} damaged step{'s' if self.skipped_steps > 1 else ''} skipped")
        return f"partial: {'; '.join(parts)}" if parts else None

    def caveat(self) -> str:
        """What a partial verdict covers, and where to look for what it does not."""
        caveats = []
        if self.only_in_a or self.only_in_b:
            caveats.append("a verdict on the compared parameters only (same model? see 'only in' above; pair other "
                           "names with --name-map)")
        if self.skipped_steps:
            caveats.append("a verdict on the readable steps only (see 'damaged, skipped' above)")
        return "; ".join(caveats)


@dataclass
class Verdict:
    settings: RuleSettings
    ranks: list[RankVerdict]
    coverage: Coverage | None = None  # None: not known (the live verdict's steps, msprobe's rule on series)

    @property
    def rule(self) -> str:
        return self.settings.rule

    @property
    def suspicious(self) -> bool:
        return any(rank.suspicious for rank in self.ranks)

    @property
    def first_suspicious_step(self) -> int | None:
        """The earliest suspicious step over all ranks, or ``None``."""
        steps = [rank.first_suspicious_step for rank in self.ranks if rank.suspicious]
        return min(steps) if steps else None

    @property
    def grade(self) -> str | None:
        """The strongest grade of the ranks suspicious at the first suspicious step (None: none, or msprobe's)."""
        grades = [rank.grade for rank in self.ranks if rank.suspicious and rank.grade
                  and rank.first_suspicious_step == self.first_suspicious_step]
        return min(grades, key=GRADES.index) if grades else None

    def fails(self, grade: str = BREAK) -> bool:
        """Whether a rank is suspicious with at least ``grade``'s evidence (``--fail-on-suspicious``)."""
        return any(rank.fails(grade) for rank in self.ranks)

    @property
    def partial(self) -> str | None:
        """Where part of either model was not compared, how much (:meth:`Coverage.partial`)."""
        return self.coverage.partial() if self.coverage else None

    def to_dict(self) -> dict:
        def trip_dict(trip: Trip | None) -> dict | None:
            return None if trip is None else {**asdict(trip), "fall": trip.fall}

        return {
            "suspicious": self.suspicious,
            "first_suspicious_step": self.first_suspicious_step,
            **({"grade": self.grade} if self.grade else {}),
            **({"partial": self.partial} if self.partial else {}),
            **self.settings.to_dict(),
            "ranks": [{"rank": r.rank, "first_suspicious_step": r.first_suspicious_step,
                       "summary_trip": trip_dict(r.summary_trip),
                       "parameter_trips": [trip_dict(t) for t in r.parameter_trips],
                       "sign_noise": [asdict(noise) for noise in r.sign_noise],
                       "first_steps": asdict(r.first_steps) if r.first_steps else None,
                       **({"recorded_precision": r.recorded_precision} if r.recorded_precision else {}),
                       **({"grade": r.grade, "evidence": r.evidence} if r.grade else {}),
                       **({"silencer": r.silencer()} if r.coarser_format else {}),
                       **({"sensitivity": asdict(r.sensitivity)} if r.sensitivity else {})}
                      for r in self.ranks],
        }

    def describe(self, max_parameters: int = 5) -> str:
        """A few lines for a person: per rank, the first suspicious step and the parameters with most evidence,
        then the parameters whose sign disagreement is noise and what the first steps' differences allow."""
        lines = [f"{self.partial}: {self.coverage.caveat()}"] if self.partial else []
        for rank in self.ranks:
            recorded = f"; first steps judged at {rank.recorded_precision} rounding, from what both runs recorded" \
                if rank.recorded_precision else ""
            if not rank.suspicious:
                lines.append(f"rank {rank.rank}: no suspicious step ({self.settings.describe()}{recorded})")
            else:
                line = f"rank {rank.rank}: first suspicious step {rank.first_suspicious_step}"
                if rank.grade:
                    line += f", a {rank.grade}: {rank.evidence}"
                if rank.summary_trip:
                    line += f" (summary {summary_numbers(rank.summary_trip)})"
                lines.append(line)
                shown = rank.parameter_trips[:max_parameters]
                lines += [f"    {trip.name}: {trip_numbers(trip)}" for trip in shown]
                if len(rank.parameter_trips) > len(shown):
                    lines.append(f"    ... and {len(rank.parameter_trips) - len(shown)} more parameters")
                if rank.coarser_format:
                    lines.append(f"    {rank.silencer()}")
            if rank.sign_noise:
                names = ", ".join(noise.name for noise in rank.sign_noise[:max_parameters])
                more = len(rank.sign_noise) - max_parameters
                lines.append(f"    sign is noise (signs differ, norms agree; not judged on signs): {names}"
                             + (f" and {more} more" if more > 0 else ""))
            if rank.first_steps:
                lines.append(f"    {rank.first_steps.note()}")
            if rank.sensitivity:
                lines.append(f"    {rank.sensitivity.note()}")
        return "\n".join(lines)


def culprit_text(trip: Trip) -> str:
    """A tripping parameter in a few words, for tags: ``fc.weight (fell 0.2188)`` (msprobe's rule) or
    ``fc.weight (norm, 12x its noise)``."""
    if trip.reason in ("first", "drop"):
        return f"{trip.name} (fell {trip.fall:.4f})"
    if trip.reason in NO_SCORE:
        return f"{trip.name} ({trip.reason})"
    return f"{trip.name} ({trip.reason}, {beyond_noise(trip.score)})"


def summary_numbers(trip: Trip) -> str:
    """The summary's trip for a person: msprobe's ``1.0000 -> 0.9565``, or the noise rule's reason and numbers
    (a break of the norms leaves the similarity as it was: the numbers say what moved)."""
    if trip.reason in ("first", "drop"):
        return f"{trip.previous:.4f} -> {trip.similarity:.4f}"
    return trip_numbers(trip)


def trip_numbers(trip: Trip) -> str:
    """A trip's numbers for a person: msprobe's ``0.9900 -> 0.7812 (fell 0.2088)``, or the noise rule's reason,
    numbers and how far beyond the noise."""
    if trip.reason in ("first", "drop"):
        return f"{trip.previous:.4f} -> {trip.similarity:.4f} (fell {trip.fall:.4f})"
    if trip.reason in NO_SCORE:
        return f"{trip.reason}: {trip.detail}"
    return f"{trip.reason}: {trip.detail} ({beyond_noise(trip.score)})"


def beyond_noise(score: float) -> str:
    """A noise rule score (robust deviations of the pair's learnt noise) as a reader takes it: ``12x its noise``;
    past a thousand the exact multiple says nothing more."""
    return f"{score:.0f}x its noise" if score < 1000 else "over 1000x its noise"
