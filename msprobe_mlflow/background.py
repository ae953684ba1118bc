"""The worker thread between the training thread and the disk (and MLflow): training never waits for I/O.

The training thread submits a *pending step*: a callable that turns what the device computed into a
:class:`StepRecord` (waiting for the one asynchronous device-to-host copy, hashing for MD5). The worker resolves
it and hands the record to each handler in order (the local dump first). The queue is bounded: when the disk is
slower than training, ``submit`` waits instead of letting memory grow, because the local dump must stay complete.
A failing handler is logged and remembered; it never stops the next steps nor touches files already written.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

from msprobe_mlflow.records import StepRecord

logger = logging.getLogger("msprobe_mlflow")

PendingStep = Callable[[], StepRecord]
StepHandler = Callable[[StepRecord], None]
_STOP = object()


class BackgroundStepWriter:
    def __init__(self, handlers: list[StepHandler], max_pending: int = 4, name: str = "msprobe-mlflow-writer"):
        self.handlers = list(handlers)
        self.errors: list[str] = []
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, pending: PendingStep, block: bool = True) -> None:
        """Queues a step; ``block=False`` raises ``queue.Full`` instead of waiting when ``max_pending`` are queued."""
        if not self._thread.is_alive():
            raise RuntimeError("the writer was closed; call monitor() again to start a new one")
        self._queue.put(pending, block=block)

    def flush(self) -> None:
        """Waits until every submitted step went through every handler."""
        if self._thread.is_alive():
            self._queue.join()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                self._process(item)
            finally:
                self._queue.task_done()

    def _process(self, pending: PendingStep) -> None:
        try:
            record = pending()
        except Exception as e:  # a device or hashing failure loses this step only
            self._report(f"could not collect a step's statistics: {e!r}")
            return
        for handler in self.handlers:
            self.guarded(f"{getattr(handler, '__qualname__', handler)} failed on rank {record.rank} "
                         f"step {record.step}", lambda: handler(record))

    def guarded(self, failure: str, action: Callable[[], None]) -> None:
        """Runs ``action``; an exception is logged and remembered in ``errors`` as ``failure``, never raised."""
        try:
            action()
        except Exception as e:
            self._report(f"{failure}: {e!r}")

    def _report(self, message: str) -> None:
        self.errors.append(message)
        logger.error("msprobe-mlflow: %s", message, exc_info=True)
