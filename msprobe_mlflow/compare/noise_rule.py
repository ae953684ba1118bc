"""The noise-aware rule: a step is suspicious when the two runs differ there by more than their own numerical noise.

Two runs on different devices never agree bit for bit. Their rounding moves every value by a small relative amount,
gives the elements at rounding level random signs (half of them at most: more is anti-aligned, never noise), is of
the pair's size, learnt from the pair, and grows slowly as the trajectories part: each series is judged against its
recent past. What this rests on, and the figures the constants were settled on: docs/compare.md, "The verdict".

The series, per rank and parameter, over the compared steps:

- ``direction``: the fraction of elements whose sign disagrees (and the summary's, over all parameters); its noise
  is at least binomial, sqrt(p(1-p)/n) around the rate p seen so far.
- ``norm`` (L1, L2): the runs' gradient norms' difference, scaled by the larger of the two and the parameter's
  usual norm (a gradient that dips through cancellation keeps an ordinary scaled error); a magnitude bug leaves
  every sign as it was and shows here only.
- ``distribution`` (L2): the total variation distance of the bucket fractions, the two buckets that meet at 0 taken
  as one (which side of 0 is the direction's business).
- ``weight`` (``param_norm`` recorded by both): the step-to-step change of the parameters' own norms' scaled
  difference. The optimizer amplifies every earlier step's rounding in the weights, so only its jumps are judged,
  once learnt, never for a parameter whose gradient is noise, and only where the runs' moves differ by more than
  ten times the smaller one (a gradient spike moves both); at step 0, before any update, the difference itself.
  The whole model's weights parting in one step by :data:`NORM_JUMP` is an update that differed: a break.
- max and min, no series (one element's rounding averages over nothing): they recognise whole-gradient noise, and
  their significands tell the format a gradient came out of (``precision`` evidence, never a break).

A series *breaks* where it moves from the median of its last :data:`WINDOW` values by more than :data:`DEVIATIONS`
times its noise (directions: sqrt(binomial² + (1.4826 MAD)²); norms: the larger of the series' own and the model's
robust spread) and by more than twice the window's largest deviation; a norm also by more than
:data:`MAGNITUDE_FLOOR`. Below the floor the norms break together, where the median over parameters of how many
times |b - a| / max(a, b) exceeds the largest of its window passes :data:`NORM_JUMP` (the weights' alike, once
learnt). Until a series has :data:`MIN_HISTORY` values, and while a sign window holds none but zeros, only what
rounding cannot do breaks: a norm beyond :func:`first_steps_tolerance`, more than 3% of the summary's signs that are
not noise (msprobe's 0.97), a parameter's signs more than 3% and beyond their binomial noise. Runs that agreed bit
for bit so far, in every recorded byte (never judged from signs alone), have no rounding between them: any
difference breaks.

A break is *suspicious* where it persists at the next step, judged against the same past (a bug's does, a rounding
spike's does not); the verdict names the step of the break, and a break at the last step is none. A norm beyond
:data:`FIRST_STEPS_TOLERANCE` needs no confirmation (the next step grades it: :meth:`NoiseAwareJudge._verdict_of`).
A *faint* break (a norm beyond its noise, below the floor) is suspicious only where the next step's norm differences
jump across the model by sqrt(:data:`NORM_JUMP`).

*Noise* ("sign is noise": never a trip, never a culprit): ``whole gradient``, a parameter whose largest element is
below :data:`ROUNDING_LEVEL` times the model's largest on both sides and whose series break; ``signs``, in the
first steps, a parameter whose signs break while its norm agrees (its norm is still judged). A parameter whose
weight jumped is never noise.

The first steps are judged at the pair's precision where it is known, given (``precision``) or recorded by both
runs' monitors (:mod:`msprobe_mlflow.pytorch.compute_format`), so that a bug below bfloat16 rounding is named at
step 0; else the verdict notes where they differ beyond float32 rounding
(:class:`~msprobe_mlflow.compare.verdict.FirstSteps`). The culprits at the first suspicious step are ranked by
deviations beyond their own noise, where a change entered first (a weight that jumped; a gradient newly out of a
16-bit format: ``precision``, :data:`COARSE_BITS`), gradients at rounding level last. The rule cannot tell a
training that amplifies the runs' rounding by orders of magnitude in one step (a sharp region, a loss spike) from
a change entering there.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import numpy as np

from msprobe_mlflow.compare.exponent_shift import ExponentShift
from msprobe_mlflow.compare.verdict import (BREAK, DEPARTURE, DEPARTURE_MEANS, PRECISION, ZEROS, FirstSteps,
                                            RankVerdict, Sensitivity, SignNoise, Trip, judged_values, slots_of)
from msprobe_mlflow.formats import UNIT_ROUNDOFF, coarsest

DEVIATIONS = 10.0  # robust deviations beyond the noise that make a break
WINDOW = 20  # past values a series' noise is learnt from
MIN_HISTORY = 5  # values a series needs before its own spread is trusted
FIRST_STEPS_TOLERANCE = 0.1  # scaled; 26 x 2**-8, bfloat16's unit roundoff (the pair's precision not known)
STATISTIC_FLOOR = 1e-6  # scaled: the least noise a learnt norm series is credited with
MAGNITUDE_FLOOR = 1e-2  # scaled: a norm that moves less is no break (a float32 sum that cancels can, once)
SUMMARY_FIRST_TOLERANCE = 0.03  # msprobe's documented first-step bound, on the elements that are not sign noise
MAD_TO_SIGMA = 1.4826  # a normal distribution's standard deviation per median absolute deviation
ROUNDING_LEVEL = 2.0 ** -8  # bfloat16's unit roundoff, relative to the model's largest gradient element
NORM_JUMP = 100.0  # the growth in one step of the median norm difference that makes a break (benign: 4.1 at most;
# the weights' 2.3, over the divergence benchmark's 120 benign pairs of 300 steps, held-out families included)
JUMP_FLOOR = 2.0 ** -24  # float32's unit roundoff: norm differences below it are counted at it
WEIGHT = "weight"  # the series of the parameters' own norms (recorded with statistics=["param_norm"])
DIRECT = (WEIGHT, PRECISION)  # evidence of where a change entered, not of where it spread
COARSE_BITS = 11  # float16's significand; bfloat16 has 8: extremes that carry no more came from a 16-bit format
FINER_THAN_16_BIT = ("float64", "float32", "tf32")  # recorded formats whose results carry more (TF32 sums in float32)
COUNT_SERIES = ("direction", "distribution")  # fractions of elements
HIDDEN_FORMAT = "float16"  # the coarsest a device's own modes are offered as (TF32/HF32: 11 bits, float16: 11 bits)
SIGNS, WHOLE = "signs", "whole gradient"  # what of a parameter is noise
NORM_BEYOND = f"a norm moved by more than {FIRST_STEPS_TOLERANCE:.0%} of its scale and {DEVIATIONS:.0f}x its " \
    f"largest move of the last {WINDOW} steps"  # a break's evidence: see rounding_bound
NORM_BEYOND_FIRST = f"a norm moved in the first steps by more than {HIDDEN_FORMAT} rounding can move it (a device's " \
    f"own TF32 or HF32 included), where the runs' formats are known"  # see _first_steps_beyond
TRANSIENT_MEANS = "the whole model moved at this step only, gone at the next: what one batch's amplified rounding " \
    "does (a near tie), or a batch corrupted once"
ZEROS_MEAN = "a share of the gradient elements went to or from zero in one run, which rounding between devices " \
    "does not do: an underflow (a loss scale lost or too small, a narrower format) or a bug that zeroes gradients"


def scaled_difference(a: np.ndarray, b: np.ndarray, usual: np.ndarray) -> np.ndarray:
    """(b - a) / scale of non-negative magnitudes, the scale being the larger of a, b and the parameter's usual
    magnitude (NaN: none yet): rounding leaves an absolute error of the size of the terms summed, so a gradient
    that dips through cancellation has a large relative error but an ordinary scaled one. In [-1, 1]; 0 where both
    are equal (both NaN included), infinite where only one is not finite."""
    scale = np.fmax(np.maximum(a, b), usual)
    with np.errstate(divide="ignore", invalid="ignore"):
        difference = (b - a) / scale
    both_equal = (a == b) | (np.isnan(a) & np.isnan(b))
    return np.where(both_equal, 0.0, np.where(np.isfinite(difference), difference, np.inf))


class _History:
    """The last ``WINDOW`` values of one series per parameter (NaN: not compared at that step)."""

    def __init__(self, width: int = 0):
        self.values = np.full((WINDOW, width), np.nan)
        self.filled = 0

    def grow(self, width: int) -> None:
        if width > self.values.shape[1]:
            self.values = np.concatenate([self.values, np.full((WINDOW, width - self.values.shape[1]), np.nan)],
                                         axis=1)

    def counts(self, places: np.ndarray) -> np.ndarray:
        """Per place: how many values there are."""
        return np.sum(~np.isnan(self.values[:, places]), axis=0)

    def center_and_spread(self, places: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per place: the median, the robust spread (1.4826 MAD) and how many values there are."""
        window = self.values[:, places]
        count = self.counts(places)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a column with no values yet: expected
            center = np.nanmedian(window, axis=0)
            spread = MAD_TO_SIGMA * np.nanmedian(np.abs(window - center), axis=0)
        return np.nan_to_num(center), np.nan_to_num(spread), count

    def latest(self, places: np.ndarray) -> np.ndarray:
        """Per place: the value pushed last (NaN: none)."""
        return self.values[(self.filled - 1) % WINDOW, places] if self.filled else np.full(len(places), np.nan)

    def push(self, places: np.ndarray, values: np.ndarray) -> None:
        row = self.filled % WINDOW
        self.values[row, :] = np.nan
        self.values[row, places] = values
        self.filled += 1


def _binomial_spread(rate: np.ndarray, numels: np.ndarray) -> np.ndarray:
    """The spread of a disagreement fraction over ``numels`` elements at ``rate`` (at least one element's worth)."""
    numels = np.maximum(numels, 1)
    rate = np.clip(rate, 1.0 / numels, 0.5)
    return np.sqrt(rate * (1 - rate) / numels)


class NoiseAwareJudge:
    """The noise-aware rule (see the module docstring), one compared step at a time."""

    def __init__(self, rank: int, precision: str | None = None):
        self.rank = rank
        self.precision = precision  # given; else judged at what the runs recorded, if they did (recorded_precision)
        self.recorded_precision: str | None = None
        self._formats_seen: tuple[set, set] = (set(), set())  # formats A's and B's first steps recorded
        self.first_steps: FirstSteps | None = None
        self._largest_first: FirstSteps | None = None  # the first steps' largest difference, before the 16-bit check
        self._sixteen_bit: tuple[dict, dict] = ({}, {})  # names of the gradients coarse in the first steps, A and B
        self.verdict: RankVerdict | None = None
        self.sign_noise: dict[str, SignNoise] = {}
        self.summary_band: dict[int, float] = {}
        self.sensitivity: Sensitivity | None = None  # the last judged step's: what a change had to exceed (runs
        # that agreed bit for bit at every step have none: any difference breaks)
        self._slots: dict[str, int] = {}
        self._noise = np.zeros(0, dtype=object)  # by slot: "" (not noise), SIGNS or WHOLE
        self._histories = {name: _History() for name in ("direction", "norm", "distribution", WEIGHT)}
        self._summary = _History(width=1)
        self._usual_norm = _History()  # each parameter's norm, for the scale of its differences
        self._relative = {"norm": _History(), WEIGHT: _History()}  # |b - a| / max(a, b), for a model-wide jump
        self._weights = (_History(), _History())  # each parameter's own norm in A, in B
        self._coarse = (_History(), _History())  # 1 where a parameter's gradient extremes were coarse, in A, in B
        self._tiny = _History()  # 1 where a parameter's gradient was at rounding level on both sides, else 0
        self._held: _Finding | None = None  # a step that broke, until the next step says whether it persists
        self._held_zeros: ExponentShift | None = None  # the held step's zeros, where they moved (:meth:`judge_step`)
        self._equal_so_far = True  # every step remembered agreed bit for bit (signs and statistics)

    def report(self) -> RankVerdict:
        """The verdict, or (nothing suspicious) what was found: the same after the verdict, as judging stops. A
        break at the last step judged, with no step after it to say whether it persists, is no verdict, but for a
        norm beyond :data:`FIRST_STEPS_TOLERANCE` (:meth:`finish`)."""
        first_steps = None if self.recorded_precision else self.first_steps  # known after all: no note
        return self.verdict or RankVerdict(self.rank, sign_noise=list(self.sign_noise.values()),
                                           summary_band=dict(self.summary_band), first_steps=first_steps,
                                           recorded_precision=self.recorded_precision,
                                           sensitivity=None if self._equal_so_far else self.sensitivity)

    def finish(self) -> RankVerdict | None:
        """Judging ends: a held step that needs no confirmation (a norm beyond :data:`FIRST_STEPS_TOLERANCE`)
        becomes the verdict, graded on its own, and is returned (None: no new verdict)."""
        if self.verdict is None and self._held is not None and self._held.certain:
            self.verdict = self._verdict_of(self._held, None)
            return self.verdict
        if self.verdict is None and self._held_zeros is not None:
            self.verdict = self._zeros_verdict(self._held_zeros)
            return self.verdict
        return None

    def judge_step(self, comparison) -> RankVerdict | None:
        """Judges a step. A step that breaks is held until the next one: the first suspicious step is one whose
        break persists at the next step (judged against the same past), as a bug's does and a rounding spike's
        does not (one parameter's sum that cancels, once); the verdict names the held step. A step whose only
        breaks are faint (norms beyond their noise, below :data:`MAGNITUDE_FLOOR`) is held too, and persists only
        where the next step's norm differences jump across the model (a change there reached every gradient; a sum
        that cancelled stays in its parameter). A norm that moved beyond :data:`FIRST_STEPS_TOLERANCE` makes its
        step suspicious whatever follows; the next step grades it (:meth:`_verdict_of`). Where both runs recorded
        exponent counts, a step at which the model's share of zero gradient elements moved by more than
        :data:`~msprobe_mlflow.compare.exponent_shift.ZERO_SHARE_MOVED` is suspicious too (:meth:`_zeros_verdict`),
        unless the step is held and its break persists: the break names it then."""
        if self.verdict is not None:
            return None
        found = self._evaluate(comparison)
        shift = comparison.exponent_shift
        zeros = shift if shift is not None and shift.moved else None
        (held, self._held), (held_zeros, self._held_zeros) = (self._held, None), (self._held_zeros, None)
        if held is not None and (held.certain or (found.spread if held.faint else found.suspicious)):
            self.verdict = self._verdict_of(held, found)
            return self.verdict
        if held_zeros is not None or (zeros is not None and not (found.suspicious or found.faint or found.certain)):
            self.verdict = self._zeros_verdict(held_zeros or zeros)
            return self.verdict
        if held is not None:
            held.remember(self)
        if found.suspicious or found.faint or found.certain:
            self._held, self._held_zeros = found, zeros
        else:
            found.remember(self)
        return None

    def _zeros_verdict(self, shift: ExponentShift) -> RankVerdict:
        """A departure at ``shift``'s step: a share of the model's gradient elements went to (or came from) zero in
        B, which rounding between two devices does not do (at most 0.3% in the divergence benchmark's benign
        pairs) and an underflow does (a loss scale lost or too small, a narrower format), as a bug that zeroes
        gradients does; the parameters that changed most are named."""
        trips = [Trip(name, shift.step, None, None, ZEROS, 0.0, f"{zero:+.2%} of its elements at zero in B")
                 for name, zero, _ in shift.parameters]
        summary = Trip("summary", shift.step, None, None, ZEROS, 0.0, shift.describe())
        return RankVerdict(self.rank, shift.step, summary, trips, list(self.sign_noise.values()),
                           dict(self.summary_band), self.first_steps, self.recorded_precision, DEPARTURE,
                           ZEROS_MEAN)

    def _verdict_of(self, first: "_Finding", after: "_Finding | None") -> RankVerdict:
        """The verdict naming ``first``, graded with the step ``after`` it (None: none judged): a *break* where
        either shows what rounding cannot do, but for a norm beyond its bound at ``first`` that moved the whole
        model (its summary broke) and is gone at the next step, what one batch's amplified rounding does (a near
        tie, as in a benign GPT-2 under bfloat16 at step 265) as much as a batch corrupted once: a departure."""
        noise = [*self.sign_noise.values(), *first.noise.values()]
        trips = first.trips
        if first.faint:  # under the floor: the person reading it needs what confirmed it
            spread = f"; under the {MAGNITUDE_FLOOR:.0%} floor, it spread: step {after.step}'s " \
                f"{after.summary_trip.detail}"
            trips = [replace(trip, detail=trip.detail + spread) if trip.reason == "norm" else trip for trip in trips]
        transient = after is not None and not after.suspicious and first.summary_trip is not None
        evidence = tuple(found for found in first.beyond_rounding
                         if not (transient and found in (NORM_BEYOND, NORM_BEYOND_FIRST))) \
            or (after.beyond_rounding if after is not None and not transient else ())
        return RankVerdict(self.rank, first.step, first.summary_trip, trips, noise, dict(self.summary_band),
                           self.first_steps, self.recorded_precision, BREAK if evidence else DEPARTURE,
                           "; ".join(evidence) or (TRANSIENT_MEANS if transient else DEPARTURE_MEANS),
                           first.coarser_format)

    @property
    def _agreed_bit_for_bit(self) -> bool:
        """Every step remembered so far (one at least) agreed bit for bit: the runs have no rounding between them."""
        return self._equal_so_far and self._summary.filled > 0

    def _evaluate(self, comparison) -> "_Finding":
        """A step's breaks against the past, with what it adds to the past once it is known not to be a break."""
        step, names, numels = comparison.step, comparison.compared, comparison.numels
        places = self._make_room(names)
        _, similarities = judged_values(comparison)
        series = {"direction": 1.0 - similarities}  # NaN for an empty parameter
        side_a, side_b = comparison.statistics_a, comparison.statistics_b
        both = side_a is not None and side_b is not None
        tiny = _at_rounding_level(comparison) if both else np.zeros(len(names), dtype=bool)
        was_tiny = self._at_rounding_level_so_far(places)
        coarse = [_coarse(side) for side in (side_a, side_b)] if both else []
        precision = self._first_steps_precision(comparison, names, places, tiny, coarse)
        pushes = []  # (history, places, values): what this step adds to the past once remembered
        magnitudes, moved_alike = self._magnitude_series(step, places, side_a, side_b, series, pushes)
        tolerance = first_steps_tolerance(precision, numels)  # per parameter: what rounding cannot do early
        early = self._histories["norm"].counts(places) < MIN_HISTORY
        breaks, scores, centers, below_floor, bounds, needed = self._series_breaks(step, places, series, numels,
                                                                                   tolerance, moved_alike)
        recognised = self._recognise_noise(comparison, places, series, breaks, tiny & was_tiny)
        if both:
            pushes.append((self._tiny, places, tiny.astype(np.float64)))
        noise = self._noise[places].copy()
        for i, found in recognised.items():
            noise[i] = found.kind
        if both and precision is None:
            self._note_first_steps(step, names, places, series["norm"], numels, tiny)
        if "norm" in needed:
            self._note_sensitivity(step, names, needed["norm"], (noise == "") & ~np.isnan(series["norm"]))
        faint, differing = self._leave_out_noise(breaks, below_floor, series, noise, tiny)
        summary_trip, summary = self._summary_trip(comparison, series["direction"], noise != "")
        summary_trip, weights_parted = self._model_wide_jump(step, places, magnitudes, summary, summary_trip,
                                                             pushes)
        pushes += [(self._histories[name], places, values) for name, values in series.items()]
        pushes.append((self._summary, np.array([0]), np.array([summary])))
        only_faint = summary_trip is None and not any(np.any(found) for found in breaks.values())
        judged = {name: faint if only_faint and name == "norm" else found for name, found in breaks.items()}
        best = self._strongest_trips(step, names, places, similarities, series, judged, scores, centers, magnitudes,
                                     tolerance)
        pushes += [(history, places, now) for history, now in zip(self._coarse, coarse)]
        if summary_trip is not None or best:  # where the change entered: evidence for the culprits, never a break
            for i, trip in self._precision_trips(step, names, places, coarse, noise, (side_a, side_b),
                                                 comparison.compute_formats).items():
                best[names[i]] = trip
        certain = _norm_beyond(step, series, breaks, centers, dict.fromkeys(bounds, FIRST_STEPS_TOLERANCE))
        beyond_rounding = _beyond_rounding(_norm_beyond(step, series, breaks, centers, bounds), best.values(),
                                           self._agreed_bit_for_bit,
                                           _first_steps_beyond(precision, series, breaks, numels, early),
                                           weights_parted)
        coarser = _coarser_format_within(precision, names, series.get("norm"), numels, best.values(), summary_trip,
                                         early)
        differs = not both or _statistics_differ(side_a, side_b) or any(np.any(found) for found in differing.values())
        return _Finding(step, summary_trip, _ranked(best.values(), names, tiny), pushes, certain, differs,
                        {int(places[i]): found for i, found in recognised.items()}, only_faint and bool(best),
                        beyond_rounding, coarser)

    def _make_room(self, names) -> np.ndarray:
        """The slots of this step's parameters, every series widened for a parameter seen for the first time."""
        places = slots_of(self._slots, names)
        for history in [*self._histories.values(), *self._relative.values(), self._usual_norm, *self._weights,
                        *self._coarse, self._tiny]:
            history.grow(len(self._slots))
        if len(self._slots) > len(self._noise):
            self._noise = np.concatenate([self._noise, np.full(len(self._slots) - len(self._noise), "", dtype=object)])
        return places

    def _note_sensitivity(self, step: int, names, needed, judged) -> None:
        """What this step could not have seen (issue 47's decision 1): the least norm move that breaks, over the
        parameters judged on their norms (not noise)."""
        if np.any(judged):
            finest = int(np.flatnonzero(judged)[np.argmin(needed[judged])])
            self.sensitivity = Sensitivity(step, float(np.median(needed[judged])), float(needed[finest]),
                                           names[finest])

    def _at_rounding_level_so_far(self, places) -> np.ndarray:
        """Per parameter: its gradient was at rounding level at every step judged so far (or none was), so that a
        gradient a bug shrank later is never taken for noise."""
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a parameter with no past yet
            return np.nan_to_num(np.nanmin(self._tiny.values[:, places], axis=0), nan=1.0) == 1

    def _magnitude_series(self, step: int, places, side_a, side_b, series: dict, pushes: list):
        """Adds to ``series`` the norms' (and, recorded, the distributions' and weights') scaled differences, where
        both runs recorded statistics. Returns the series -> (A's, B's) magnitudes compared, and where the runs'
        weights moved alike this step."""
        magnitudes = {}
        moved_alike = np.zeros(len(places), dtype=bool)
        if side_a is None or side_b is None:
            return magnitudes, moved_alike
        magnitudes["norm"] = (side_a.norm, side_b.norm)
        usual = self._usual_norm.center_and_spread(places)[0]
        series["norm"] = scaled_difference(side_a.norm, side_b.norm, np.where(usual > 0, usual, np.nan))
        pushes.append((self._usual_norm, places, np.fmax(side_a.norm, side_b.norm)))
        buckets_a, buckets_b = side_a.buckets, side_b.buckets
        if buckets_a is not None and buckets_b is not None and buckets_a.shape == buckets_b.shape:
            series["distribution"] = 0.5 * np.abs(buckets_b - buckets_a).sum(axis=1)
        if side_a.parameter_norm is not None and side_b.parameter_norm is not None:
            magnitudes[WEIGHT] = (side_a.parameter_norm, side_b.parameter_norm)
            moved_alike = self._weight_series(step, places, magnitudes[WEIGHT], series, pushes)
        return magnitudes, moved_alike

    def _weight_series(self, step: int, places, norms, series: dict, pushes: list) -> np.ndarray:
        """Adds the step-to-step change of the weights' scaled difference to ``series``; returns where the runs
        moved a weight alike (a gradient spike moves both runs; a corrupted weight one run only)."""
        before = tuple(history.latest(places) for history in self._weights)  # NaN at the first step
        if step == 0 and not self._weights[0].filled:  # before the first update both runs hold the same
            before = (norms[0], norms[0])  # weights, but for their storage's rounding
        unknown = np.full(len(places), np.nan)
        series[WEIGHT] = scaled_difference(*norms, unknown) - scaled_difference(*before, unknown)
        series[WEIGHT][np.isnan(before[0])] = np.nan
        pushes.extend((history, places, values) for history, values in zip(self._weights, norms))
        moves = [now - was for now, was in zip(norms, before)]
        return np.abs(moves[1] - moves[0]) <= DEVIATIONS * np.minimum(*np.abs(moves))  # a jump: over ten times

    def _series_breaks(self, step: int, places, series: dict, numels, tolerance, moved_alike):
        """Per series: where it breaks, by how many deviations, its usual value, and (magnitudes) where it is beyond
        its noise but below :data:`MAGNITUDE_FLOOR`, what rounding cannot move it by (:func:`rounding_bound`) and
        the least move that breaks. The weights meet the first steps' tolerance at step 0 only (in between, no
        rounding bound holds for them), and never break where both runs moved them alike."""
        breaks, scores, centers, below_floor, bounds, needed = {}, {}, {}, {}, {}, {}
        for name, values in series.items():
            if name in COUNT_SERIES:
                breaks[name], scores[name], centers[name] = self._count_breaks(name, places, values, numels)
            else:
                breaks[name], scores[name], centers[name], below_floor[name], bounds[name], needed[name] = \
                    self._magnitude_breaks(name, places, values, numels,
                                           tolerance if name == "norm" or step == 0 else np.inf)
        if WEIGHT in series:
            breaks[WEIGHT] &= ~moved_alike
        return breaks, scores, centers, below_floor, bounds, needed

    def _leave_out_noise(self, breaks: dict, below_floor: dict, series: dict, noise, tiny):
        """Takes what is noise out of ``breaks`` (in place), and puts every difference in where the runs agreed bit
        for bit so far. Returns the faint norm breaks, and per series where the runs differ."""
        for name in breaks:  # sign noise: not judged on signs (buckets split at 0 are signs too) nor on its weights,
            # which its noise moves (a whole step each under Adam); whole: not at all
            breaks[name] &= (noise == "") if name in (*COUNT_SERIES, WEIGHT) else (noise != WHOLE)
        # A gradient's norm beyond its noise but below the floor: a change that spreads next step, or a sum that
        # cancelled once (held, see judge_step)
        faint = below_floor.get("norm", np.zeros(len(noise), dtype=bool)) & (noise == "") & ~tiny
        differing = {name: (values != 0) & ~np.isnan(values) for name, values in series.items()}
        if self._agreed_bit_for_bit:  # no rounding between the runs: any difference breaks
            for name in breaks:
                breaks[name] |= differing[name]
        return faint, differing

    def _model_wide_jump(self, step: int, places, magnitudes: dict, summary: float, summary_trip, pushes: list):
        """The summary's trip, else a jump of the whole model's norm differences (the gradients', then the
        weights'), and the weights' jump apart (None: none); each parameter's relative difference goes into the
        past either way."""
        jumps = {}
        for name, (norms_a, norms_b) in magnitudes.items():
            relative = np.abs(scaled_difference(norms_a, norms_b, np.full(len(places), np.nan)))
            pushes.append((self._relative[name], places, relative))
            jumps[name] = self._norm_jump(name, step, places, relative, summary)
        parted = jumps.get(WEIGHT)  # a confirming step's jump is one of sqrt(NORM_JUMP): evidence needs NORM_JUMP
        return (summary_trip or jumps.get("norm") or parted,
                parted if parted is not None and parted.score > DEVIATIONS else None)

    def _strongest_trips(self, step: int, names, places, similarities, series: dict, judged: dict, scores: dict,
                         centers: dict, magnitudes: dict, tolerance) -> dict[str, Trip]:
        """One trip per parameter that breaks (``judged``, per series): its strongest evidence, a weight's first.
        A magnitude judged against what rounding can do in the first steps carries that bound."""
        best: dict[str, Trip] = {}
        for name, values in series.items():
            early = np.full(len(places), step == 0) if name == WEIGHT else \
                self._histories[name].counts(places) < MIN_HISTORY  # judged against what rounding can do
            for i in np.flatnonzero(judged[name]):
                norms = (magnitudes[name][0][i], magnitudes[name][1][i]) if name in magnitudes else None
                bound = tolerance[i] if name in magnitudes and early[i] else None
                trip = _trip(name, names[i], step, similarities[i], values[i], centers[name][i], scores[name][i],
                             norms, bound)
                if names[i] not in best or _evidence(trip) > _evidence(best[names[i]]):
                    best[names[i]] = trip
        return best

    def _first_steps_precision(self, comparison, names, places, tiny, coarse) -> str | None:
        """The format the first steps are judged at: the given precision; else, from what the runs recorded
        (``recorded_precision``), the coarsest format both monitors recorded at the first steps so far (a step
        recorded without one, as autolog's step 0 whose forward ran before it attached, is judged at what the others
        say once one does), bfloat16 where
        both runs' first steps hold gradients out of a 16-bit format (a cast in both models' code, which torch does
        not report). Keeps, per run, the names of those gradients (those at rounding level aside: their few bits
        are not a format's), for the first-steps note."""
        first = self._histories["norm"].counts(places) < MIN_HISTORY
        for found, now in zip(self._sixteen_bit, coarse):
            found.update(dict.fromkeys(names[i] for i in np.flatnonzero(first & ~tiny & (now == 1))))
        if self.precision is not None:
            return self.precision
        if first.any():  # the steps it judges; a later step recorded without a format does not unsay it
            for seen, found in zip(self._formats_seen, comparison.compute_formats):
                if found is not None:  # not recorded at a step (autolog attaches after step 0's forward)
                    seen.add(found)
        recorded = coarsest([*self._formats_seen[0], *self._formats_seen[1]]) if all(self._formats_seen) else None
        self.recorded_precision = coarsest([recorded, "bfloat16"]) if recorded and all(self._sixteen_bit) else recorded
        return self.recorded_precision

    def _note_first_steps(self, step: int, names, places, norms, numels, tiny) -> None:
        """Keeps the largest norm difference of the first steps (gradients at rounding level aside) where it is
        beyond float32 rounding's and within bfloat16's, with the run whose first steps' gradients came out of a
        16-bit format, if one did; none where both runs' did (bfloat16's rounding is then the pair's): see
        :class:`~msprobe_mlflow.compare.verdict.FirstSteps`."""
        first = self._histories["norm"].counts(places) < MIN_HISTORY
        bound = first_steps_tolerance("float32", numels)
        differences = np.abs(norms)
        beyond = first & ~tiny & (differences > bound)
        if np.any(beyond):
            i = int(np.flatnonzero(beyond)[np.argmax(differences[beyond])])
            finest = next((precision for precision in ("tf32", "bfloat16")
                           if differences[i] <= first_steps_tolerance(precision, numels[i:i + 1])[0]), None)
            if finest is not None and (self._largest_first is None
                                       or differences[i] > self._largest_first.difference):
                self._largest_first = FirstSteps(float(differences[i]), names[i], step, float(bound[i]), finest)
        sixteen_bit = [(label, found) for label, found in zip("AB", self._sixteen_bit) if found]
        if self._largest_first is None or len(sixteen_bit) == 2:
            self.first_steps = None
        elif sixteen_bit:
            (label, found), = sixteen_bit
            self.first_steps = replace(self._largest_first, sixteen_bit=label, sixteen_bit_parameters=len(found),
                                       sixteen_bit_example=next(iter(found)))
        else:
            self.first_steps = self._largest_first

    def _precision_trips(self, step: int, names, places, coarse, noise, sides, formats) -> dict[int, Trip]:
        """The parameters (by index in this step) whose gradient extremes are coarse (at most :data:`COARSE_BITS`
        significant bits: a 16-bit format) in one run while the other's are not, after :data:`MIN_HISTORY` steps in
        which that run's never were: that gradient went through a 16-bit format from this step on (a layer cast to
        bfloat16, an accelerator computing a float32 operator in float16). Two random float32 values are both that
        coarse once in 2**26; a run under autocast is coarse from its first step, so nothing drops. At a
        parameter's first compared step, with no past, a run whose monitor recorded a format finer than 16 bits
        (``formats``, A's and B's) computed that gradient in a 16-bit format it did not report: a cast in its code."""
        if not coarse:  # no statistics on one side
            return {}
        trips = {}
        for side, other, label in ((1, 0, "B"), (0, 1, "A")):
            window = self._coarse[side].values[:, places]
            fine_before = (np.sum(window == 0, axis=0) >= MIN_HISTORY) & ~np.any(window == 1, axis=0)
            first = np.all(np.isnan(window), axis=0) & (formats[side] in FINER_THAN_16_BIT)
            for i in np.flatnonzero((coarse[side] == 1) & (coarse[other] == 0) & (fine_before | first)
                                    & (noise == "")):
                top, bottom = sides[side].max[i], sides[side].min[i]
                bits = int(np.nanmax(significant_bits(np.array([top, bottom]))))
                since = f"at its first step (a 16-bit format, where {label} recorded {formats[side]}); more than " \
                    f"{COARSE_BITS} in the other run" if first[i] else \
                    f"from this step (a 16-bit format); more than {COARSE_BITS} before and in the other run"
                trips[int(i)] = Trip(names[i], step, None, None, PRECISION, 0.0,
                                     f"gradient max {top:.6g}, min {bottom:.6g} in {label}: {bits} significant "
                                     f"bits {since}")
        return trips

    def _recognise_noise(self, comparison, places, series, breaks, tiny) -> dict[int, SignNoise]:
        """The parameters (by index in this step) newly recognised as noise: whose gradient is at rounding level on
        both sides (``tiny``: at every step judged so far too, so that a gradient a bug shrank, zeroed in one run
        say, stays a culprit) and differs (whole), and, in the first steps, whose signs break while their norm agrees
        (signs), unless its weight jumped. Runs that agreed bit for bit so far have no rounding between them: nothing
        of theirs is noise."""
        if comparison.statistics_a is None or comparison.statistics_b is None or self._agreed_bit_for_bit:
            return {}  # without statistics nothing tells noise from a bug: every break counts
        learnt = self._histories["direction"].center_and_spread(places)[2] >= MIN_HISTORY
        numels = comparison.numels
        anti_aligned = series["direction"] > 0.5 + DEVIATIONS * _binomial_spread(np.full(len(numels), 0.5), numels)
        counted = breaks["direction"] | breaks.get("distribution", False)
        moved = breaks.get(WEIGHT, False)  # a weight that jumped: its gradient's signs differ for a reason
        whole = tiny & (counted | breaks["norm"]) & ~moved
        signs = counted & ~breaks["norm"] & ~anti_aligned & ~learnt & ~moved
        recognised = {}
        for kind, found in ((WHOLE, whole), (SIGNS, signs & ~whole)):
            for i in np.flatnonzero(found & (self._noise[places] == "")):
                recognised[int(i)] = SignNoise(comparison.compared[i], comparison.step,
                                               float(1 - series["direction"][i]), _relative_difference(comparison, i),
                                               kind)
        return recognised

    def _count_breaks(self, name: str, places, values, numels):
        """A fraction of elements (disagreeing signs, moved between buckets) breaks: see :func:`count_break`."""
        history = self._histories[name]
        center, spread, count = history.center_and_spread(places)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            seen = np.nan_to_num(np.nanmax(history.values[:, places], axis=0)) if len(places) else center
        breaks, score = count_break(values, numels, center, spread, count, seen)
        return breaks & ~np.isnan(values), score, np.where(count > 0, center, 0.0)

    def _magnitude_breaks(self, name: str, places, values, numels, tolerance: float):
        """A scaled difference of norms breaks: see :func:`magnitude_break`. The weights' once learnt, and at step 0
        (before any update, the runs' weights differ by their storage's rounding only); in between they carry every
        earlier step's rounding, amplified by the optimizer (Adam moves a weight whose gradient is rounding by a
        whole step), so no bound on rounding holds for them."""
        history = self._histories[name]
        center, spread, count = history.center_and_spread(places)
        center = np.where(count >= MIN_HISTORY, center, 0.0)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            seen = np.nan_to_num(np.nanmax(np.abs(history.values[:, places] - center), axis=0))
        breaks, score, below_floor, needed = magnitude_break(values, center, spread, count, seen,
                                                             _model_spread(history), tolerance)
        return (breaks & ~np.isnan(values), score, center, below_floor & ~np.isnan(values), rounding_bound(seen),
                needed)

    def _norm_jump(self, series: str, step: int, places, values, summary: float) -> Trip | None:
        """The whole model's norm differences jumped (``series``: the gradients' ``norm`` or the parameters' own,
        ``weight``): the median over parameters of how many times a parameter's relative difference
        |b - a| / max(a, b) exceeds the largest of its window (each at least float32's unit roundoff) is beyond
        :data:`NORM_JUMP`. Rounding differences grow smoothly as two trajectories part; a bug below
        :data:`MAGNITUDE_FLOOR` that touches every parameter (a weight decay, a layer's precision) jumps at once.
        The weights' differences are judged once :data:`MIN_HISTORY` are known (their first updates part them from
        equal). The step after a break confirms it with a growth of sqrt(NORM_JUMP), ten, still beyond what
        rounding did. The trip carries the summary's sign similarity and its usual value, for the lines that show
        them."""
        window = self._relative[series].values[:, places]
        known = np.sum(~np.isnan(window), axis=0)
        seen = ~np.isnan(values) & (known >= (MIN_HISTORY if series == WEIGHT else 1))
        if not np.any(seen):
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            before = np.fmax(np.nanmax(window[:, seen], axis=0), JUMP_FLOOR)
        now = np.fmax(values[seen], JUMP_FLOOR)
        growth = float(np.quantile(now / before, 0.5, method="lower"))  # at least half the parameters grew so
        if growth <= (NORM_JUMP ** 0.5 if self._held is not None else NORM_JUMP):  # persisting: one order of ten
            return None
        usual = float(self._summary.center_and_spread(np.array([0]))[0][0])
        what = "parameter norm" if series == WEIGHT else "norm"
        return Trip("summary", step, 1 - summary, 1 - usual, series, DEVIATIONS * growth / NORM_JUMP,
                    f"median {what} difference {float(np.median(before)):.2g} -> {float(np.median(now)):.2g} of its "
                    f"scale: {growth:.0f}x the largest of the last {WINDOW} steps in one step")

    def _summary_trip(self, comparison, disagreement, is_noise) -> tuple[Trip | None, float]:
        """The whole rank's signs (and norm) break: what no single parameter shows may show summed."""
        step = comparison.step
        numels = comparison.numels
        judged = ~np.isnan(disagreement)
        total = numels[judged].sum()
        if total == 0:
            return None, np.nan
        summary = float((disagreement[judged] * numels[judged]).sum() / total)
        history = self._summary
        center, spread, count = (float(v[0]) for v in history.center_and_spread(np.array([0])))
        trip = None
        if count == 0:
            reliable = judged & ~is_noise
            reliable_total = numels[reliable].sum()
            reliable_rate = float((disagreement[reliable] * numels[reliable]).sum() / reliable_total) \
                if reliable_total else 0.0
            self.summary_band[step] = 1 - SUMMARY_FIRST_TOLERANCE
            if reliable_rate > SUMMARY_FIRST_TOLERANCE:
                trip = Trip("summary", step, 1 - summary, 1.0, "direction",
                            DEVIATIONS * reliable_rate / SUMMARY_FIRST_TOLERANCE,
                            f"signs differ on {reliable_rate:.2%} of the elements that are not sign noise")
        else:
            seen = float(np.nanmax(history.values[:, 0]))
            breaks, score = count_break(np.array([summary]), np.array([total]), np.array([center]),
                                            np.array([spread]), np.array([count]), np.array([seen]))
            noise = (summary - center) / score[0] if score[0] else 0.0
            self.summary_band[step] = 1 - (center + DEVIATIONS * noise) if noise else 1 - center
            if breaks[0]:
                trip = Trip("summary", step, 1 - summary, 1 - center, "direction", float(score[0]),
                            f"sign similarity {1 - center:.4f} -> {1 - summary:.4f}")
        return trip, summary


@dataclass
class _Finding:
    """One step judged against the past: its breaks, and the values it adds to the past (``remember``)."""

    step: int
    summary_trip: Trip | None
    trips: list[Trip]
    pushes: list
    certain: bool  # beyond what rounding can do: suspicious without waiting for the next step
    differs: bool  # the runs differ in a recorded bit at this step, or their statistics were not both recorded
    noise: dict  # slot -> SignNoise: parameters recognised as noise at this step
    faint: bool = False  # its only breaks are norms beyond their noise but below MAGNITUDE_FLOOR
    beyond_rounding: tuple[str, ...] = ()  # what of it no rounding can do (a *break*); none: beyond the noise only
    coarser_format: str | None = None  # the finest coarser format whose rounding reaches every break (first steps)

    @property
    def suspicious(self) -> bool:
        return (self.summary_trip is not None or bool(self.trips)) and not self.faint

    @property
    def spread(self) -> bool:
        """The model's norm differences jumped here: a change a step before reached every gradient."""
        return self.summary_trip is not None and self.summary_trip.reason in ("norm", WEIGHT)

    def remember(self, judge: NoiseAwareJudge) -> None:
        """Adds this step to the judge's past, once it is known not to be the first suspicious step."""
        for history, places, values in self.pushes:
            history.push(places, values)
        judge._equal_so_far &= not self.differs
        for slot, found in self.noise.items():
            judge._noise[slot] = found.kind
            judge.sign_noise[found.name] = found


def count_break(rate, numels, center, spread, count, seen):
    """Where a fraction of elements (signs that disagree, or moved between buckets) breaks, and by how many
    deviations of its noise: the binomial spread of the rate seen so far, and once learnt the series' own robust
    spread. Until the series is learnt (:data:`MIN_HISTORY` values) or while its window holds none but zeros, a
    break is also above msprobe's 3%, what rounding does not reach in the first steps: a window without one
    disagreeing element, or a few steps' worth, says nothing of the rate rounding reaches once the trajectories
    drift apart. Once learnt, a break is also beyond twice the largest deviation the window showed."""
    center = np.where(count > 0, center, 0.0)
    learnt = count >= MIN_HISTORY
    noise = np.sqrt(_binomial_spread(center, numels) ** 2 + np.where(learnt, spread, 0.0) ** 2)
    excess = rate - center
    with np.errstate(invalid="ignore"):
        score = np.nan_to_num(excess / noise)
        breaks = score > DEVIATIONS
        breaks &= np.where(learnt & (seen > 0), excess > 2 * (seen - center), rate > SUMMARY_FIRST_TOLERANCE)
    return breaks, score


def first_steps_tolerance(precision: str | None, numels) -> np.ndarray:
    """Per parameter of ``numels`` elements, what rounding cannot move a scaled norm difference by in the first
    steps: :data:`FIRST_STEPS_TOLERANCE` (26 units of bfloat16) where the pair's precision is not known, else as
    many units of the coarsest format either run computed in, and at least what summing the norm's n squares can
    be off by: n/2 units of the format they are summed in (recursive summation's bound; float32, the gradients'
    norm column, unless both runs are float64), never more than where it is not known."""
    formats = FIRST_STEPS_TOLERANCE * UNIT_ROUNDOFF[precision or "bfloat16"] / UNIT_ROUNDOFF["bfloat16"]
    summed = UNIT_ROUNDOFF["float64" if precision == "float64" else "float32"]
    return np.minimum(FIRST_STEPS_TOLERANCE, np.maximum(formats, 0.5 * np.asarray(numels, np.float64) * summed))


def magnitude_break(values, center, spread, count, seen, model_spread: float, tolerance=FIRST_STEPS_TOLERANCE):
    """Where a scaled difference of norms breaks, and by how many deviations: once learnt, beyond
    :data:`DEVIATIONS` times the larger of the series' own robust spread and the model's (rounding is of one size
    across a model; never below :data:`STATISTIC_FLOOR`), beyond twice the largest deviation of the window and
    beyond :data:`MAGNITUDE_FLOOR`; before, beyond ``tolerance`` (:func:`first_steps_tolerance`), which rounding
    cannot reach. Third: where it is beyond the noise but not the floor (a *faint* break, judged by its spread).
    Fourth: the least move from ``center`` that breaks, per parameter."""
    learnt = count >= MIN_HISTORY
    noise = np.maximum(np.where(learnt, spread, 0.0), max(model_spread, STATISTIC_FLOOR))
    with np.errstate(invalid="ignore"):
        excess = np.abs(values - center)
        score = np.nan_to_num(np.where(learnt, excess / noise, DEVIATIONS * excess / tolerance), posinf=1e9)
        beyond_noise = learnt & (score > DEVIATIONS) & (excess > 2 * seen)
        breaks = np.where(learnt, beyond_noise & (excess > MAGNITUDE_FLOOR), excess > tolerance)
    needed = np.where(learnt, np.maximum(np.maximum(DEVIATIONS * noise, 2 * seen), MAGNITUDE_FLOOR), tolerance)
    return breaks, score, beyond_noise & ~breaks, needed


def _model_spread(history: _History) -> float:
    """The robust spread of every parameter's values over the window: rounding noise is of one size for the model,
    so a parameter whose own series has been quiet is not judged on a spread of nothing."""
    window = history.values[~np.isnan(history.values)]
    if window.size < MIN_HISTORY:
        return 0.0
    return MAD_TO_SIGMA * float(np.median(np.abs(window - np.median(window))))


def _coarser_format_within(precision: str | None, names, norms, numels, trips, summary_trip, early) -> str | None:
    """Where a step's only breaks are gradient norms in the first steps, judged at ``precision`` (given or
    recorded), the finest coarser format whose first-steps tolerance holds every one of them: a device that
    computes float32 matmuls in TF32 or HF32 without torch knowing (Ascend can) looks so, and that format is what
    ``--precision`` would have to say. Coarser only, never finer: a finer format makes a benign pair alarm; and no
    coarser than :data:`HIDDEN_FORMAT`: bfloat16's 10% tolerance holds real bugs too, and is what an unknown pair
    gets."""
    trips = list(trips)
    if precision is None or norms is None or summary_trip is not None or not trips \
            or any(t.reason != "norm" for t in trips):
        return None
    index = {name: i for i, name in enumerate(names)}
    tripped = np.array([index[t.name] for t in trips])
    return next((candidate for candidate in sorted(UNIT_ROUNDOFF, key=UNIT_ROUNDOFF.__getitem__)
                 if UNIT_ROUNDOFF[precision] < UNIT_ROUNDOFF[candidate] <= UNIT_ROUNDOFF[HIDDEN_FORMAT]
                 and np.all(np.abs(norms[tripped]) <= first_steps_tolerance(candidate, numels[tripped]))
                 and np.all(early[tripped])), None)


def _beyond_rounding(norm: bool, trips, agreed_bit_for_bit: bool, first_norm: bool = False,
                     weights_parted: Trip | None = None) -> tuple[str, ...]:
    """What of a step's breaks no rounding can do, in words (empty: none): a norm beyond its :func:`rounding_bound`
    (``norm``) or, in the first steps, beyond :func:`_first_steps_beyond`'s (``first_norm``), a parameter whose
    signs disagree on more than half its elements (random rounding flips half at most), a weight that jumped in one
    run only, the whole model's weights parting in one step (``weights_parted``: rounding carried forward parts
    them smoothly, see :data:`NORM_JUMP`), a gradient whose format changed in one run, or any difference between
    runs that agreed bit for bit."""
    trips = list(trips)
    found = []
    if norm:
        found.append(NORM_BEYOND)
    elif first_norm:
        found.append(NORM_BEYOND_FIRST)
    anti = [t.name for t in trips if t.reason == "direction" and t.similarity is not None and t.similarity < 0.5]
    if anti:
        found.append(f"{anti[0]}'s signs are anti-aligned (over half disagree)")
    jumped = [t.name for t in trips if t.reason == WEIGHT]
    if jumped:
        found.append(f"{jumped[0]}'s weights jumped in one run only")
    if weights_parted is not None:
        found.append(f"the whole model's weights parted in one step, at step {weights_parted.step} "
                     f"({weights_parted.detail}), which rounding carried forward does not do: an update that differed "
                     "(learning rate, weight decay, optimizer) or weights overwritten")
    formats = [t.name for t in trips if t.reason == PRECISION]
    if formats:
        found.append(f"{formats[0]}'s gradient changed format in one run")
    if agreed_bit_for_bit:
        found.append("the runs agreed bit for bit until this step")
    return tuple(found)


def rounding_bound(seen) -> np.ndarray:
    """What rounding cannot move a scaled norm difference by, per parameter whose window's largest deviation was
    ``seen``: :data:`FIRST_STEPS_TOLERANCE` (26 units of bfloat16) while the runs agree to rounding, and once the
    pair has parted (amplified rounding moves a norm by any amount) :data:`DEVIATIONS` times the parameter's own
    largest, as ratios of norms: a scaled difference d is a ratio 1 / (1 - d), and ten times a ratio's logarithm
    is 1 - (1 - d)**10, below 1, so that a norm many times the other still breaks."""
    return np.maximum(FIRST_STEPS_TOLERANCE, 1 - (1 - np.minimum(seen, 1.0)) ** DEVIATIONS)


def _first_steps_beyond(precision: str | None, series: dict, breaks: dict, numels, early) -> bool:
    """A gradient norm broke in the first steps (before its series is learnt) by more than rounding can move it
    there, where the pair's formats are known (``precision``): before rounding is amplified, a norm moves by its
    format's rounding at most (:func:`first_steps_tolerance`), and a device's own modes by :data:`HIDDEN_FORMAT`'s
    (TF32, HF32: torch does not know of them, and the recorded float32 cannot say), so the bound is the coarser of
    the two. Where the formats are not known, bfloat16's :data:`FIRST_STEPS_TOLERANCE` is :func:`rounding_bound`'s.
    ``early``: per parameter, its norm series is not learnt yet (its centre is 0 then)."""
    if precision is None or "norm" not in series:
        return False
    bound = first_steps_tolerance(coarsest([precision, HIDDEN_FORMAT]), numels)
    with np.errstate(invalid="ignore"):
        return bool(np.any(breaks["norm"] & early & (np.abs(series["norm"]) > bound)))


def _norm_beyond(step: int, series: dict, breaks: dict, centers: dict, bounds: dict) -> bool:
    """A norm (at step 0 a weight too) broke by more than its bound (per series: a number, or per parameter)."""
    return any(bool(np.any(breaks[name] & (np.abs(series[name] - centers[name]) > bounds[name])))
               for name in bounds if name == "norm" or step == 0)


def _ranked(trips, names, tiny) -> list[Trip]:
    """The culprits in order: where a change entered first (a weight that moved while the gradients before agreed;
    a gradient newly out of a 16-bit format, whose rounding reaches every gradient below it at the same size), then
    by deviations; gradients at rounding level last, even where nothing is noise (any change moves them wholly)."""
    last = {names[i] for i in np.flatnonzero(tiny)}
    return sorted(trips, key=lambda t: (t.reason not in DIRECT, t.name in last, -t.score, t.name))


def _evidence(trip: Trip) -> tuple[bool, float]:
    """How strongly a trip speaks for its parameter: where a change entered (a weight's break, a gradient's format)
    before where it spread, then by deviations."""
    return trip.reason in DIRECT, trip.score


def _relative_difference(comparison, index: int) -> float:
    a, b = comparison.statistics_a.norm[index], comparison.statistics_b.norm[index]
    largest = max(a, b)
    return float(abs(b - a) / largest) if largest > 0 else 0.0


def _trip(series: str, name: str, step: int, similarity: float, value: float, center: float, score: float,
          norms: tuple[float, float] | None, bound: float | None = None) -> Trip:
    """One parameter's break on one series, with the numbers a person checks (``norms``: A's and B's; ``bound``:
    what rounding can do to a norm in the first steps, when the break was judged against it)."""
    similarity = None if np.isnan(similarity) else float(similarity)
    if series == "direction":
        return Trip(name, step, similarity, float(1 - center), series, float(score),
                    f"sign similarity {1 - center:.4f} -> {similarity:.4f}")
    if series == "distribution":
        detail = f"bucket fractions moved {value:.4f} (total variation; usually {center:.4f})"
    elif series == WEIGHT:
        moved = f"{_percent(value)} of its scale before the first update (the weights' rounding moves it by " \
            f"{bound * 100:.2g}% at most)" if bound is not None else \
            f"their difference moved {_percent(value)} of its scale in one step (usually {_percent(center)})"
        detail = f"parameter norm A {norms[0]:.4g}, B {norms[1]:.4g}: {moved}"
    else:
        usual = f"rounding moves it by {bound * 100:.2g}% at most in the first steps" if bound is not None else \
            f"usually {_percent(center)}"
        detail = f"norm A {norms[0]:.4g}, B {norms[1]:.4g}: {_apart(*norms, value)} ({usual})"
    return Trip(name, step, similarity, None, series, float(score), detail)


def _percent(value: float) -> str:
    """A scaled difference in percent with two significant digits: ``+0.00031%``, never a bare ``+0.00%``."""
    return f"{value:+.2%}" if abs(value) >= 1e-3 or value == 0 else f"{value * 100:+.2g}%"


def _apart(a: float, b: float, scaled: float) -> str:
    """How far two norms are apart, as a reader checks it: a ratio where one is more than 10% off the other (a
    doubled norm is ``B = 2.00x A``, not ``+50.08% of its scale``), else the scaled difference in percent."""
    if a > 0 and b > 0 and not 1 / 1.1 <= b / a <= 1.1:
        ratio = b / a
        return f"B = {ratio:.2f}x A" if ratio < 100 else f"B = {ratio:.3g}x A"
    return f"{_percent(scaled)} of its scale"


def significant_bits(values: np.ndarray) -> np.ndarray:
    """Per value, the bits its binary significand needs (float64: 1 to 53; a float32 value at most 24, a bfloat16
    one at most 8); NaN for zero, subnormal and non-finite values."""
    values = np.asarray(values, dtype=np.float64)
    raw = values.view(np.uint64)
    fraction = raw & np.uint64((1 << 52) - 1)
    lowest = fraction & (~fraction + np.uint64(1))  # the lowest set bit
    with np.errstate(divide="ignore"):
        trailing = np.where(fraction == 0, 52, np.log2(lowest.astype(np.float64)))
    normal = np.isfinite(values) & (np.abs(values) >= np.finfo(np.float64).tiny)
    return np.where(normal, 53 - trailing, np.nan)


def _coarse(side) -> np.ndarray:
    """Per parameter: 1 where its gradient's max and min (those not zero) carry at most :data:`COARSE_BITS`
    significant bits, 0 where they carry more, NaN where both are zero or not finite."""
    bits = np.fmax(significant_bits(side.max), significant_bits(side.min))
    return np.where(np.isnan(bits), np.nan, (bits <= COARSE_BITS).astype(np.float64))


def _statistics_differ(side_a, side_b) -> bool:
    """Whether any statistic both runs recorded differs in a bit (max and min too, which no series judges): two runs
    whose signs agree while their statistics differ in the last bits (float32 on one thread against two) have
    rounding between them."""
    for a, b in ((side_a.norm, side_b.norm), (side_a.max, side_b.max), (side_a.min, side_b.min),
                 (side_a.buckets, side_b.buckets), (side_a.parameter_norm, side_b.parameter_norm)):
        if (a is None) != (b is None) or (a is not None and not np.array_equal(a, b, equal_nan=True)):
            return True
    return False


def _at_rounding_level(comparison) -> np.ndarray:
    """Parameters whose largest gradient element is, on both sides, below bfloat16's unit roundoff times the
    model's largest: what two precisions compute there can be rounding alone (a gradient that is zero in exact
    arithmetic, such as a bias right before a normalisation)."""
    def largest(side) -> np.ndarray:
        return np.nan_to_num(np.maximum(np.abs(side.max), np.abs(side.min)))

    a, b = largest(comparison.statistics_a), largest(comparison.statistics_b)
    return (a < ROUNDING_LEVEL * a.max(initial=0.0)) & (b < ROUNDING_LEVEL * b.max(initial=0.0))
