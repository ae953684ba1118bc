"""The live MLflow sink's thread: a bounded queue, at most one round of requests a second (everything queued
meanwhile goes in one round), ``flush()`` and ``close()`` end the wait early; a round that fails, or that ``stop()``
has no time left for, leaves its steps and findings unsent. A round of ``PROCESS_MIN_ROUND_STEPS`` steps or more
while training runs (steps come fast), when the CPUs this process may run on stayed ``PROCESS_MIN_SPARE_CPUS`` idle
since the last round (``/proc/stat``), moves the requests to a process of their own
(:mod:`msprobe_mlflow.tracking.request_process`): it takes the requests' Python off the interpreter lock training
needs, but competes with training for a CPU, so it pays only where one is idle (measured, MLflow on/off on a step of
512 small tensors: torch on 1 of 2 CPUs 1.32x in the thread, 1.01x-1.03x moved; on both 1.09x in the thread, 1.18x
moved). Not at ``stop()``, where starting it would only delay the end."""
from __future__ import annotations

import os
import queue
import threading
import time

from msprobe_mlflow.sinks.mlflow import settings
from msprobe_mlflow.sinks.mlflow.attempts import Attempts
from msprobe_mlflow.sinks.mlflow.items import CLOSE, FLUSH, Annotation, Drain, QueuedStep
from msprobe_mlflow.sinks.mlflow.rounds import Rounds
from msprobe_mlflow.sinks.mlflow.unsent import Unsent


class SendLoop:
    def __init__(self, rank: int, max_pending: int, rounds: Rounds, unsent: Unsent, attempt: Attempts,
                 drain: Drain, between_rounds=None):
        self.rounds, self.unsent, self.attempt, self.drain = rounds, unsent, attempt, drain
        self.between_rounds = between_rounds  # called after each round that went through while training runs
        self.started = threading.Event()  # the first request (``first`` of :meth:`start`) was answered
        self._closing = threading.Event()
        self._wake = threading.Event()  # ends the wait between rounds early: flush() and close()
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread = threading.Thread(target=self._work, name=f"msprobe-mlflow-sink-rank{rank}", daemon=True)
        self._first = None
        self._cpu_mark = (time.monotonic(), 0.0, _busy_seconds())  # for _spare_cpus

    def start(self, first) -> None:
        """Starts the thread, whose first request is ``first()``; nothing more is sent if it is refused."""
        self._first = first
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def put(self, item) -> bool:
        """Queues ``item`` without waiting; False when the queue is full."""
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            return False
        return True

    def flush(self) -> None:
        """Waits until what was queued so far is sent, or remembered as unsent."""
        if self._thread.is_alive():
            self._queue.put(FLUSH)
            self._wake.set()
            self._queue.join()

    def close(self) -> None:
        """Sends what is queued within the drain time, then ends the thread."""
        if self._thread.is_alive():
            self.drain.start()
            self._closing.set()
            self._queue.put(CLOSE)
            self._wake.set()
            self._thread.join()

    def _work(self) -> None:
        self.attempt("describe the run", self._first)
        self.started.set()
        if self.attempt.refused:
            return
        last_round = 0.0
        while True:
            items = [self._queue.get()]
            if items[0] not in (CLOSE, FLUSH):  # at most one round of requests a second, unless asked
                self._wake.wait(max(0.0, last_round + settings.SEND_INTERVAL_SECONDS - time.monotonic()))
            self._wake.clear()
            last_round = time.monotonic()
            while True:  # coalesce everything queued meanwhile into one round of requests
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._round([item for item in items if isinstance(item, QueuedStep)],
                        [item for item in items if isinstance(item, Annotation)])
            if CLOSE in items and self.rounds.unarchived and not (self.attempt.failure or self.drain.over()):
                self.attempt("send the last archive of step files", self.rounds.send_archive)
            if CLOSE not in items and self.between_rounds is not None and not self.attempt.failure:
                self.between_rounds()  # before task_done(): flush() waits for it too
            for _ in items:
                self._queue.task_done()
            if CLOSE in items:
                self.unsent.steps.update(self.rounds.unarchived)
                return

    def _spare_cpus(self) -> float:
        """The CPUs this process may run on that stayed idle since the last round (``/proc/stat``: whoever kept
        them busy; elsewhere, what this process left idle of them), plus this thread's share: the requests' own
        CPU, which the move takes away."""
        now, own, busy = time.monotonic(), time.thread_time(), _busy_seconds()
        (then, own_then, busy_then), self._cpu_mark = self._cpu_mark, (now, own, busy)
        if now <= then:
            return 0.0
        return len(_cpus()) - (busy - busy_then - (own - own_then)) / (now - then)

    def _round(self, steps: list[QueuedStep], annotations: list[Annotation]) -> None:
        if not (steps or annotations):
            return
        numbers = [item.step for item in steps]
        spare = self._spare_cpus()
        if (len(steps) >= settings.PROCESS_MIN_ROUND_STEPS and not self._closing.is_set()
                and spare >= settings.PROCESS_MIN_SPARE_CPUS):
            self.rounds.requests.move_to_process()  # steps come fast; at stop(), starting it would only delay
        what = f"log steps {numbers[0]}..{numbers[-1]}" if steps else "log the live findings"
        retry = self.unsent.take_gathered()
        if (self._closing.is_set() and (self.attempt.failure or self.drain.over())  # no waiting at exit
                or not self.attempt(what, lambda: self.rounds.send(steps, annotations, retry))):
            self.unsent.steps.update(numbers)
            self.unsent.keep_gathered(retry + [m for item in steps for m in item.gathered])
            self.unsent.annotations += annotations


def _cpus() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def _busy_seconds() -> float:
    """CPU seconds this process's CPUs spent busy since boot, by anyone (``/proc/stat``); where that cannot be
    read, this process's own CPU time."""
    cpus, busy = {f"cpu{n}" for n in _cpus()}, 0.0
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            for line in stat:
                name, *fields = line.split()
                if name in cpus:
                    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
                    busy += user + nice + system + irq + softirq + steal
    except (OSError, ValueError):
        return time.process_time()
    return busy / os.sysconf("SC_CLK_TCK")
