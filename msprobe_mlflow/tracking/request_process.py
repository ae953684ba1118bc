"""The live sink's round requests (:class:`LiveRun`'s ``log``, ``send_step_files``, ``send_archive``,
``send_dump_file``, and the exponent pictures drawn while training runs), made by a process of its own once steps
come fast.

Why: each request is Python in MLflow's client (SQLAlchemy for a database store, the artifact repository's path
checks and copies), on the sink's thread, which shares the interpreter lock with training: training waits for it
at every torch call that hands the lock back. With fast steps of many small tensors that cost 1.3x-1.4x a step
(``benchmarks/monitor_benchmark.py``, MLflow on against off, 256 x Linear(64, 64)); in a process of its own it holds
nothing of the training's, and the sink's thread waits for each answer without the lock.

When: the sink's send loop asks for it (``sinks/mlflow/sender.py``: a round of several steps while training runs,
where a CPU is idle); slower trainings, short ones and busy CPUs never start it, as starting it imports MLflow (a
second of CPU) and it then competes with training for a CPU.

How: as the local dump's process (:mod:`msprobe_mlflow.dump_process`): the request's name and arguments pickled on its
input, the answer on its output (None, or the failure's text and MLflow error code, so that refused credentials are
told as before). If it cannot start or ends, the sink's thread makes the requests itself from then on, said once,
the one whose answer was lost included (MLflow keeps one of equal metric values; files are overwritten). If training
dies, its input closes and it ends.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import threading

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import ErrorCode

from msprobe_mlflow.dump_process import start_module_process
from msprobe_mlflow.notices import Notices
from msprobe_mlflow.tracking.live_run import LiveRun

REQUESTS = ("log", "send_step_files", "send_archive", "send_dump_file", "send_exponent_pictures")


class RoundRequests:
    """:class:`LiveRun`'s round requests, made in the calling thread or, after :meth:`move_to_process`, by a process."""

    def __init__(self, run: LiveRun, notices: Notices):
        self.run, self.notices = run, notices
        self.process: subprocess.Popen | None = None
        self.used_process = False  # a process made requests (it may have ended since)
        self._in_thread = False  # the process could not start or ended: every request is made here

    def log(self, metrics=(), tags=None, in_dump=None) -> None:
        self._make("log", metrics, tags, in_dump)

    def send_step_files(self, dump_path: str, rank: int, steps: list[int]) -> None:
        self._make("send_step_files", dump_path, rank, steps)

    def send_archive(self, dump_path: str, rank: int, steps: list[int]) -> None:
        self._make("send_archive", dump_path, rank, steps)

    def send_dump_file(self, dump_path: str, path) -> None:
        self._make("send_dump_file", dump_path, path)

    def send_exponent_pictures(self, dump_path: str, rank: int, mlflow_step_offset: int,
                               first_and_latest: bool) -> None:
        self._make("send_exponent_pictures", dump_path, rank, mlflow_step_offset, first_and_latest)

    def move_to_process(self) -> None:
        """Makes the next requests in a process of its own; once only (not again after it failed)."""
        if self.process is not None or self._in_thread:
            return
        try:
            self.process = start_module_process(__name__)
            pickle.dump((self.run.run_id, self.run.tracking_uri), self.process.stdin)
            self.process.stdin.flush()
        except OSError as e:
            self._in_thread_from_now(f"could not start ({e!r})")
            return
        self.used_process = True

    def _make(self, name: str, *args) -> None:
        if self.process is None:
            getattr(self.run, name)(*args)
            return
        try:
            pickle.dump((name, args), self.process.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.process.stdin.flush()
            failure = pickle.load(self.process.stdout)
        except Exception as e:  # it ended (or its answer cannot be read): this request and the next ones are ours
            self._in_thread_from_now(f"ended (exit code {self._stop(kill=True)}: {e!r})")
            getattr(self.run, name)(*args)  # again, should it have been made: MLflow keeps one of equal values
            return
        if failure is not None:
            text, error_code = failure
            raise MlflowException(text, error_code=ErrorCode.Value(error_code)) if error_code else RuntimeError(text)

    def _in_thread_from_now(self, why: str) -> None:
        self._in_thread = True
        self.notices.warn(f"the MLflow request process {why}; the sink's thread makes the requests from now on "
                          f"(nothing is lost, training may run slower)")

    def close(self) -> None:
        """Tells the process to end; every request was answered already. Safe to call twice."""
        self._stop(kill=False)

    def _stop(self, kill: bool) -> int | None:
        process, self.process = self.process, None
        if process is None:
            return None
        code = process.poll()
        with contextlib.suppress(OSError):
            if kill:
                process.kill()
            else:
                pickle.dump(None, process.stdin)
            process.stdin.close()
        process.stdout.close()
        threading.Thread(target=process.wait, daemon=True, name="msprobe-mlflow-request-process-exit").start()
        return code


def main() -> None:
    """The process: makes the requests read from stdin, one at a time, answering each, until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops training, which then closes this process
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print goes to stderr, not into the answers
    inbox = sys.stdin.buffer
    try:
        run = LiveRun(*pickle.load(inbox))
        while (request := pickle.load(inbox)) is not None:
            name, args = request
            answers.write(pickle.dumps(_answer(run, name, args), protocol=pickle.HIGHEST_PROTOCOL))
            answers.flush()
    except (EOFError, BrokenPipeError):  # training ended: nobody waits for an answer
        return


def _answer(run: LiveRun, name: str, args: tuple) -> tuple[str, str | None] | None:
    """None when the request succeeded, else its failure's text and MLflow error code (exceptions need not pickle)."""
    try:
        if name not in REQUESTS:
            raise ValueError(f"unknown request {name!r} (expected one of {', '.join(REQUESTS)})")
        getattr(run, name)(*args)
        return None
    except Exception as e:
        return str(e), e.error_code if isinstance(e, MlflowException) else None


if __name__ == "__main__":
    main()
