"""What the live MLflow sink's queue holds, and the drain deadline its parts share."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from msprobe_mlflow.sinks.mlflow import settings
from msprobe_mlflow.tracking.live_run import MetricPoint

CLOSE, FLUSH = object(), object()  # the queue's two orders besides steps and findings


@dataclass(frozen=True)
class QueuedStep:
    """One step of this rank (its files follow its ``metrics``) and, on rank 0 under aggregation, the distributions
    over the ranks that came with it (``gathered``). ``in_dump``: its metrics are read from the local dump by the
    request process (``tracking.live_run.DumpSteps``), not computed on the writer thread."""

    step: int
    metrics: list[MetricPoint]
    gathered: list[MetricPoint]
    in_dump: bool = False


@dataclass(frozen=True)
class Annotation:
    """Findings another sink adds to the run: ``metrics`` at MLflow step ``step``, ``tags``, and ``files`` inside the
    dump folder, sent as the ``grad_probe/`` artifacts that mirror them (read when sent: the latest content)."""

    step: int
    metrics: dict[str, float]
    tags: dict[str, str]
    files: tuple[Path, ...]


class Drain:
    """``stop()``'s time to send what is left (``MSPROBE_MLFLOW_DRAIN_SECONDS``), from when it starts."""

    def __init__(self):
        self.deadline: float | None = None

    def start(self) -> None:
        self.deadline = time.monotonic() + settings.DRAIN_SECONDS

    def over(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline
