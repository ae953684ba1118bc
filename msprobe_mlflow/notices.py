"""The one policy for telling the user about a problem: every problem goes to the ``msprobe_mlflow`` logger, and
the ones a user must act on also become a Python warning, unless ``silent`` (MLflow's autologging convention:
``silent=True`` means no warnings, the logger only). Beside problems, a monitor says two plain lines on stderr, when
it starts and when it ends (:meth:`Notices.say`); ``silent`` sends them to the logger too.

The warnings are :class:`MsprobeMlflowWarning` (a ``UserWarning``) and print as one line, ``msprobe-mlflow:
warning: <message>``, like the command line's, instead of Python's ``file:line: UserWarning: ...`` followed by a
source line of the package's internals: while each one is shown, ``warnings.formatwarning`` formats this category so
and hands every other to what was there, then is put back (other libraries' warnings keep their format; a
``showwarning`` of the user's, a notebook's or pytest's recording still gets the warning as it is)."""
from __future__ import annotations

import logging
import sys
import threading
import warnings
from contextlib import contextmanager
from typing import Iterator

logger = logging.getLogger("msprobe_mlflow")
PREFIX = "msprobe-mlflow: "  # what each warning's and each line's text starts with
_formatting = threading.RLock()


class MsprobeMlflowWarning(UserWarning):
    """A warning of msprobe-mlflow (filter them with ``warnings.filterwarnings("ignore", category=...)``)."""


def _one_line(message, category, filename, lineno, line=None) -> str:
    return f"{PREFIX}warning: {str(message).removeprefix(PREFIX)}\n"


@contextmanager
def _warnings_in_one_line() -> Iterator[None]:
    """:class:`MsprobeMlflowWarning` formatted as one line while the block runs; any other category as before."""
    with _formatting:
        previous = warnings.formatwarning

        def formatwarning(message, category, filename, lineno, line=None) -> str:
            if issubclass(category, MsprobeMlflowWarning):
                return _one_line(message, category, filename, lineno, line)
            return previous(message, category, filename, lineno, line)

        warnings.formatwarning = formatwarning
        try:
            yield
        finally:
            if warnings.formatwarning is formatwarning:  # not replaced meanwhile by someone else's
                warnings.formatwarning = previous


def warn(message: str, stacklevel: int = 2) -> None:
    """``msprobe-mlflow: <message>`` as an :class:`MsprobeMlflowWarning`, shown as one line."""
    with _warnings_in_one_line():
        warnings.warn(MsprobeMlflowWarning(f"{PREFIX}{message}"), stacklevel=stacklevel + 1)


class Notices:
    """How one monitor (and its sinks) report problems; ``failure`` counts them, so repeats are logged, not warned."""

    def __init__(self, silent: bool = False):
        self.silent = silent
        self.failures: dict[str, int] = {}

    def warn(self, message: str) -> None:
        """A problem the user should see: a warning (``silent``: a logged warning only)."""
        if self.silent:
            logger.warning("msprobe-mlflow: %s", message)
        else:
            warn(message, stacklevel=3)

    def say(self, line: str) -> None:
        """What the user is told without a problem (a monitor's start and end): one line on stderr (``silent``:
        the logger, at INFO)."""
        if self.silent:
            logger.info("msprobe-mlflow: %s", line)
        else:
            print(f"{PREFIX}{line}", file=sys.stderr, flush=True)

    def log(self, message: str) -> None:
        """A detail for the log only (a repeat, or what a warning already said)."""
        logger.warning("msprobe-mlflow: %s", message)

    def failure(self, kind: str, message: str) -> None:
        """An exception caught so that training goes on: logged with its traceback each time, warned about the
        first time per ``kind``. Call it from the ``except`` block."""
        self.failures[kind] = self.failures.get(kind, 0) + 1
        logger.error("msprobe-mlflow: %s", message, exc_info=True)
        if self.failures[kind] == 1:
            self.warn(f"{message}; training goes on")
