"""The one policy for telling the user about a problem: every problem goes to the ``msprobe_mlflow`` logger, and
the ones a user must act on also become a Python warning, unless ``silent`` (MLflow's autologging convention:
``silent=True`` means no warnings, the logger only)."""
from __future__ import annotations

import logging
import warnings

logger = logging.getLogger("msprobe_mlflow")


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
            warnings.warn(f"msprobe-mlflow: {message}", stacklevel=3)

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
