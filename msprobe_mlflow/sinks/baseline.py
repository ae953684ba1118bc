"""The live verdict: each probed step's gradient directions compared with a baseline run's, while training runs.

``baseline`` is a dump folder or an MLflow run ID (a run whose artifacts are on this file system is read in place;
otherwise each step is downloaded into the comparator's cache by a thread of its own, ``PREFETCH_STEPS`` ahead of
the step being compared). Each step is compared as it lands, read back from the local dump (which holds it before
any sink sees it), by the comparator's own step comparison and judge (``compare/step.py``, ``compare/rules.py``):
the verdict is the one ``msprobe-mlflow compare BASELINE THIS_RUN`` gives of the same steps afterwards. All of it
runs in a process of its own (``baseline_process.py``): the training's writer thread only hands each step's number
over and goes on, and none of the comparison's work holds the training process's interpreter.

What lands where (the local dump first, ``{dump}/rank{R}/findings/``; MLflow through the run's ``annotate``):

- ``similarities_{S}.csv`` per compared step (``param_name,similarity``, ``summary`` last; an empty cell: not
  compared) and the metric ``summary_similarity/rank{R}`` at step S, as a comparison run logs it;
- when the rule first trips: ``verdict.json`` (the comparator's verdict of this rank, plus what was not compared),
  tags ``msprobe_mlflow.live_verdict = suspicious``, ``msprobe_mlflow.first_suspicious_step`` and
  ``msprobe_mlflow.suspicious_parameters``, the run's description, one warning, and one call of ``on_suspicious``
  with the :class:`~msprobe_mlflow.compare.verdict.RankVerdict`, all as soon as the step
  is judged (not held back by MLflow's batching);
- at the end, ``verdict.json`` again, and when nothing tripped ``live_verdict = consistent`` (every probed step
  compared) or ``incomplete`` (some were not: the baseline lacks them, or became unreachable). Steps this run
  probed without directions (the always-on tier, ``msprobe_mlflow.monitoring.directions_schedule``) are not compared, by
  design: ``verdict.json`` lists them under ``steps_without_directions`` and they do not make the verdict
  incomplete.

Steps, ranks and parameters the baseline lacks are reported (one warning per kind, the rest in the log and in
``verdict.json``), never raised: training goes on. So is a baseline that cannot be read: unknown, at level L0, or
unreachable mid-run (the comparison stops there; the local dump stays complete, and ``msprobe-mlflow compare`` can
judge the whole run later).
"""
from __future__ import annotations

import json
import os
import queue
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from msprobe_mlflow.compare.engine import direction_steps
from msprobe_mlflow.compare.similarity import similarity
from msprobe_mlflow.compare.rules import judge_for
from msprobe_mlflow.compare.step import StepComparison, StepLayout, compare_step
from msprobe_mlflow.compare.verdict import (DEFAULT_DROP_THRESHOLD, DEFAULT_FIRST_THRESHOLD, DEFAULT_RULE, RankVerdict,
                                            RuleSettings, Verdict, culprit_text, trip_numbers)
from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.dump import (DUMP_FOLDER_EXPECTED, dump_folder, findings_dir, indexed_children, short_list,
                                 step_dir)
from msprobe_mlflow.notices import Notices
from msprobe_mlflow.safe_paths import atomic_write_bytes
from msprobe_mlflow.vocabulary import (DESCRIPTION_TAG, INCOMPLETE, LIVE_VERDICT_TAG, VERDICT_FILE_NAME, finding_tags,
                                       summary_similarity_key)

PREFETCH_STEPS = 4  # baseline steps opened (downloaded, for a remote run) ahead of the step being compared

SuspiciousCallback = Callable[[RankVerdict], None]


def similarities_file_name(step: int) -> str:
    return f"similarities_{step}.csv"


def _looks_like_a_path(given: str) -> bool:
    """Run IDs are plain tokens; anything with a separator, or a leading dot or tilde, is meant as a folder."""
    return any(mark in given for mark in ("/", "\\", os.sep)) or given.startswith((".", "~"))


@dataclass(frozen=True)
class BaselineOptions:
    """What the live verdict compares against and how it judges (the comparator's ``rule`` and, for msprobe's
    rule, its thresholds).

    ``on_suspicious(verdict)`` is called once, on a thread of the monitor's, with the rank's
    :class:`~msprobe_mlflow.compare.verdict.RankVerdict` (``first_suspicious_step``, ``parameter_trips`` most
    evidence first, ``summary_trip``, ``sign_noise``): set a flag your training loop reads, to stop or to save a
    checkpoint.
    """

    baseline: str
    on_suspicious: SuspiciousCallback | None = None
    first_threshold: float = DEFAULT_FIRST_THRESHOLD
    drop_threshold: float = DEFAULT_DROP_THRESHOLD
    tracking_uri: str | None = None  # where a run ID is looked up; None: the current tracking URI
    rule: str = DEFAULT_RULE
    precision: str | None = None  # the noise rule's: the coarsest format either run computed in (None: not known)
    trace_on_suspicious: bool = False  # PyTorch: trace the step after the first suspicious one, for ``locate``

    def __post_init__(self):
        given = self.baseline
        if not isinstance(given, (str, os.PathLike)) or not str(given):
            raise ValueError(f"baseline = {given!r} is not accepted; expected a dump folder or an MLflow run ID")
        given = str(given)
        if Path(given).exists():
            dump_folder(given, "baseline")  # a file, or a folder without rank<N>/, is refused saying what it is
        elif _looks_like_a_path(given):
            raise ValueError(f"baseline = {given!r}: no such folder; {DUMP_FOLDER_EXPECTED}, or an MLflow run ID")
        object.__setattr__(self, "baseline", given)
        if not isinstance(self.trace_on_suspicious, bool):
            raise ValueError(f"trace_on_suspicious = {self.trace_on_suspicious!r} is not accepted; expected True or "
                             f"False")
        if self.on_suspicious is not None and not callable(self.on_suspicious):
            raise ValueError(f"on_suspicious = {self.on_suspicious!r} is not accepted; expected a function taking "
                             f"the verdict, or None")
        self.settings  # a bad rule or threshold is refused here, not in the comparison process

    @property
    def settings(self) -> RuleSettings:
        return RuleSettings(self.rule, self.first_threshold, self.drop_threshold, self.precision)

    @property
    def is_folder(self) -> bool:
        return Path(self.baseline).is_dir()


class FolderBaseline:
    """A baseline dump folder, read where it lies."""

    def __init__(self, folder: str):
        self.folder = Path(folder)

    def steps(self, rank: int) -> list[int]:
        ranks = indexed_children(self.folder, "rank")
        if rank not in ranks:
            raise ValueError(f"{self.folder} has no rank{rank} folder (it has ranks {ranks})")
        return direction_steps(self.folder, rank, "baseline")

    def step_folder(self, rank: int, step: int) -> Path:
        return step_dir(self.folder, rank, step)


def open_baseline(options: BaselineOptions):
    """The baseline as an object with ``steps(rank)`` and ``step_folder(rank, step)`` (a local folder, downloaded
    first if need be); a run is looked up in MLflow (only then is MLflow imported). Raises, naming the reason,
    when it cannot be compared with."""
    if options.is_folder:
        return FolderBaseline(options.baseline)
    from msprobe_mlflow.tracking.run_dump import RunBaseline

    return RunBaseline(options.baseline, options.tracking_uri)


class BaselineUnavailable(Exception):
    """The baseline cannot be read (any more): the comparison stops, training goes on."""


_END = object()


class BaselinePrefetcher:
    """The baseline's steps of one rank, made local (downloaded, for a run on a tracking server) in step order on a
    thread of their own, at most ``ahead`` steps before the one being compared. The baseline is opened on that
    thread too; ``ready`` is set once it is open and its first wanted step is local (or once it is known that it
    cannot be read), which the comparison process waits for before telling ``monitor()`` it is ready."""

    def __init__(self, open_: Callable[[], object], rank: int, wanted: Callable[[int], bool],
                 ahead: int = PREFETCH_STEPS):
        self.rank = rank
        self.problem: str | None = None  # why the baseline cannot be read; set before _END is queued
        self._queue: queue.Queue = queue.Queue(maxsize=ahead)
        self._next = None
        self._stopping = threading.Event()
        self.ready = threading.Event()
        threading.Thread(target=self._prefetch, args=(open_, wanted), daemon=True,
                         name=f"msprobe-mlflow-baseline-rank{rank}").start()

    def _prefetch(self, open_: Callable[[], object], wanted: Callable[[int], bool]) -> None:
        try:
            baseline = open_()
            steps = [step for step in baseline.steps(self.rank) if wanted(step)]
        except Exception as e:
            self.problem = f"cannot be read ({e})"
            steps = []
        for step in steps:
            if self._stopping.is_set():
                break
            try:
                self._queue.put((step, baseline.step_folder(self.rank, step)))
            except Exception as e:  # unreachable, or a damaged file: the comparison stops here
                self.problem = f"could not be read at step {step} ({e})"
                break
            self.ready.set()
        self._queue.put(_END)
        self.ready.set()

    def step_at(self, step: int) -> Path | None:
        """The local folder of the baseline's ``step`` (steps asked in ascending order), None when it has no such
        step; raises :class:`BaselineUnavailable` when it cannot be read at or before ``step``."""
        while True:
            if self._next is None:
                self._next = self._queue.get()  # waits only while the prefetch thread is behind
            if self._next is _END:
                if self.problem:
                    raise BaselineUnavailable(self.problem)
                return None
            baseline_step, folder = self._next
            if baseline_step > step:
                return None
            self._next = None
            if baseline_step == step:
                return folder

    def stop(self) -> None:
        """Ends the prefetch thread (after the request in flight, if any); it is a daemon, nobody waits for it."""
        self._stopping.set()
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass


def verdict_line(options: BaselineOptions, verdict: RankVerdict | None, compared: int, not_compared: int,
                 without_directions: int = 0) -> str:
    """The live verdict in one line, for the run's description (Markdown: a baseline run is linked to its page)."""
    from msprobe_mlflow.tracking.experiments import direct_run_link  # MLflow: in the comparison's process only

    given = options.baseline
    against = f"against baseline `{given}`" if Path(given).exists() else \
        f"against baseline [{given}]({direct_run_link(given)})"
    if verdict is not None:
        evidence = "; ".join(f"{t.name} {trip_numbers(t)}" for t in verdict.parameter_trips[:3])
        if not evidence and verdict.summary_trip is not None:
            evidence = f"the summary {trip_numbers(verdict.summary_trip)}"
        more = len(verdict.parameter_trips) - 3
        graded = f", a {verdict.grade}" if verdict.grade else ""
        return (f"msprobe-mlflow live verdict: suspicious from step {verdict.first_suspicious_step}{graded} {against} "
                f"(rank {verdict.rank}; {evidence}{f' and {more} more' if more > 0 else ''})")
    line = (f"msprobe-mlflow live verdict: no suspicious step in {compared} compared step(s) {against} "
            f"({options.settings.describe()})")
    line += f"; {not_compared} step(s) not compared" if not_compared else ""
    return line + (f"; {without_directions} step(s) probed without directions (always-on tier)"
                   if without_directions else "")


class LiveComparison:
    """The live verdict of one rank (see the module docstring), run by the comparison process
    (``sinks/baseline_process.py``): ``compare`` each probed step as it lands, ``close`` at the end. ``run`` takes
    ``annotate``, or is None (findings in the local dump only); ``notices`` takes ``warn`` and ``log``;
    ``on_suspicious`` is called once, with the verdict, when the rule first trips."""

    def __init__(self, options: BaselineOptions, config: GradProbeConfig, rank: int, *, run=None, notices=None,
                 on_suspicious: SuspiciousCallback = lambda verdict: None, describe_run: bool = True):
        self.options = options
        self.dump_path = config.dump_path
        self.rank = rank
        self.run = run
        self.notices = notices or Notices()
        self.on_suspicious = on_suspicious
        self.describe_run = describe_run  # one rank describes the run when nothing tripped (several would race)
        self.judge = judge_for(options.settings, rank)
        self.compared: list[int] = []
        self.not_compared: dict[str, list[int]] = {}  # reason -> steps
        self.without_directions: list[int] = []  # steps this run probed without directions (the always-on tier)
        self.missing_parameters: dict[str, list[str]] = {}  # "not in baseline" / "only in baseline" / ... -> names
        self.failures: list[str] = []
        self._warned: set[str] = set()
        self._prefetcher = BaselinePrefetcher(lambda: open_baseline(options), rank, config.wants_step)

    def wait_until_ready(self) -> None:
        """Returns once the baseline is open and its first step local (see :class:`BaselinePrefetcher`), so that
        the first step compared waits for nothing the later ones do not."""
        self._prefetcher.ready.wait()

    def compare(self, step: int, layout: StepLayout) -> None:
        """Compares this run's ``step`` (in the local dump; ``layout``: its parameters' names and shapes) with the
        baseline's. A failure is logged with its traceback at once, counted and warned about at ``close``; the next
        step is compared as usual."""
        try:
            self._compare(step, layout)
        except Exception as e:
            self.failures.append(f"step {step}: {type(e).__name__}: {e}")  # an OSError's text names its file
            self.notices.log(f"rank {self.rank}: the live comparison of step {step} failed:\n{traceback.format_exc()}")

    def _compare(self, step: int, layout: StepLayout) -> None:
        try:
            folder = self._prefetcher.step_at(step)
        except BaselineUnavailable as e:
            self._skip(step, f"baseline {self.options.baseline} {e}", "unavailable")
            return
        if folder is None:
            self._skip(step, "not in the baseline")
            return
        try:
            comparison = compare_step(step, folder, step_dir(self.dump_path, self.rank, step), layout=layout,
                                      shapes_must_match=False)
        except ValueError as e:  # a damaged file, named in the message
            self._skip(step, f"the step cannot be read ({e})", "damaged")
            return
        self._report_parameters(comparison)
        if not comparison.compared:
            self._skip(step, "no parameter in common with the baseline")
            return
        self.compared.append(step)
        folder = findings_dir(self.dump_path, self.rank)
        atomic_write_bytes(folder / similarities_file_name(step), comparison.csv_text(layout))
        verdict = self.judge.judge_step(comparison)
        if verdict is not None:
            self._tell(verdict)
        if self.run is not None:
            self.run.annotate(step=step,
                              metrics={summary_similarity_key(self.rank): similarity(*comparison.summary_counts)},
                              files=[folder / similarities_file_name(step)])

    def _tell(self, verdict: RankVerdict) -> None:
        """The verdict, at once: the local file, one warning, the callback, then the run's tags and description."""
        path = self._write_verdict()
        self.notices.warn(f"rank {self.rank}: step {verdict.first_suspicious_step} is suspicious against baseline "
                          f"{self.options.baseline}:\n{self._verdict().describe()}")
        self.on_suspicious(verdict)
        if self.run is not None:
            names = ", ".join(culprit_text(t) for t in verdict.parameter_trips)
            self.run.annotate(tags={LIVE_VERDICT_TAG: "suspicious", DESCRIPTION_TAG: self._line(),
                                    **finding_tags("suspicious", self.rank, verdict.first_suspicious_step,
                                                   names or "(the summary only)",
                                                   several_ranks=not self.describe_run)},
                              files=[path])

    def _skip(self, step: int, reason: str, kind: str | None = None) -> None:
        """A step not compared: counted under ``reason``, warned about once per kind."""
        self.not_compared.setdefault(reason, []).append(step)
        kind = kind or reason
        message = f"rank {self.rank}: step {step} not compared with the baseline: {reason}"
        if kind in self._warned:
            self.notices.log(message)
            return
        self._warned.add(kind)
        self.notices.warn(f"{message}. Training goes on and the local dump stays complete; later steps like it are "
                          f"logged, and listed in {findings_dir(self.dump_path, self.rank) / VERDICT_FILE_NAME}")

    def _report_parameters(self, comparison: StepComparison) -> None:
        if comparison.bounds_differ and "bounds" not in self._warned:
            self._warned.add("bounds")
            a, b = (", ".join(columns) for columns in comparison.bounds_differ)
            self.notices.warn(f"rank {self.rank}: L2 distributions not compared with the baseline: they were counted "
                              f"over other bounds (baseline {a}; this run {b}); give both the same grad_probe.bounds")
        for what, names in (("not in the baseline", comparison.only_in_b),
                            ("only in the baseline", comparison.only_in_a),
                            ("shapes differ", comparison.shape_differs)):
            known = self.missing_parameters.setdefault(what, [])
            new = [name for name in names if name not in known]
            if new:
                known += new
                message = (f"rank {self.rank}: parameters not compared with the baseline from step "
                           f"{comparison.step} ({what}): {short_list(new, 5)}")
                if f"parameters {what}" in self._warned:
                    self.notices.log(message)
                else:
                    self.notices.warn(message)
                    self._warned.add(f"parameters {what}")

    def _verdict(self) -> Verdict:
        return Verdict(self.options.settings, [self.judge.report()])

    def _line(self) -> str:
        line = verdict_line(self.options, self.judge.verdict, len(self.compared),
                            sum(len(steps) for steps in self.not_compared.values()), len(self.without_directions))
        first_steps = self.judge.report().first_steps
        return f"{line}; {first_steps.note()}" if first_steps and self.judge.verdict is None else line

    def _write_verdict(self) -> Path:
        """``verdict.json``: the comparator's verdict of this rank, and what was and was not compared."""
        path = findings_dir(self.dump_path, self.rank) / VERDICT_FILE_NAME
        report = {"baseline": self.options.baseline, "rank": self.rank, "verdict": self._verdict().to_dict(),
                  "compared_steps": self.compared, "steps_not_compared": self.not_compared,
                  "steps_without_directions": self.without_directions,
                  "parameters_not_compared": self.missing_parameters}
        atomic_write_bytes(path, json.dumps(report, indent=1).encode())
        return path

    def close(self) -> None:
        """Writes the final ``verdict.json`` and, when nothing tripped, the run's verdict tag and description."""
        self._prefetcher.stop()
        verdict = self.judge.finish()
        if verdict is not None:
            self._tell(verdict)
        if self.failures:
            self.notices.warn(f"rank {self.rank}: the live comparison failed {len(self.failures)} time(s); "
                              f"first: {self.failures[0]}")
        path = self._write_verdict()
        if self.run is None:
            return
        tags = {}
        if self.judge.verdict is None and self.describe_run:
            tags = {LIVE_VERDICT_TAG: INCOMPLETE if self.not_compared else "consistent",
                    DESCRIPTION_TAG: self._line()}
        self.run.annotate(tags=tags, files=[path])
