"""Compare the gradient directions of two local dumps, streaming, and write msprobe's comparison output.

Either dump may be msprobe 1.0.3's (boolean ``.npy`` per parameter) or ours (packed ``directions.npz``); both are
read through ``msprobe_mlflow.directions``. Semantics (FORMATS.md section 5): the ranks and steps present in both
dumps, the parameters present in both at each step (those in one only are reported by name), similarity =
agreeing elements / numel, the summary weighted by element count. Parameters are read one at a time, on a few
threads, so memory stays bounded by the largest parameters, not by the dump. Every file is written in a staging
folder first and moved into the output only once everything succeeded.

A step with a file that cannot be read as written (``directions.DamagedFile``) is never compared: it stops the
comparison, naming the file and the step, or with ``skip_damaged`` is left out and listed (``skipped_steps``, and
the verdict is partial). A step whose summary CSV is absent is compared on its signs and listed
(``statistics_missing``).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from msprobe_mlflow.progress import ProgressLine
from msprobe_mlflow.compare.exponent_shift import ZERO_SHARE_MOVED, ExponentShift
from msprobe_mlflow.compare.similarity import judged_similarity, similarity, summary_similarity
from msprobe_mlflow.compare.pairing import HOW, PAIRED_BY, example_name_map, name_map_from
from msprobe_mlflow.compare.rules import judge_for
from msprobe_mlflow.compare.step import StepMismatch, compare_step
from msprobe_mlflow.compare.verdict import DEFAULT_RULE, Coverage, RankVerdict, RuleSettings, Verdict, rule_settings
from msprobe_mlflow.directions import DamagedFile
from msprobe_mlflow.dump import (dump_folder, indexed_children, rank_dir, short_list, step_dir, summary_steps,
                                 write_csv)
from msprobe_mlflow.vocabulary import VERDICT_FILE_NAME

SIMILARITIES_FILE_NAME = "similarities.csv"
PICTURE_FOLDER_NAME = "similarities_picture"


class CompareInputError(ValueError):
    """The dumps cannot be compared as given (missing, L0, nothing in common, shapes differ...)."""


# agreeing elements and numel of one parameter at one step; None where it was not compared.
Counts = tuple[int, int] | None


@dataclass(frozen=True)
class SkippedStep:
    """A step left out by ``skip_damaged``: the file that cannot be read as written, and what is wrong with it."""

    step: int
    file: str
    problem: str


@dataclass
class RankComparison:
    """One rank's result. ``counts[name][j]`` belongs to ``steps[j]``; ``parameters`` are in A's model order."""

    rank: int
    steps: list[int]
    parameters: list[str]
    counts: dict[str, list[Counts]]
    summary_counts: list[tuple[int, int]]
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    # (name in A, name in B, how) of parameters paired under other names (``compare/pairing.py``): wrapper prefixes
    # of dumps written before names were unwrapped, another framework's names, the model's order, the name map.
    renamed_matches: list[tuple[str, str, str]] = field(default_factory=list)
    steps_only_in_a: list[int] = field(default_factory=list)  # directions in one dump only (say, the always-on tier)
    steps_only_in_b: list[int] = field(default_factory=list)
    bounds_differ: tuple | None = None  # A's and B's L2 bucket headers, where they differ: distributions not compared
    skipped_steps: list[SkippedStep] = field(default_factory=list)  # damaged, left out (``skip_damaged``)
    # step -> the summary CSVs it has no statistics from: compared on its signs only
    statistics_missing: dict[int, tuple[str, ...]] = field(default_factory=dict)
    # where both dumps hold exponent counts: how far B's gradients moved among the exponents, step by step
    exponent_shifts: list[ExponentShift] = field(default_factory=list)

    @property
    def first_exponent_move(self) -> ExponentShift | None:
        """The first step at which the model's share of zero gradient elements moved (``exponent_shift``)."""
        return next((shift for shift in self.exponent_shifts if shift.moved), None)

    def similarities(self, name: str) -> list[float | None]:
        """msprobe's values: agreeing / numel, 0.0 for an empty parameter, ``None`` where not compared."""
        return [None if c is None else similarity(*c) for c in self.counts[name]]

    @property
    def summary(self) -> list[float]:
        return [summary_similarity([agreeing], [numel]) for agreeing, numel in self.summary_counts]

    def judged_series(self, name: str | None = None) -> list[float | None]:
        """The series the verdict sees: empty parameters (and steps with no elements) are left out as ``None``."""
        counts = self.summary_counts if name is None else self.counts[name]
        return [judged_similarity(c) for c in counts]

    def csv_rows(self) -> list[list]:
        """``similarities.csv``: header ``step,S...``, a row per parameter, ``summary`` last (empty cell: not
        compared at that step)."""
        def cell(counts: Counts):
            if counts is None:
                return ""
            return counts[0] / counts[1] if counts[1] else 0  # msprobe writes an int 0 for an empty parameter

        rows = [["step", *[str(s) for s in self.steps]]]
        rows += [[name, *[cell(c) for c in self.counts[name]]] for name in self.parameters]
        rows.append(["summary", *[cell(c) for c in self.summary_counts]])
        return rows

    def matrix(self) -> np.ndarray:
        """Parameter x step similarities for the heat map, NaN where not compared or empty."""
        return np.array([[np.nan if v is None else v for v in self.judged_series(n)] for n in self.parameters],
                        dtype=np.float64).reshape(len(self.parameters), len(self.steps))


@dataclass
class DumpComparison:
    dump_a: Path
    dump_b: Path
    ranks: list[RankComparison]
    verdict: Verdict
    output_dir: Path | None = None
    runs: tuple[str | None, str | None] = (None, None)  # the MLflow run IDs the dumps were read from, if any

    def to_dict(self) -> dict:
        """What ``verdict.json`` holds: the sources (the runs' IDs where they were runs), each rank's series and the
        verdict."""
        return {
            **{f"run_{side}": run for side, run in zip("ab", self.runs) if run},
            "dump_a": str(self.dump_a),
            "dump_b": str(self.dump_b),
            "verdict": self.verdict.to_dict(),
            "ranks": [{"rank": r.rank, "steps": r.steps, "summary": r.summary, "parameters": len(r.parameters),
                       "only_in_a": r.only_in_a, "only_in_b": r.only_in_b,
                       "renamed_matches": [list(pair) for pair in r.renamed_matches],
                       "steps_only_in_a": r.steps_only_in_a, "steps_only_in_b": r.steps_only_in_b,
                       "skipped_steps": [asdict(skipped) for skipped in r.skipped_steps],
                       "statistics_missing": [{"step": step, "files": list(files)}
                                              for step, files in r.statistics_missing.items()],
                       **({"bounds_differ": {"a": list(r.bounds_differ[0]), "b": list(r.bounds_differ[1])}}
                          if r.bounds_differ else {}),
                       **({"exponent_shifts": {
                           "steps": [s.step for s in r.exponent_shifts],
                           "zero_share": [s.zero_share for s in r.exponent_shifts],
                           "binades": [s.binades for s in r.exponent_shifts],
                           "first_move": r.first_exponent_move.to_dict() if r.first_exponent_move else None}}
                          if r.exponent_shifts else {})} for r in self.ranks],
        }

    def to_dataframe(self):
        """The similarities as a ``pandas.DataFrame``, for a notebook: a row per rank, step and compared parameter
        (model order), columns ``rank``, ``step``, ``parameter``, ``similarity`` (msprobe's: 0.0 for an empty
        parameter), ``agreeing`` and ``numel`` (elements). A step's summary is ``agreeing.sum() / numel.sum()``."""
        import pandas  # only here: comparing needs no pandas

        rows = [(rank.rank, step, name, similarity(*counts), *counts)
                for rank in self.ranks for index, step in enumerate(rank.steps) for name in rank.parameters
                if (counts := rank.counts[name][index]) is not None]
        return pandas.DataFrame(rows, columns=["rank", "step", "parameter", "similarity", "agreeing", "numel"])

    def trips_dataframe(self):
        """The verdict's trips as a ``pandas.DataFrame``: a row per rank and tripping series at its first suspicious
        step (the summary first, then the parameters, most evidence first), columns ``rank``, ``step``,
        ``parameter`` (``summary`` for the summary), ``reason``, ``score``, ``similarity``, ``expected``, ``grade``
        and ``detail``."""
        import pandas

        rows = [(rank.rank, trip.step, "summary" if trip is rank.summary_trip else trip.name, trip.reason, trip.score,
                 trip.similarity, trip.previous, rank.grade, trip.detail)
                for rank in self.verdict.ranks
                for trip in ([rank.summary_trip] if rank.summary_trip else []) + rank.parameter_trips]
        return pandas.DataFrame(rows, columns=["rank", "step", "parameter", "reason", "score", "similarity",
                                               "expected", "grade", "detail"])

    def table(self, steps_per_line: int = 10, head_and_tail: int | None = None) -> str:
        """Per rank, the summary similarity at each step, a few steps per line; with ``head_and_tail``, only that
        many lines of steps at each end (10,000 steps would print 2,000 lines), saying which steps are left out."""
        lines = []
        for rank in self.ranks:
            lines.append(f"rank {rank.rank} ({len(rank.parameters)} parameters compared)")
            starts = list(range(0, len(rank.steps), steps_per_line))
            if head_and_tail is not None and len(starts) > 2 * head_and_tail:
                hidden = starts[head_and_tail:-head_and_tail]
                last = min(hidden[-1] + steps_per_line, len(rank.steps)) - 1
                starts = [*starts[:head_and_tail], None, *starts[-head_and_tail:]]
            for start in starts:
                if start is None:
                    lines.append(f"  ... steps {rank.steps[hidden[0]]} to {rank.steps[last]} not shown "
                                 f"({last - hidden[0] + 1} steps; --all prints them, similarities.csv holds them)")
                    continue
                chunk = slice(start, start + steps_per_line)
                lines.append("  step    " + "".join(f"{s:>9}" for s in rank.steps[chunk]))
                lines.append("  summary " + "".join(f"{v:>9.4f}" for v in rank.summary[chunk]))
            for how in HOW:
                renamed = [(a, b) for a, b, found in rank.renamed_matches if found == how]
                if renamed:
                    lines.append(f"  {len(renamed)} parameters paired {PAIRED_BY[how]} (e.g. A {renamed[0][0]!r} = "
                                 f"B {renamed[0][1]!r})")
            for side, names in (("A", rank.only_in_a), ("B", rank.only_in_b)):
                if names:
                    lines.append(f"  only in {side} (not compared): {short_list(names, 5)}")
            if rank.bounds_differ:
                a, b = (", ".join(columns) for columns in rank.bounds_differ)
                lines.append(f"  L2 distributions not compared: the runs counted them over other bounds (A {a}; "
                             f"B {b}); give both the same grad_probe.bounds to compare them")
            for side, steps in (("A", rank.steps_only_in_a), ("B", rank.steps_only_in_b)):
                if steps:
                    lines.append(f"  steps with directions in {side} only (not compared): {short_list(steps, 5)}")
            lines += [f"  step {skipped.step} damaged, skipped (not compared): {skipped.file}: {skipped.problem}"
                      for skipped in rank.skipped_steps]
            if rank.exponent_shifts:
                move = rank.first_exponent_move
                lines.append(f"  exponents: from step {move.step}, {move.describe()}"
                             if move else f"  exponents: B's share of gradient elements at zero stayed within "
                             f"{ZERO_SHARE_MOVED:.0%} of A's at every step")
            missing = list(rank.statistics_missing.items())
            lines += [f"  step {step} compared on signs only, no statistics (norms not judged): {', '.join(files)}"
                      for step, files in missing[:5]]
            if len(missing) > 5:
                lines.append(f"  ... and {len(missing) - 5} more steps without statistics (verdict.json lists them)")
        return "\n".join(lines)


def direction_steps(dump: Path, rank: int, label: str) -> list[int]:
    """The ``step{S}`` folders of a rank; refuses a dump with summary CSVs but no directions with a clear message."""
    steps = indexed_children(rank_dir(dump, rank), "step")
    if not steps and summary_steps(rank_dir(dump, rank)):
        raise CompareInputError(
            f"{label} {rank_dir(dump, rank)}: grad_summary_*.csv but no step<N> folders: this is a grad_level L0 "
            f"dump, which records no gradient directions (or an always-on tier dump none of whose steps recorded "
            f"them: grad_probe.directions_every_n_steps = 0 and no anomaly); compare needs grad_level L1 or L2 in "
            f"both runs")
    return steps


def _compare_rank(dump_a: Path, dump_b: Path, rank: int, settings: RuleSettings, pool: ThreadPoolExecutor,
                  progress: bool | None, name_map: dict[str, str] | None,
                  skip_damaged: bool = False) -> tuple[RankComparison, RankVerdict]:
    """Compares a rank's common steps one by one (``compare_step``, as the live verdict does) and judges each as
    it is compared. A damaged step stops it (``CompareInputError`` naming the file and the step), or with
    ``skip_damaged`` is left out, judged by nobody, and listed."""
    steps_a = direction_steps(dump_a, rank, "dump A")
    steps_b = direction_steps(dump_b, rank, "dump B")
    steps = sorted(set(steps_a) & set(steps_b))
    if not steps:
        raise CompareInputError(f"rank{rank}: no step folder in both dumps (A has steps {steps_a}, B has {steps_b}); "
                                f"only steps with directions in both are compared")
    judge = judge_for(settings, rank)
    tally = _RankTally(steps)
    line = ProgressLine(f"rank{rank} steps", len(steps), progress)
    for index, step in enumerate(steps):
        compared = _compared_step(dump_a, dump_b, rank, step, pool, name_map, skip_damaged)
        if isinstance(compared, SkippedStep):
            tally.skipped.append(compared)
        else:
            tally.add(index, step, compared, rank)
            judge.judge_step(compared)
        line.advance()
    line.close()
    judge.finish()
    return tally.comparison(rank, steps_a, steps_b), judge.report()


def _compared_step(dump_a: Path, dump_b: Path, rank: int, step: int, pool: ThreadPoolExecutor,
                   name_map: dict[str, str] | None, skip_damaged: bool):
    """One step compared, or (``skip_damaged``) the damaged file that leaves it out; a damaged step otherwise
    stops the comparison, as a step whose parameters do not match."""
    try:
        return compare_step(step, step_dir(dump_a, rank, step), step_dir(dump_b, rank, step), pool=pool,
                            name_map=name_map)
    except StepMismatch as e:
        raise CompareInputError(f"rank{rank} {e}") from None
    except DamagedFile as e:
        if not skip_damaged:
            raise CompareInputError(f"rank{rank} step{step}: {e}; the step cannot be compared (--skip-damaged, "
                                    f"skip_damaged=True in Python, compares the other steps and lists it)") from None
        return SkippedStep(step, str(e.path), e.problem)


@dataclass
class _RankTally:
    """What a rank's compared steps add up to, step by step, until it becomes its :class:`RankComparison`."""

    steps: list[int]  # the steps in both dumps, damaged ones included
    order: list[str] = field(default_factory=list)  # the parameters in the order first compared
    counts: dict[str, list[Counts]] = field(default_factory=dict)
    only_a: dict[str, None] = field(default_factory=dict)  # dicts as ordered sets
    only_b: dict[str, None] = field(default_factory=dict)
    renamed: dict[tuple[str, str, str], None] = field(default_factory=dict)
    summary_counts: list = field(default_factory=list)
    bounds_differ: tuple | None = None
    skipped: list[SkippedStep] = field(default_factory=list)
    statistics_missing: dict[int, tuple[str, ...]] = field(default_factory=dict)
    exponent_shifts: list[ExponentShift] = field(default_factory=list)

    def add(self, index: int, step: int, compared, rank: int) -> None:
        """Adds the ``index``-th step's counts; refuses a step where no parameter of A pairs with one of B."""
        if compared.statistics_missing:
            self.statistics_missing[step] = compared.statistics_missing
        if not compared.compared:
            raise CompareInputError(
                f"rank{rank} step{step}: no parameter of A could be paired with one of B (A has "
                f"{sorted(compared.only_in_a)[:5]}, B has {sorted(compared.only_in_b)[:5]}); pair them with a name "
                f"map: a JSON file of name in A -> name in B, given as --name-map FILE (name_map= in Python), e.g. "
                f"{{{example_name_map(compared.only_in_a, compared.only_in_b)}}}")
        self.only_a.update(dict.fromkeys(compared.only_in_a))
        self.only_b.update(dict.fromkeys(compared.only_in_b))
        self.renamed.update(dict.fromkeys(compared.renamed_matches))
        for name, agree, numel in zip(compared.compared, compared.agreeing.tolist(), compared.numels.tolist()):
            if name not in self.counts:
                self.order.append(name)
                self.counts[name] = [None] * len(self.steps)
            self.counts[name][index] = (agree, numel)
        self.summary_counts.append(compared.summary_counts)
        self.bounds_differ = self.bounds_differ or compared.bounds_differ
        if compared.exponent_shift is not None:
            self.exponent_shifts.append(compared.exponent_shift)

    def comparison(self, rank: int, steps_a: list[int], steps_b: list[int]) -> RankComparison:
        """The rank's result, the skipped steps left out of its steps and counts (all skipped: refused)."""
        steps, counts, skipped = self.steps, self.counts, self.skipped
        only_steps_a, only_steps_b = sorted(set(steps_a) - set(steps)), sorted(set(steps_b) - set(steps))
        if skipped:
            if len(skipped) == len(steps):
                raise CompareInputError(f"rank{rank}: every step in both dumps is damaged (first: step"
                                        f"{skipped[0].step} {skipped[0].file}: {skipped[0].problem}); nothing left "
                                        f"to compare")
            kept = [index for index, step in enumerate(steps) if step not in {s.step for s in skipped}]
            steps = [steps[index] for index in kept]
            counts = {name: [series[index] for index in kept] for name, series in counts.items()}
        compared_a, compared_b = set(counts), {b for _, b, _ in self.renamed} | set(counts)
        return RankComparison(rank, steps, self.order, counts, self.summary_counts,
                              [n for n in self.only_a if n not in compared_a],
                              [n for n in self.only_b if n not in compared_b], list(self.renamed), only_steps_a,
                              only_steps_b, self.bounds_differ, skipped, self.statistics_missing,
                              self.exponent_shifts)


def coverage_of(ranks: list[RankComparison]) -> Coverage:
    """The parameters paired and left unpaired over all ranks (a name counts once)."""
    return Coverage(len({name for rank in ranks for name in rank.parameters}),
                    len({name for rank in ranks for name in rank.only_in_a}),
                    len({name for rank in ranks for name in rank.only_in_b}),
                    sum(len(rank.skipped_steps) for rank in ranks))


def _check_name_map_used(name_map: dict[str, str] | None, ranks: list[RankComparison]) -> None:
    """Refuses a name map entry that paired nothing on any rank: a misspelt name would otherwise leave its
    parameters out silently."""
    if not name_map:
        return
    used = {(a, b) for rank in ranks for a, b, how in rank.renamed_matches if how == "map"}
    used |= {(a, a) for rank in ranks for a in rank.parameters}
    unused = [(a, b) for a, b in name_map.items() if (a, b) not in used]
    if unused:
        a, b = unused[0]
        known_a = {n for rank in ranks for n in [*rank.parameters, *rank.only_in_a]}
        missing = f"A has no parameter {a!r}" if a not in known_a else f"B has no parameter {b!r} (or it was " \
            f"paired with another of A first)"
        raise CompareInputError(f"name map entry {a!r}: {b!r} paired nothing: {missing}; names are as the dumps' "
                                f"grad_summary CSVs list them ({len(unused)} unused of {len(name_map)} entries)")


def _check_output_folder(output_dir: Path, ranks: list[int]) -> None:
    """Refuses an output that holds other things where the comparison's files go (e.g. a dump's rank folder)."""
    if output_dir.exists() and not output_dir.is_dir():
        raise CompareInputError(f"output_dir = {str(output_dir)!r} is a file; expected a folder (new or holding "
                                f"an earlier comparison)")
    for rank in ranks:
        folder = output_dir / f"rank{rank}"
        if not folder.exists():
            continue
        foreign = [p.name for p in folder.iterdir() if p.name not in (SIMILARITIES_FILE_NAME, PICTURE_FOLDER_NAME)]
        pictures = folder / PICTURE_FOLDER_NAME
        if pictures.is_dir():
            foreign += [f"{PICTURE_FOLDER_NAME}/{p.name}" for p in pictures.iterdir() if p.suffix != ".png"]
        if foreign or folder.is_symlink():
            raise CompareInputError(
                f"output_dir = {str(output_dir)!r}: {folder} holds files a comparison does not write "
                f"({', '.join(sorted(foreign)[:5]) or 'a symbolic link'}); choose a new or an earlier comparison's "
                f"output folder")


def _write_rank(folder: Path, rank: RankComparison, verdict: RankVerdict, plots: bool, per_param_plots: bool,
                progress: bool | None) -> None:
    write_csv(folder / SIMILARITIES_FILE_NAME, rank.csv_rows())
    if not plots:
        return
    from msprobe_mlflow.compare import plots as pictures  # matplotlib only when drawing

    picture_folder = folder / PICTURE_FOLDER_NAME
    curves = pictures.CurvePlotter()
    curves.summary(picture_folder, rank.steps, rank.summary, verdict.summary_band, verdict.first_suspicious_step)
    pictures.heatmap(picture_folder, rank.parameters, rank.steps, rank.matrix(), verdict.first_suspicious_step,
                     {trip.name for trip in verdict.parameter_trips}, {n.name for n in verdict.sign_noise})
    if per_param_plots:
        line = ProgressLine(f"rank{rank.rank} parameter plots", len(rank.parameters), progress)
        for name in rank.parameters:
            curves.parameter(picture_folder, name, rank.steps, rank.similarities(name))
            line.advance()
        line.close()


def _publish(staging: Path, output_dir: Path) -> None:
    """Moves each staged rank folder (and verdict.json) into ``output_dir``, replacing an earlier comparison's."""
    if not output_dir.exists():
        os.replace(staging, output_dir)
        return
    replaced = Path(tempfile.mkdtemp(prefix=".compare-replaced-", dir=output_dir.parent))
    try:
        for item in sorted(staging.iterdir()):
            target = output_dir / item.name
            if target.exists():
                os.replace(target, replaced / item.name)
            os.replace(item, target)
    finally:
        shutil.rmtree(replaced, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)


def write_comparison(comparison: DumpComparison, output_dir: str | os.PathLike, plots: bool = True,
                     per_param_plots: bool = False, progress: bool | None = None) -> Path:
    """Writes ``rank{R}/similarities.csv``, the plots and ``verdict.json``: staged, then moved into place."""
    output_dir = Path(output_dir)
    _check_output_folder(output_dir, [r.rank for r in comparison.ranks])
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".compare-partial-", dir=output_dir.parent))
    try:
        for rank, verdict in zip(comparison.ranks, comparison.verdict.ranks):
            _write_rank(staging / f"rank{rank.rank}", rank, verdict, plots, per_param_plots, progress)
        (staging / VERDICT_FILE_NAME).write_text(json.dumps(comparison.to_dict(), indent=1), encoding="utf-8")
        _publish(staging, output_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    comparison.output_dir = output_dir
    return output_dir


def compare_dumps(dump_a: str | os.PathLike, dump_b: str | os.PathLike, output_dir: str | os.PathLike | None,
                  *, rule: str | RuleSettings = DEFAULT_RULE, first_threshold: float | None = None,
                  drop_threshold: float | None = None, precision: str | None = None, plots: bool = True,
                  per_param_plots: bool = False, workers: int | None = None, progress: bool | None = None,
                  name_map: dict[str, str] | str | os.PathLike | None = None,
                  skip_damaged: bool = False, runs: tuple[str | None, str | None] = (None, None)) -> DumpComparison:
    """Compares two local dumps rank by rank, step by step, parameter by parameter, and judges the steps with
    ``rule`` (``"noise"``, the default, or ``"msprobe"``, whose thresholds are ``first_threshold`` and
    ``drop_threshold``; see ``compare/verdict.py``), or the rule with its settings as one
    :class:`~msprobe_mlflow.compare.verdict.RuleSettings`. ``precision``: the coarsest floating-point format either
    run computed in (``float64``, ``float32``, ``tf32``, ``float16``, ``bfloat16``; autocast and TF32 count): the
    noise rule judges the first steps, before it has learnt the pair's noise, against that format's rounding, so a bug
    present from step 0 that is smaller than bfloat16 rounding is named there too. Not given, it is what both runs'
    PyTorch monitors recorded with each step (``recorded_precision`` in the verdict), else bfloat16's. A format
    finer than the runs really used makes their rounding look like a bug.

    Parameters are paired by name, across wrappers and across frameworks (MindSpore's ``ln.gamma`` is torch's
    ``ln.weight``; ``compare/pairing.py``), and by ``name_map`` (name in A -> name in B, or a JSON file of them)
    for the rest. A verdict on part of either model says so (``verdict.partial``).

    Writes ``{output_dir}/rank{R}/similarities.csv`` (msprobe's format), ``similarities_picture/`` (the summary
    curve and the heat map; one curve per parameter with ``per_param_plots``) and ``verdict.json``; nothing when
    ``output_dir`` is None (``runs``: the MLflow run IDs the dumps come from, named in ``verdict.json``). Raises
    ``CompareInputError`` (or ``ValueError`` for a damaged file), naming the file
    and the reason, before anything is written. A step with a file that cannot be read as written (a direction
    archive failing its CRC-32, a truncated ``.npy``, a malformed summary CSV) is never compared: it raises, naming
    the file and the step, or with ``skip_damaged`` is left out and listed (``RankComparison.skipped_steps``,
    ``verdict.json``, the table; the verdict is partial). A step whose ``grad_summary_{S}.csv`` is absent is
    compared on its signs and listed (``statistics_missing``). ``progress``: None shows it when stderr is a
    terminal.
    """
    settings = rule_settings(rule, first_threshold, drop_threshold, precision)
    name_map = name_map_from(name_map)
    folder_a, folder_b = dump_folder(dump_a, "dump_a"), dump_folder(dump_b, "dump_b")
    ranks_a, ranks_b = indexed_children(folder_a, "rank"), indexed_children(folder_b, "rank")
    ranks = sorted(set(ranks_a) & set(ranks_b))
    if not ranks:
        raise CompareInputError(f"no rank in both dumps: {folder_a} has ranks {ranks_a}, {folder_b} has {ranks_b}")
    if output_dir is not None:
        _check_output_folder(Path(output_dir), ranks)
    workers = workers or min(4, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="msprobe-compare") as pool:
        results = [_compare_rank(folder_a, folder_b, rank, settings, pool, progress, name_map, skip_damaged)
                   for rank in ranks]
    compared = [c for c, _ in results]
    _check_name_map_used(name_map, compared)
    comparison = DumpComparison(folder_a, folder_b, compared,
                                Verdict(settings, [verdict for _, verdict in results], coverage_of(compared)),
                                runs=runs)
    if output_dir is not None:
        write_comparison(comparison, output_dir, plots, per_param_plots, progress)
    return comparison
