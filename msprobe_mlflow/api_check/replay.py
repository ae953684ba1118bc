"""Where the recorded calls are replayed: in the caller's process only when that leaves it as it was found, else
in worker processes.

MindSpore runs the statistics task's calls in PyNative mode with launch blocking on (``runner``). The mode can be
restored afterwards; launch blocking cannot (MindSpore 2.10 has no call that turns it off). So the calls run here
only when launch blocking is on already (the mode is then switched for the check and switched back) or when
MindSpore does not run at all (the tensor task) and one worker is asked for; otherwise in ``workers`` child
processes, which also keeps torch and MindSpore out of the caller's process.

Balance: the parent hands each worker its calls as it goes, ``CALLS_IN_FLIGHT`` ahead of its results, biggest
calls first (by their tensors' elements). Each worker's share thus follows the measured time of the calls it
ran, where msprobe's multi-device mode deals the APIs round-robin up front and the slowest share sets the pace.
Each worker runs on its own share of this process's CPUs (``core_shares``): MindSpore's runtime threads wait by
spinning, so two unpinned workers on two cores spent a third of their CPU time waiting on each other. A
worker that dies (killed, out of memory, a crash in a kernel) costs only the call it was running: that call gets
an ``error`` row naming how the worker ended, and a new worker takes the remaining calls.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import traceback
from contextlib import nullcontext
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Callable

import msprobe_mlflow

from msprobe_mlflow.api_check.metrics import ERROR, Thresholds
from msprobe_mlflow.api_check.parser import ApiCall, TensorArg
from msprobe_mlflow.api_check.results import ApiResult, OutputResult, SideResult

OnResult = Callable[[int, ApiResult], None]


def replay_calls(calls: list[ApiCall], task: str, thresholds: Thresholds, workers: int,
                 on_result: OnResult | None = None) -> list[ApiResult]:
    """The result of every call, in the order of ``calls``; ``on_result(index, result)`` as each arrives."""
    on_result = on_result or (lambda index, result: None)
    if workers == 1 and (task == "tensor" or _launch_blocking_is_on()):
        return _replay_here(calls, task, thresholds, on_result)
    return _WorkerPool(calls, task, thresholds, workers, on_result).run()


def check_workers(workers: object) -> int:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers = {workers!r} is not accepted; expected a whole number of processes, 1 or more")
    return workers


def _launch_blocking_is_on() -> bool:
    """Whether this process has MindSpore's launch blocking on; False when MindSpore was never imported here (its
    settings are then the defaults) or cannot say (the calls then go to a worker, which is always safe)."""
    if "mindspore" not in sys.modules:
        return False
    try:
        from mindspore._c_expression import RuntimeConf  # no public getter in MindSpore 2.10

        return bool(RuntimeConf.get_instance().is_launch_blocking())
    except (ImportError, AttributeError):
        return False


def _replay_here(calls: list[ApiCall], task: str, thresholds: Thresholds, on_result: OnResult) -> list[ApiResult]:
    from msprobe_mlflow.api_check.inputs import InputCache
    from msprobe_mlflow.api_check.runner import check_call, pynative_mode

    cache, results = InputCache(), []
    with pynative_mode() if task == "statistics" else nullcontext():  # the tensor task does not run MindSpore
        for index, call in enumerate(calls):
            results.append(check_call(call, task, thresholds, cache))
            on_result(index, results[-1])
    return results


def serve(connection: Connection) -> None:
    """A worker: receives ``(task, thresholds)``, answers ``("ready",)`` once MindSpore is set up (or ``("failed",
    text)``), then one ``("result", index, ApiResult)`` per ``(index, ApiCall)`` received, until ``None``."""
    task, thresholds = connection.recv()
    try:
        from msprobe_mlflow.api_check.inputs import InputCache
        from msprobe_mlflow.api_check.runner import check_call, prepare_worker_process

        prepare_worker_process()
        cache = InputCache()
    except BaseException:  # noqa: BLE001 - reported to the parent, which names it in the rows it cannot check
        connection.send(("failed", traceback.format_exc(limit=3).strip().splitlines()[-1]))
        return
    connection.send(("ready",))
    while (task_item := connection.recv()) is not None:
        index, call = task_item
        try:
            result = check_call(call, task, thresholds, cache)
        except Exception as error:  # noqa: BLE001 - check_call should not raise; if it does, that call's row says so
            result = _lost(call, f"the checker failed on this call: {type(error).__name__}: {error}")
        connection.send(("result", index, result))


def _estimated_cost(call: ApiCall) -> int:
    """Elements of the call's forward tensors, twice when it has a backward: what makes a call slow, roughly."""
    def elements(argument) -> int:
        if isinstance(argument, TensorArg):
            return argument.numel
        if isinstance(argument, tuple):
            return sum(elements(item) for item in argument)
        return 0

    forward = call.forward
    size = elements(forward.args) + elements(tuple(forward.kwargs.values())) if forward is not None else 0
    return (1 + size) * (2 if call.has_backward else 1)


def _lost(call: ApiCall, message: str) -> ApiResult:
    """The row of a call whose check did not come back: ``error`` on each side the dump has."""
    sides = {side: SideResult(ERROR, message, [OutputResult(f"{call.name}.{side}", ERROR, message)])
             for side in ("forward", "backward") if getattr(call, f"has_{side}")}
    if not sides:
        return ApiResult(call.name, ERROR, message)
    return ApiResult.from_sides(call.name, sides.get("forward"), sides.get("backward"), {})


def _how_it_ended(process: subprocess.Popen) -> str:
    code = process.wait()
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def core_shares(workers: int) -> list[list[int] | None]:
    """The CPUs each of ``workers`` workers may run on: this process's CPUs cut into contiguous blocks, one per
    worker (a CPU each, taken in turn, when there are more workers than CPUs); None (no pinning) for a single
    worker, or where the system has no CPU affinity."""
    if workers < 2 or not hasattr(os, "sched_getaffinity"):
        return [None] * workers
    cpus = sorted(os.sched_getaffinity(0))
    if workers >= len(cpus):
        return [[cpus[i % len(cpus)]] for i in range(workers)]
    cut = [len(cpus) * i // workers for i in range(workers + 1)]
    return [cpus[start:stop] for start, stop in zip(cut, cut[1:])]


class _Worker:
    """``python -m msprobe_mlflow.api_check.replay_worker FD [CPUS]``: a fresh interpreter, not multiprocessing's
    spawn, which would first run the caller's main script again in the worker (a training script without a
    ``__main__`` guard would train there). One duplex pipe carries everything; it reads as closed once the worker
    has ended. ``cpus``: the CPUs it is pinned to before it imports a framework (None: all of this process's)."""

    def __init__(self, task: str, thresholds: Thresholds, cpus: list[int] | None):
        self.cpus = cpus
        self.connection, child_end = multiprocessing.Pipe()
        package_root = str(Path(msprobe_mlflow.__file__).resolve().parent.parent)  # importable as the parent has it
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root,
                                                                                os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-m", f"{__package__}.replay_worker", str(child_end.fileno())]
        command += [",".join(map(str, cpus))] if cpus else []
        self.process = subprocess.Popen(command, pass_fds=[child_end.fileno()], env=environment,
                                        stdin=subprocess.DEVNULL)
        child_end.close()
        self.connection.send((task, thresholds))
        self.ready = False
        self.in_flight: list[int] = []  # indices of the calls sent, in order: the first is the one it is running


# Calls sent to a worker ahead of its results: the next is waiting when one ends, so a worker never idles while the
# parent (on a busy machine, last to be scheduled) records a result.
CALLS_IN_FLIGHT = 2


class _WorkerPool:
    def __init__(self, calls: list[ApiCall], task: str, thresholds: Thresholds, workers: int, on_result: OnResult):
        self.calls, self.task, self.thresholds, self.on_result = calls, task, thresholds, on_result
        self.pending = sorted(range(len(calls)), key=lambda i: (_estimated_cost(calls[i]), -i))  # popped from the end
        self.results: list[ApiResult | None] = [None] * len(calls)
        self.workers = [_Worker(task, thresholds, cpus) for cpus in core_shares(min(workers, len(calls)))]
        self.start_failure: str | None = None

    def run(self) -> list[ApiResult]:
        try:
            while self.workers and (self.pending or any(worker.in_flight for worker in self.workers)):
                ready = wait([worker.connection for worker in self.workers])
                for worker in list(self.workers):
                    if worker.connection in ready:
                        self._attend(worker)
        finally:
            for worker in self.workers:  # all told first: they end at once, not one after the other
                self._tell_to_end(worker)
            for worker in self.workers:
                self._stop(worker)
        reason = self.start_failure or "no worker process is left"
        for index in self.pending:  # every worker failed to start
            self._record(index, _lost(self.calls[index], f"not checked: the worker processes could not start "
                                                         f"({reason})"))
        return self.results

    def _attend(self, worker: _Worker) -> None:
        """Reads what the worker sent (even if it died since), hands it its next call, or replaces it if it died."""
        ended = False
        try:
            while worker.connection.poll():
                message = worker.connection.recv()
                if message[0] == "ready":
                    worker.ready = True
                elif message[0] == "result":
                    worker.in_flight.remove(message[1])
                    self._record(message[1], message[2])
                else:
                    ended, self.start_failure = True, message[1]
        except (EOFError, OSError):  # the worker has ended: its end of the pipe is closed
            ended = True
        if not ended:
            while worker.ready and len(worker.in_flight) < CALLS_IN_FLIGHT and self.pending:
                worker.in_flight.append(self.pending.pop())
                worker.connection.send((worker.in_flight[-1], self.calls[worker.in_flight[-1]]))
            return
        self._stop(worker)
        self.workers.remove(worker)
        if worker.in_flight:
            running, *queued = worker.in_flight
            self._record(running, _lost(self.calls[running], "the worker process running this call "
                                        f"ended ({_how_it_ended(worker.process)}) before it finished"))
            self.pending += reversed(queued)  # not started: popped next, by another worker
            if self.pending:  # it got as far as a call: a new one takes over
                self.workers.append(_Worker(self.task, self.thresholds, worker.cpus))
        elif not worker.ready and self.start_failure is None:
            self.start_failure = f"a worker ended ({_how_it_ended(worker.process)}) before it was ready"

    def _record(self, index: int, result: ApiResult) -> None:
        self.results[index] = result
        self.on_result(index, result)

    @staticmethod
    def _tell_to_end(worker: _Worker) -> None:
        try:
            worker.connection.send(None)
        except OSError:  # it has ended already
            pass

    @classmethod
    def _stop(cls, worker: _Worker) -> None:
        if worker.process.poll() is None:
            try:
                cls._tell_to_end(worker)
                worker.process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                worker.process.kill()
                worker.process.wait()
        worker.connection.close()
