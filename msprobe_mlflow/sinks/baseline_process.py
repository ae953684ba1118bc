"""The live verdict's own process: :class:`BaselineSink` hands each probed step's number (and its parameters' names
and shapes, when they change) to a process that reads the step back from the local dump and compares it with the
baseline (:class:`~msprobe_mlflow.sinks.baseline.LiveComparison`). What it finds comes back as small messages,
which a thread of this sink passes on: ``annotate`` to the run, warnings to the user, the verdict to
``on_suspicious``.

Why a process: comparing a step of 512 small tensors is ~1 ms of Python and small numpy calls. On a thread it
held the interpreter that a Python-heavy training loop needs (1.04x-1.07x its iteration time, measured); in a
process of its own it holds nothing of the training's.

When: the process is started by ``monitor()``, which returns once the process says it is ready (its imports done,
MLflow's too for a baseline run, the baseline open and its first step local; at most ``READY_WAIT_SECONDS``), so
step 0 is judged as soon as later steps are: a fast loop used to run several steps before the process had even
imported MLflow. The process is started as ``python -m`` this module, not
by ``multiprocessing`` (whose spawn would import the user's training script again); it ignores Ctrl-C (training
closes it at ``stop()``) and ends when the training process does (its input closes). Messages are pickles over
the process's stdin and stdout, between two processes of the same user and program, of the small types in
``sinks/baseline_messages.py`` (a module of their own: this one runs as ``__main__`` in the process).
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading

from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.dump_process import start_module_process
from msprobe_mlflow.notices import Notices
from msprobe_mlflow.records import StepRecord
from msprobe_mlflow.sinks.baseline import BaselineOptions, LiveComparison, StepLayout
from msprobe_mlflow.sinks.baseline_messages import (Annotate, Close, Closed, Flush, Flushed, Log, Ready, Setup, Step,
                                                    Suspicious, Warn, WithoutDirections)
from msprobe_mlflow.tracking.server import tracking_uri_if_imported
from msprobe_mlflow.vocabulary import (BASELINE_TAG, DESCRIPTION_TAG, INCOMPLETE, LIVE_VERDICT_PRECISION_TAG,
                                       LIVE_VERDICT_RULE_TAG, LIVE_VERDICT_TAG)

QUEUED_MESSAGES = 100_000  # steps waiting to be handed to the process; beyond that a step is not compared
CLOSE_WAIT_SECONDS = 60  # for the process to exit once it said it closed
READY_WAIT_SECONDS = 120  # monitor() waits this long at most for the process to be ready; then training starts
GOES_ON = ("Training goes on and the local dump stays complete: `msprobe-mlflow compare` judges the whole run "
           "afterwards")


class BaselineSink:
    """The live verdict of one rank, compared in a process of its own (see the module docstring). ``run`` is the
    MLflow run's ``annotate`` target, or None (findings in the local dump only)."""

    def __init__(self, options: BaselineOptions, config: GradProbeConfig, rank: int, *, run=None,
                 notices: Notices | None = None, describe_run: bool = True):
        self.options = options
        self.rank = rank
        self.run = run
        self.notices = notices or Notices()
        self.describe_run = describe_run
        self.not_handed_over: list[int] = []  # steps the process never got (it ended, or fell too far behind)
        self._sent_layout = None
        self._flushes_sent = self._flushes_done = 0
        self._replies = threading.Condition()
        self._closed_cleanly = self._suspicious = self._ready = False
        self._problem = ""  # why the process could not compare every step, when it could not
        self._ended = threading.Event()  # the process's output ended: every message it sent is handled
        if run is not None:
            tags = {BASELINE_TAG: options.baseline, LIVE_VERDICT_RULE_TAG: options.rule}
            if options.precision:
                tags[LIVE_VERDICT_PRECISION_TAG] = options.precision
            run.annotate(tags=tags)
        # a run ID is looked up where this process would look it up
        in_process = dataclasses.replace(options, on_suspicious=None, tracking_uri=options.tracking_uri or (
            None if options.is_folder else tracking_uri_if_imported()))
        self.process = self._start(Setup(in_process, config, rank, run is not None, describe_run))
        self._outbox: queue.Queue = queue.Queue(maxsize=QUEUED_MESSAGES)
        self._sender = threading.Thread(target=self._send_all, daemon=True,
                                        name=f"msprobe-mlflow-live-verdict-rank{rank}")
        self._sender.start()
        self._wait_until_ready()

    def _wait_until_ready(self) -> None:
        """Returns once the process is ready to compare (or ended: it warned), at most ``READY_WAIT_SECONDS``."""
        with self._replies:
            ready = self._replies.wait_for(lambda: self._ready or self._ended.is_set(), READY_WAIT_SECONDS)
        if not ready:
            self.notices.warn(f"rank {self.rank}: the live comparison is not ready after {READY_WAIT_SECONDS} s "
                              f"(opening baseline {self.options.baseline}); training starts, and the first steps "
                              f"are judged once it is ready")

    def _start(self, setup: Setup) -> subprocess.Popen | None:
        try:
            process = start_module_process(__name__)
            pickle.dump(setup, process.stdin)
            process.stdin.flush()
        except OSError as e:  # no interpreter to start, or it ended at once: training goes on without the verdict
            self._ended.set()
            self._problem = f"the live comparison process could not start ({e})"
            self.notices.warn(f"rank {self.rank}: {self._problem}; steps are not compared with the baseline. "
                              f"{GOES_ON}")
            return None
        threading.Thread(target=self._receive, args=(process,), daemon=True,
                         name=f"msprobe-mlflow-live-verdict-rank{self.rank}-replies").start()
        return process

    # --- writer thread -----------------------------------------------------------------------------------------
    def handle(self, record: StepRecord) -> None:
        """Hands the step over and returns (the process reads its directions from the local dump)."""
        if record.skipped_directions:  # the always-on tier chose statistics only: by design, not a gap
            message = WithoutDirections(record.step)
        elif (record.names, record.shapes) == self._sent_layout:
            message = Step(record.step)
        else:
            message = Step(record.step, list(record.names), list(record.shapes))
        try:
            self._outbox.put(message, block=False)
        except queue.Full:
            if not self.not_handed_over:
                self.notices.warn(f"rank {self.rank}: step {record.step} not compared with the baseline: the live "
                                  f"comparison fell {QUEUED_MESSAGES} steps behind. {GOES_ON}")
            self.not_handed_over.append(record.step)
            return
        if isinstance(message, Step) and message.names is not None:  # the process knows this layout from now on
            self._sent_layout = (message.names, message.shapes)

    # --- sender thread -----------------------------------------------------------------------------------------
    def _send_all(self) -> None:
        """Writes the queued messages into the process's input, in order, until the last (``close``)."""
        while True:
            message = self._outbox.get()
            if isinstance(message, Close):  # with every step that was not handed over, now that all are known
                message = Close(tuple(self.not_handed_over))
            self._send(message)
            if isinstance(message, Close):
                return

    def _send(self, message) -> None:
        try:
            if self._ended.is_set():
                raise BrokenPipeError
            pickle.dump(message, self.process.stdin)
            self.process.stdin.flush()
        except OSError:  # the process ended: _receive warned once, close() counts the steps in the description
            if isinstance(message, Step):
                self.not_handed_over.append(message.step)

    # --- the process's messages, on a thread of their own ------------------------------------------------------
    def _receive(self, process: subprocess.Popen) -> None:
        try:
            while True:
                self._dispatch(pickle.load(process.stdout))
        except EOFError:
            pass
        except Exception as e:
            self.notices.failure("live verdict", f"rank {self.rank}: a message of the live comparison process "
                                                 f"could not be read ({e!r})")
            process.kill()
        finally:
            process.stdout.close()
            if not self._closed_cleanly:  # said before _ended is set: close() returns after the warning, not before
                self._problem = f"the live comparison process ended unexpectedly (exit code {process.wait()})"
                self.notices.warn(f"rank {self.rank}: {self._problem}; later steps are not compared. {GOES_ON}")
            self._ended.set()
            with self._replies:
                self._replies.notify_all()

    def _dispatch(self, message) -> None:
        match message:
            case Annotate(findings) if self.run is not None:
                self.run.annotate(**findings)
            case Warn(text):
                self.notices.warn(text)
            case Log(text):
                self.notices.log(text)
            case Suspicious(verdict):
                self._suspicious = True
                if self.options.on_suspicious is not None:
                    try:
                        self.options.on_suspicious(verdict)
                    except Exception as e:
                        self.notices.failure("on_suspicious", f"on_suspicious raised {e!r}")
            case Ready():
                with self._replies:
                    self._ready = True
                    self._replies.notify_all()
            case Flushed(token):
                with self._replies:
                    self._flushes_done = token
                    self._replies.notify_all()
            case Closed():
                self._closed_cleanly = True

    # --- the training's threads --------------------------------------------------------------------------------
    def flush(self) -> None:
        """Returns once every step handed over is compared and what that found is passed on."""
        with self._replies:
            self._flushes_sent += 1
            token = self._flushes_sent
        self._outbox.put(Flush(token))
        with self._replies:
            self._replies.wait_for(lambda: self._flushes_done >= token or self._ended.is_set())

    def close(self) -> None:
        """The process compares what is queued, writes the final ``verdict.json`` and (when nothing tripped) the
        run's verdict tag and description, and exits. Steps it never got are named in both."""
        self._outbox.put(Close())
        self._sender.join()
        if self.process is not None:
            try:
                self.process.stdin.close()  # after the close message: the process reads it, then its input ends
            except OSError:
                pass
        self._ended.wait()
        if self.process is not None:
            try:
                self.process.wait(CLOSE_WAIT_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if not self._closed_cleanly and not self._suspicious and self.run is not None and self.describe_run:
            line = (f"msprobe-mlflow live verdict: incomplete against baseline {self.options.baseline}: "
                    f"{self._problem}, {len(self.not_handed_over)} step(s) not compared; `msprobe-mlflow compare` "
                    f"judges the whole run")
            self.run.annotate(tags={LIVE_VERDICT_TAG: INCOMPLETE, DESCRIPTION_TAG: line})


class _ToTrainingProcess:
    """In the comparison process: the run's ``annotate``, the notices and the verdict, sent as messages."""

    def __init__(self, output):
        self.output = output

    def send(self, message) -> None:
        pickle.dump(message, self.output)
        self.output.flush()

    def annotate(self, **findings) -> None:
        self.send(Annotate(findings))

    def warn(self, message: str) -> None:
        self.send(Warn(message))

    def log(self, message: str) -> None:
        self.send(Log(message))


def main() -> None:
    """The comparison process: compares the steps named on stdin, one at a time, until told to close."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops training, which then closes this process
    replies = _ToTrainingProcess(os.fdopen(os.dup(1), "wb"))
    os.dup2(2, 1)  # a stray print goes to stderr, not into the messages
    inbox = sys.stdin.buffer
    try:
        setup: Setup = pickle.load(inbox)
        comparison = LiveComparison(setup.options, setup.config, setup.rank,
                                    run=replies if setup.has_run else None, notices=replies,
                                    on_suspicious=lambda verdict: replies.send(Suspicious(verdict)),
                                    describe_run=setup.describe_run)
        comparison.wait_until_ready()
        replies.send(Ready())
        _compare_until_closed(inbox, comparison, replies)
    except (EOFError, BrokenPipeError):  # the training process ended without closing: nobody to tell
        return


def _compare_until_closed(inbox, comparison: LiveComparison, replies: _ToTrainingProcess) -> None:
    layout = None
    while True:
        message = pickle.load(inbox)
        if isinstance(message, Step):
            layout = StepLayout(message.names, message.shapes) if message.names is not None else layout
            comparison.compare(message.step, layout)
        elif isinstance(message, WithoutDirections):
            comparison.without_directions.append(message.step)
        elif isinstance(message, Flush):
            replies.send(Flushed(message.token))
        elif isinstance(message, Close):
            if message.not_handed_over:
                comparison.not_compared["not handed to the live comparison"] = list(message.not_handed_over)
            try:
                comparison.close()
            except Exception as e:  # the final verdict.json could not be written: said, and the close goes on
                replies.warn(f"rank {comparison.rank}: the live comparison could not finish its findings "
                             f"({type(e).__name__}: {e})")
            replies.send(Closed())
            return


if __name__ == "__main__":
    main()
