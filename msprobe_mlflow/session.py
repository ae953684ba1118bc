"""What every gradient monitor shares, whatever the framework: the config, the writer thread, the local dump
and the MLflow sink. A monitor only turns its framework's gradients into a pending :class:`StepRecord`."""
from __future__ import annotations

import os
import warnings
from pathlib import Path

from msprobe_mlflow.background import BackgroundStepWriter, PendingStep, StepHandler
from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.dump import write_step


def load_config(config: GradProbeConfig | str | os.PathLike | dict) -> GradProbeConfig:
    """A config given as the dataclass, a ``config.json`` path or its parsed dict."""
    if isinstance(config, GradProbeConfig):
        return config
    if isinstance(config, dict):
        return GradProbeConfig.from_dict(config)
    return GradProbeConfig.from_json(config)


def ensure_writable_folder(path: str) -> None:
    """Fails before training starts, not mid-run, when the dump folder cannot be written."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".msprobe-mlflow-write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"dump_path = {path!r} is not a writable folder ({e.strerror or e})") from e


class ProbeSession:
    """One monitoring session: a writer thread that writes each step to the local dump, then to ``handlers``."""

    def __init__(self, config: GradProbeConfig, *, framework: str, handlers: list[StepHandler] = ()):
        ensure_writable_folder(config.dump_path)
        self.config = config
        self.framework = framework
        self._writer = BackgroundStepWriter([self._write_local_dump, *handlers])

    def _write_local_dump(self, record) -> None:
        write_step(self.config.dump_path, record, self.config.direction_format)

    def submit(self, pending: PendingStep) -> None:
        self._writer.submit(pending)

    @property
    def errors(self) -> list[str]:
        """What the writer thread could not do (each also logged)."""
        return list(self._writer.errors)

    def flush(self) -> None:
        """Waits until every submitted step is on disk and through every handler."""
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
        if self._writer.errors:
            warnings.warn(f"msprobe-mlflow: {len(self._writer.errors)} write failure(s); first: "
                          f"{self._writer.errors[0]}")
