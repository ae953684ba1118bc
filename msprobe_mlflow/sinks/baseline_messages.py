"""The messages between a monitor and its live comparison process (``sinks/baseline_process.py``), pickled in
order over the process's stdin and stdout. In a module of their own so that both processes unpickle the same
classes (the process runs ``baseline_process`` as ``__main__``)."""
from __future__ import annotations

import dataclasses

from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.sinks.baseline import BaselineOptions


# Messages to the process: what it compares and when it flushes and closes (pickled, in order).
@dataclasses.dataclass(frozen=True)
class Setup:
    options: BaselineOptions
    config: GradProbeConfig
    rank: int
    has_run: bool
    describe_run: bool


@dataclasses.dataclass(frozen=True)
class Step:
    """A step to compare; ``names`` and ``shapes`` only when they changed since the last step sent (None: same)."""

    step: int
    names: list[str] | None = None
    shapes: list | None = None


@dataclasses.dataclass(frozen=True)
class WithoutDirections:
    """A step the always-on tier recorded statistics only for: by design, not a gap."""

    step: int


@dataclasses.dataclass(frozen=True)
class Flush:
    token: int


@dataclasses.dataclass(frozen=True)
class Close:
    not_handed_over: tuple[int, ...] = ()  # the steps the process never got


# Messages from the process: the run's findings, notices, the verdict, and its answers.
@dataclasses.dataclass(frozen=True)
class Annotate:
    findings: dict


@dataclasses.dataclass(frozen=True)
class Warn:
    text: str


@dataclasses.dataclass(frozen=True)
class Log:
    text: str


@dataclasses.dataclass(frozen=True)
class Suspicious:
    verdict: object


@dataclasses.dataclass(frozen=True)
class Ready:
    pass


@dataclasses.dataclass(frozen=True)
class Flushed:
    token: int


@dataclasses.dataclass(frozen=True)
class Closed:
    pass
