"""What every gradient monitor shares, whatever the framework and wherever the steps go: the rank policy, the
writer thread, the local dump and the list of sinks. A monitor only turns its framework's gradients into a pending
:class:`StepRecord`; the sinks (``msprobe_mlflow.sinks``) are chosen by the monitor's edge code. This module imports
no MLflow, torch or MindSpore.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import signal
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from msprobe_mlflow.background import BackgroundStepWriter, PendingStep
from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.dump import TrainingLock, new_training_id, set_aside_other_training, short_list, \
    write_dump_config, write_training_id
from msprobe_mlflow.dump_process import LocalDump
from msprobe_mlflow.notices import Notices
from msprobe_mlflow.vocabulary import FAILED, FINISHED, KILLED

# How long a SIGTERM (what torchrun sends the other ranks when one fails) is held while the open sessions say
# ``killed`` (one request each) before the process dies of it as it would have.
KILLED_REPORT_SECONDS = float(os.environ.get("MSPROBE_MLFLOW_KILLED_REPORT_SECONDS", "5"))
FAILURE_REASON_LIMIT = 500  # characters of a failed rank's reason: a line of the run's tags, within MLflow's limit
logger = logging.getLogger("msprobe_mlflow")


def outcome_of(error: BaseException | None) -> tuple[str, str]:
    """How the training ended, as ``(status, reason)`` (``tracking.RANK_ENDINGS``), from the exception that ends it:
    none, ``StopIteration`` or ``sys.exit(0)``: finished; ``KeyboardInterrupt``: killed; any other: failed. The
    reason is :func:`failure_reason`'s."""
    if error is None or isinstance(error, (StopIteration, GeneratorExit)) or (
            isinstance(error, SystemExit) and error.code in (0, None)):
        return FINISHED, ""
    return (KILLED if isinstance(error, KeyboardInterrupt) else FAILED), failure_reason(error)


# MindSpore's sections after an error's message: a line of dashes, "- <title>", a line of dashes, then the
# section ("- C++ Call Stack: (For framework developers)", "- The Traceback of Net Construct Code:"...).
_FRAMEWORK_BANNER = re.compile(r"^-{10,}\n- (?P<title>[^\n]*)\n-{10,}$", re.MULTILINE)
_CALL_STACK = re.compile(r"call stack|traceback", re.IGNORECASE)


def failure_reason(error: BaseException, limit: int = FAILURE_REASON_LIMIT) -> str:
    """``Type: message`` of the exception that ended a training, for the run's ``rank{R}.failure`` tag, on one line:
    MindSpore's banners are dropped with the call stacks and tracebacks they introduce (the training's own output
    has them whole), the other sections' text is kept; whitespace runs become one space. Longer than ``limit``, it
    is cut after the last whole word that fits and ends in ``...`` (a path or a name is never cut in two, unless one
    word is longer than the limit)."""
    parts = _FRAMEWORK_BANNER.split(str(error))  # the message, then a title and its section's text per section
    kept = [parts[0]] + [text for title, text in zip(parts[1::2], parts[2::2]) if not _CALL_STACK.search(title)]
    message = " ".join(" ".join(kept).split())
    text = f"{type(error).__name__}: {message}" if message else type(error).__name__
    if len(text) <= limit:
        return text
    cut = text[:limit - 3]
    if text[limit - 3] != " " and " " in cut:
        cut = cut.rsplit(" ", 1)[0]
    return cut.rstrip(" ,;:") + "..."


@dataclass(frozen=True)
class RankPolicy:
    """Which ranks probe and log, and which one owns the run, declared once for a monitor and its sinks.

    ``wanted`` is the config's ``rank`` list (empty: every rank). Rank 0 owns the run: its run ID is the one every
    rank logs into, it describes the run, and at the end it waits for the other wanted ranks.
    """

    rank: int = 0
    world_size: int = 1
    wanted: tuple[int, ...] = ()

    @classmethod
    def of(cls, config: GradProbeConfig, rank: int = 0, world_size: int = 1) -> "RankPolicy":
        return cls(rank, world_size, tuple(config.rank))

    @property
    def probes(self) -> bool:
        """This rank probes its gradients, writes its dump and logs."""
        return self.rank_is_wanted(self.rank)

    @property
    def owns_run(self) -> bool:
        return self.rank == 0

    def rank_is_wanted(self, rank: int) -> bool:
        return not self.wanted or rank in self.wanted

    def wanted_ranks(self) -> list[int]:
        """The ranks expected to log into the run."""
        return [r for r in range(self.world_size) if self.rank_is_wanted(r)]


class RunNotes(Protocol):
    def annotate(self, *, step: int = 0, metrics: dict[str, float] | None = None,
                 tags: dict[str, str] | None = None, files=()) -> None:
        """Queues findings for the run (metrics at ``step``, tags, files inside the dump folder); never waits."""


class RunSink(RunNotes, Protocol):
    """The sink of the MLflow run a session logs into (``sinks/mlflow``): what the session and its monitor tell it
    and ask it beside the steps, declared so that no one looks for it by attribute; the session's ``run_sink``."""

    run_id: str

    @property
    def failed_ranks(self) -> dict[int, str]:
        """At close: the ranks known to have failed or been killed, ``{rank: status}``."""

    def training_ended(self, status: str, reason: str = "") -> None:
        """How this rank's training ended (``vocabulary.RANK_ENDINGS``), told before ``close()``."""

    def process_dies(self, status: str, reason: str) -> None:
        """The process dies now (an uncaught exception, a SIGTERM): to be said at once, before the exit handlers run
        or the launcher's SIGKILL comes."""


def ensure_writable_folder(path: str) -> None:
    """Fails before training starts, not mid-run, when the dump folder cannot be written."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".msprobe-mlflow-write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"dump_path = {path!r} is not a writable folder ({e.strerror or e})") from e


def set_aside_message(dump_path: str, moved: list[Path], training_id: str) -> str:
    places: dict[Path, list[str]] = {}
    for path in moved:
        places.setdefault(path.parent, []).append(path.name)
    where = "; ".join(f"{short_list(names)} to {folder}" for folder, names in places.items())
    return (f"dump_path {dump_path} held another training's steps: moved {where} (nothing deleted; compare or "
            f"upload them from there, delete them when no longer needed), so that this training ({training_id}) "
            f"does not mix its steps with them")


class ProbeSession:
    """One monitoring session: a writer thread that writes each step to the local dump (through its own process
    for steps of many parameters: :mod:`msprobe_mlflow.dump_process`), then hands it to each sink in order. A
    failing sink is counted in ``errors`` and never stops the dump or the other sinks.

    ``training_id`` (None: a new one) names the training in its dump; a monitor that opens a session again passes
    its own, so its earlier steps stay in place. ``from_rank_zero(value)`` returns rank 0's value on every rank: the
    framework's broadcast (a collective), the one that shares the run ID."""

    def __init__(self, config: GradProbeConfig, *, framework: str, ranks: RankPolicy = RankPolicy(),
                 notices: Notices | None = None, training_id: str | None = None,
                 from_rank_zero: Callable[[str | None], str | None] = lambda value: value):
        ensure_writable_folder(config.dump_path)
        self.config = config
        self.framework = framework
        self.ranks = ranks
        self.notices = notices or Notices()
        self._training_lock = TrainingLock(config.dump_path, ranks.rank)  # held while this session is open
        self.training_id = self._claim_dump_folder(training_id or new_training_id(), from_rank_zero)
        self.sinks: list = []
        self.run_sink: RunSink | None = None  # the one of ``sinks`` that logs into the MLflow run, if any
        self._after_sinks: list[Callable[[], None]] = []
        self._local_dump = LocalDump(config.dump_path, config.direction_format, self.notices)
        self._writer = BackgroundStepWriter([self._local_dump.write])
        self.closed = False
        self.outcome: tuple[str, str] | None = None  # (status, reason), see end_as()
        _open_sessions.add(self)

    def _claim_dump_folder(self, training_id: str, from_rank_zero) -> str:
        """Makes ``dump_path`` this training's before its first step, and returns its ID (rank 0's, on every rank).

        Another training's steps are moved to ``{dump_path}/previous/{ID}/`` with one warning saying where (never
        written among, never deleted). Rank 0 sets aside every rank folder and writes the config before it hands
        on its ID, and the other ranks write nothing before they receive it: on a shared file system nothing of
        this training is there yet. Each other rank then sets aside its own rank folder (found only on a file
        system rank 0 does not share). Each probing rank records the ID in ``rank{R}/training_id`` and holds
        ``rank{R}/training.lock`` until :meth:`close` (``upload`` tells a SIGKILLed training from a live one by it)."""
        dump_path, rank, first = self.config.dump_path, self.ranks.rank, self.ranks.owns_run
        moved: list[Path] = []
        if first:
            moved = set_aside_other_training(dump_path, training_id)
            write_dump_config(dump_path, self.framework, self.config, training_id)
        training_id = from_rank_zero(training_id) or training_id
        if not first:
            moved = set_aside_other_training(dump_path, training_id, [rank])
            write_dump_config(dump_path, self.framework, self.config, training_id)
        if self.ranks.probes:
            write_training_id(dump_path, rank, training_id)
            self._training_lock.hold()
        if moved:
            self.notices.warn(set_aside_message(dump_path, moved, training_id))
        return training_id

    def close_after_sinks(self, release: Callable[[], None]) -> None:
        """``release()`` runs at :meth:`close`, once every sink is closed: what the sinks used to the end (the
        aggregation's collective group, whose last exchange is in a sink's ``close``)."""
        self._after_sinks.append(release)

    def judge_anomalies(self, rule) -> None:
        """Steps written by the local dump's process come back with their anomaly flags by ``rule`` (a
        :class:`~msprobe_mlflow.anomaly_rule.SpikeRule`; see :mod:`msprobe_mlflow.dump_process`), for the sinks that
        report them or act on them. Before the first step; other steps are judged by those sinks."""
        self._local_dump.spike_rule = rule

    def add_sinks(self, sinks: list, run_sink: RunSink | None = None) -> None:
        """Sinks get the steps submitted from now on, after the local dump; ``run_sink``, one of them, is the
        session's :attr:`run_sink`."""
        self.sinks += sinks
        if run_sink is not None:
            self.run_sink = run_sink
        self._writer.handlers += [sink.handle for sink in sinks]

    def submit(self, pending: PendingStep) -> None:
        self._writer.submit(pending)

    @property
    def errors(self) -> list[str]:
        """What the writer thread and the sinks could not do (each also logged)."""
        return list(self._writer.errors)

    def flush(self) -> None:
        """Waits until every submitted step is on disk and delivered by every sink."""
        self._writer.flush()
        for sink in self.sinks:
            self._writer.guarded(f"{type(sink).__name__}.flush failed", sink.flush)

    def end_as(self, status: str, reason: str = "") -> None:
        """Records how the training ended (``outcome_of``), for the sinks to say at ``close()``; the first call
        counts (a crash seen by the monitor's ``with`` block stays a crash when the process then exits)."""
        if self.outcome is None:
            self.outcome = (status, reason)

    def close(self) -> None:
        """Writes what is pending, then closes each sink (which delivers what it still holds). Safe to call twice;
        ``errors`` stay readable afterwards.

        The :attr:`run_sink` is told first how the training ended: as recorded by :meth:`end_as`, else from the
        exception propagating now (``stop()`` in a ``finally:`` or ``except`` block while training raised), else
        finished."""
        if self.closed:
            return
        self.closed = True
        self.end_as(*outcome_of(sys.exc_info()[1]))
        if self.run_sink is not None:
            self.run_sink.training_ended(*self.outcome)
        self._writer.close()
        self._writer.guarded("closing the local dump failed", self._local_dump.close)
        for sink in self.sinks:
            self._writer.guarded(f"{type(sink).__name__}.close failed", sink.close)
        for release in self._after_sinks:
            self._writer.guarded(f"releasing {release.__qualname__} failed", release)
        self._training_lock.release()
        _open_sessions.discard(self)
        if self._writer.errors:
            self.notices.warn(f"{len(self._writer.errors)} write failure(s); first: {self._writer.errors[0]}")


class _OpenSessions:
    """The sessions open in this process, and the process's hooks while any is: an uncaught exception marks them
    failed (the traceback printed first), a SIGTERM marks them killed (only where SIGTERM had Python's default
    action: a handler of the user's or the framework's is left alone; after the report, bounded by
    ``KILLED_REPORT_SECONDS``, the process dies of the signal as it would have). The first session to open installs
    them; the last to close puts back those it found, so the process outlives its monitors unchanged (a hook
    replaced meanwhile is someone else's, and stays)."""

    def __init__(self) -> None:
        self._sessions: "weakref.WeakSet[ProbeSession]" = weakref.WeakSet()
        self._lock = threading.RLock()  # a session collected while the lock is held releases under it
        self._excepthook: Callable | None = None  # ours, while installed
        self._found_excepthook: Callable | None = None  # the one ours calls first, and puts back

    def add(self, session: ProbeSession) -> None:
        with self._lock:
            self._sessions.add(session)
            weakref.finalize(session, self.release_unused)  # dropped without close(): its hooks go with it
            if self._excepthook is None:  # else still installed (a session dropped unclosed is gone from the set)
                self._install()

    def discard(self, session: ProbeSession) -> None:
        with self._lock:
            self._sessions.discard(session)
            if not self._sessions:
                self._restore()

    def sessions(self) -> list[ProbeSession]:
        return list(self._sessions)

    def release_unused(self) -> None:
        """Puts the hooks back when no session is open any more though none closed last (the last ones were
        dropped without ``stop()``: called as each is collected)."""
        with self._lock:
            if not list(self._sessions):  # the live ones (a session being collected is not)
                self._restore()

    def end_all_as(self, status: str, reason: str) -> None:
        """The process dies: each open session ends so, and its run sink says it at once."""
        for session in self.sessions():
            session.end_as(status, reason)
            if session.run_sink is not None:
                try:
                    session.run_sink.process_dies(status, reason)
                except Exception:  # the process is dying of something else: say so in the log, never hide that
                    logger.warning("msprobe-mlflow could not report the end of the training", exc_info=True)

    def _install(self) -> None:
        found = self._found_excepthook = sys.excepthook

        def report_uncaught(kind, error, traceback) -> None:
            found(kind, error, traceback)
            self.end_all_as(*outcome_of(error))

        sys.excepthook = self._excepthook = report_uncaught
        if _on_main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _report_then_die)

    def _restore(self) -> None:
        if self._excepthook is None:
            return
        if sys.excepthook is self._excepthook:
            sys.excepthook = self._found_excepthook
        self._excepthook = self._found_excepthook = None
        # off the main thread it cannot be put back: ours stays, which with no session open dies as the default does
        if _on_main_thread() and signal.getsignal(signal.SIGTERM) is _report_then_die:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the one it replaced: it replaces nothing else


def _on_main_thread() -> bool:
    """Signal handlers are set on the main thread only."""
    return threading.current_thread() is threading.main_thread()


def _report_then_die(signum, frame) -> None:
    signal.signal(signum, signal.SIG_DFL)
    reporter = threading.Thread(target=_open_sessions.end_all_as, args=(KILLED, signal.Signals(signum).name),
                                daemon=True)
    reporter.start()
    reporter.join(KILLED_REPORT_SECONDS)
    os.kill(os.getpid(), signum)


_open_sessions = _OpenSessions()


@atexit.register
def _close_open_sessions() -> None:
    """Interpreter exit writes and uploads what training submitted but the threads had not finished."""
    for session in _open_sessions.sessions():
        session.close()
