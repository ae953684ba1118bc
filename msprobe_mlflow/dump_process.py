"""The local dump, written by a process of its own for steps of many parameters.

Why: writing a step is Python on the writer thread (a ``repr`` per number of the CSV, the directions' layout, the
files' paths and renames), and it holds the interpreter lock that a Python-heavy training loop needs: training
waits for it at every torch call that hands the lock back. With 512 small tensors that is milliseconds a step,
the most of what the local dump costs training (``benchmarks/monitor_benchmark.py``, row *+ local dump*). In a
process of its own it holds nothing of the training's.

When: for steps of ``PROCESS_MIN_PARAMETERS`` parameters or more. With fewer, writing a step is a fraction of a
millisecond of Python, less than handing the step over would cost. The writer thread starts the process at the
first such step, as ``python -m`` this module (as the live verdict's process: ``multiprocessing``'s spawn would
import the user's training script again).

How: the writer thread pickles the step's record into the process's input and waits, without the interpreter lock,
for its answer: the step's CSV bytes (which the MLflow sink's metrics read back), or the exception writing raised,
raised again on the writer thread, so that it is reported as any failure of the local dump. The sinks get the step
once it is on disk, as before. If the process cannot start or ends, the writer thread writes that step and every
later one itself and says so once: no step is lost. The process ignores Ctrl-C (training closes it at ``stop()``);
if the training process dies, the process writes what it was sent and ends (its input closes). Pickles pass
between two processes of the same user and program only.

Anomaly flags: given their rule (:attr:`LocalDump.spike_rule`), the process also judges each step
(:mod:`msprobe_mlflow.anomaly_rule`) and answers the step's flags with it, in ``record.anomaly_flags``, for the
sinks that report or act on them (once it ended, those sinks judge the later steps, from empty windows). In the
training process, judging 512 parameters takes about 1 ms of CPU a step in dozens of numpy calls, each taking the
interpreter lock back from training: the flags cost 1.02x-1.07x a step of 512 small tensors there, 0.92x-0.96x
judged here (``benchmarks/live_benchmark.py``, *flags / L1*).
"""
from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import threading
from pathlib import Path

from msprobe_mlflow.anomaly_rule import AnomalyFlags, SpikeRule
from msprobe_mlflow.dump import summary_csv_bytes, write_step
from msprobe_mlflow.notices import Notices
from msprobe_mlflow.records import StepRecord

PROCESS_MIN_PARAMETERS = 128
PIPE_BYTES = 1 << 20  # a step's directions pass in 1 MiB pieces, not the pipe's default 64 KiB


def start_module_process(module: str) -> subprocess.Popen:
    """``python -m module`` with pipes on its input and output, importing this copy of the package."""
    package_root = str(Path(__file__).resolve().parent.parent)  # the folder holding msprobe_mlflow/
    path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": path})


class LocalDump:
    """Writes each step's record into ``dump_path`` (:func:`msprobe_mlflow.dump.write_step`), in a process of its
    own for records of many parameters (see the module docstring). Called by the writer thread only."""

    def __init__(self, dump_path: str, direction_format: str, notices: Notices):
        self.dump_path = dump_path
        self.direction_format = direction_format
        self.notices = notices
        self.process: subprocess.Popen | None = None
        self.spike_rule: SpikeRule | None = None  # set before the first step: the process judges the flags too
        self._in_thread = False  # the process could not start or ended: every step is written here

    def write(self, record: StepRecord) -> None:
        if self.process is None and not self._in_thread and len(record.names) >= PROCESS_MIN_PARAMETERS:
            self._start()
        if self.process is not None:
            try:
                pickle.dump(record, self.process.stdin, protocol=pickle.HIGHEST_PROTOCOL)
                self.process.stdin.flush()
                outcome, value, record.anomaly_flags = pickle.load(self.process.stdout)
            except Exception as e:  # it ended (or its answer cannot be read): it is stopped
                self._write_here_from_now(f"the local dump's process ended (exit code {self._kill()}: {e!r})",
                                          record.step)
            else:
                if outcome == "failed":
                    raise value
                record.summary_csv = value
                return
        write_step(self.dump_path, record, self.direction_format)

    def _start(self) -> None:
        try:
            self.process = start_module_process(__name__)
            pickle.dump((self.dump_path, self.direction_format, self.spike_rule), self.process.stdin)
            self.process.stdin.flush()
        except OSError as e:
            if self.process is not None:
                self._kill()
            self._write_here_from_now(f"the local dump's process could not start ({e!r})", None)
            return
        for pipe in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(ImportError, AttributeError, OSError):  # not Linux, or a lower limit: the
                import fcntl  # default pipe serves

                fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)

    def _write_here_from_now(self, why: str, step: int | None) -> None:
        self._in_thread = True
        since = "" if step is None else f" from step {step} on"
        self.notices.warn(f"{why}; the writer thread writes the local dump{since} (no step is lost, training may "
                          f"run slower)")

    def _kill(self) -> int | None:
        """Stops a process that failed us; the exit code it had ended with, if it had ended."""
        process, self.process = self.process, None
        code = process.poll()
        process.kill()
        process.wait()
        for pipe in (process.stdin, process.stdout):
            with contextlib.suppress(OSError):
                pipe.close()
        return code

    def close(self) -> None:
        """Tells the process to end, once the writer thread is done; safe to call twice. Nobody waits for its
        interpreter to exit: every step it was sent is on disk already (it answered each)."""
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(OSError):
            pickle.dump(None, process.stdin)
            process.stdin.close()
        process.stdout.close()
        threading.Thread(target=process.wait, daemon=True, name="msprobe-mlflow-dump-process-exit").start()


def main() -> None:
    """The process: writes the records read from stdin, one at a time, answering each, until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops training, which then closes this process
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print goes to stderr, not into the answers
    inbox = sys.stdin.buffer
    answering = True
    try:
        dump_path, direction_format, spike_rule = pickle.load(inbox)
        flags = AnomalyFlags(spike_rule) if spike_rule else None
        while (record := pickle.load(inbox)) is not None:
            answer = _written(dump_path, record, direction_format, flags)
            try:
                if answering:
                    answers.write(answer)
                    answers.flush()
            except BrokenPipeError:  # the training process ended: what it sent is still written
                answering = False
    except EOFError:
        return


def _written(dump_path: str, record: StepRecord, direction_format: str, flags: AnomalyFlags | None) -> bytes:
    """The answer to ``record``, pickled, once it is written: its CSV bytes, or the exception writing raised; then
    its anomaly flags (None: not judged here)."""
    judged = _judged(record, flags)
    try:
        write_step(dump_path, record, direction_format)
        return pickle.dumps(("written", summary_csv_bytes(record), judged), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        try:
            return pickle.dumps(("failed", e, judged), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # an exception that does not pickle: its text does
            return pickle.dumps(("failed", RuntimeError(repr(e)), judged))


def _judged(record: StepRecord, flags: AnomalyFlags | None) -> list | Exception | None:
    """``record``'s anomaly flags, or what judging raised (its text: it must pickle), for the sinks to report."""
    if flags is None:
        return None
    try:
        return flags.step_flags(record)
    except Exception as e:
        return RuntimeError(f"judging step {record.step}'s anomaly flags in the local dump's process: {e!r}")


if __name__ == "__main__":
    main()
